"""The in-flight counts written as ranges equal their per-rank definitions (docs/design.md, 'Memory model')."""

from __future__ import annotations

from pipectl.plan.memory import in_flight_units
from pipectl.schedule import ScheduleKind


def test_one_f_one_b_and_varuna_counts_match_the_per_rank_formulas():
    for p in range(1, 40):
        for m in range(1, 130):
            assert in_flight_units(ScheduleKind.ONE_F_ONE_B, p, m) == tuple(min(p - k, m) for k in range(p))
            assert in_flight_units(ScheduleKind.VARUNA, p, m) == tuple(
                min(3 * (p - 1 - k), m) if k < p - 1 else 1 for k in range(p)
            )
