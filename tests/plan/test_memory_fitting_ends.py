"""The memoised furthest fitting stage end against a scan over every end."""

from __future__ import annotations

import random

import pytest

from pipectl.plan.layer_table import layer_table
from pipectl.plan.memory_ranges import FurthestFittingEnds, RangeMemory
from pipectl.testing.profiles import synthetic_profile


def _scan(
    rows: RangeMemory, start: int, state_bytes: float, step_bytes: float, units: int, keeps_input_only: bool,
    capacity: float,
) -> int:
    best = start
    for end in range(start + 1, len(rows.input_bytes)):
        if rows.stage_bytes(
            start, end, state_bytes=state_bytes, step_bytes=step_bytes, units=units, recompute=keeps_input_only
        ) <= capacity:
            best = end
    return best


@pytest.mark.parametrize("working", [0.0, 8.0])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("t", [1, 2])
def test_furthest_end_is_the_last_end_that_fits(tied, t, working):
    table = layer_table(
        synthetic_profile(blocks=9, micro_batch_sizes=[1, 2], tied=tied, hidden=96, head_working_per_logit=working), 2
    )
    rows = RangeMemory.build(table, t)
    layers = table.layers
    everything = rows.stage_bytes(0, layers, state_bytes=16.0, step_bytes=24.0, units=4, recompute=False)
    rng = random.Random(7 + t + tied)
    for capacity in (0.0, everything * 0.05, everything * 0.2, everything * 0.5, everything * 2):
        ends = FurthestFittingEnds(rows, capacity)
        for _ in range(120):
            start = rng.randrange(layers)
            # Training and optimizer-step bytes per parameter (the step's bind when activations are few).
            state_bytes, step_bytes = rng.choice(((4.0, 4.0), (7.0, 9.0), (16.0, 24.0), (4 + 12 / 3, 4 + 20 / 3), (8.0, 40.0)))
            units = rng.randint(1, 6)
            keeps = rng.random() < 0.5
            expected = _scan(rows, start, state_bytes, step_bytes, units, keeps, capacity)
            assert ends.end(start, state_bytes, step_bytes, units, keeps) == expected
            assert ends.row(state_bytes, step_bytes, units, keeps)[start] == expected  # remembered as computed
