"""Varuna on nearly equal stages: the slow first stage's head start outlasts many cycles.

The live state then grows at different rates per entry for hundreds of cycles; the flat pass
skips those stretches (`periodic.LinearRegime`) and must still give the simulator's figures.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.plan.fast import varuna
from pipectl.plan.simulate import simulate
from pipectl.schedule import generate
from pipectl.schedule.ir import ScheduleKind
from builders import head_start_costs


def assert_as_simulated(p, m, costs):
    fast = varuna.summary(p, m, costs)
    timeline = simulate(generate(ScheduleKind.VARUNA, p, m), costs)
    assert math.isclose(fast.step_seconds, timeline.step_seconds, rel_tol=1e-12)
    for mine, theirs in zip(fast.communication_seconds_per_rank, timeline.communication_seconds_per_rank, strict=True):
        assert math.isclose(mine, theirs, rel_tol=1e-9, abs_tol=1e-9)
    for mine, theirs in zip(fast.bubble_fraction, timeline.bubble_fraction, strict=True):
        assert abs(mine - theirs) <= 1e-12


@pytest.mark.parametrize("p, m, slower", [(12, 1200, 2e-4), (20, 900, 1e-4), (7, 1500, 5e-4)])
def test_a_long_head_start_is_skipped_and_stays_exact(p, m, slower, monkeypatch):
    costs = head_start_costs(p, p, slower, -0.1, alternating_links=False)
    advances = []
    original = varuna._Run.advance

    def counting(self, stop):
        advances.append(1)
        return original(self, stop)

    monkeypatch.setattr(varuna._Run, "advance", counting)
    assert_as_simulated(p, m, costs)
    # Cycle by cycle this takes hundreds of passes; the skips leave a few dozen.
    assert len(advances) < 60


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 10), st.integers(60, 400), st.floats(1e-5, 1e-2), st.floats(-0.12, 0.2), st.booleans(),
       st.randoms(use_true_random=False))
def test_nearly_equal_stages_give_the_simulated_figures(p, m, slower, heavier_last, alternating, rng):
    assert_as_simulated(p, m, head_start_costs(p, p, slower, heavier_last, rng, alternating_links=alternating))
