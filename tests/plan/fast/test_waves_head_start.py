"""Stages that differ by a hair: the head start of the slow first stage lasts longer than the step.

The state then never repeats shifted by one constant; the wave pass skips the stretches where
every entry grows at its own fixed rate (`periodic.LinearRegime`) and must still give the
event-driven simulator's figures.
"""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.plan.fast import periodic
from builders import head_start_costs
from pipectl.plan.simulate import simulate
from pipectl.plan.timing import summary_of
from pipectl.schedule import generate
from pipectl.schedule.ir import ScheduleKind


def assert_as_simulated(kind, p, m, v, recompute, costs):
    summary = summary_of(kind, p, m, v, recompute, costs)
    timeline = simulate(generate(kind, p, m, v, recompute), costs)
    assert math.isclose(summary.step_seconds, timeline.step_seconds, rel_tol=1e-12)
    for ours, theirs in zip(summary.communication_seconds_per_rank, timeline.communication_seconds_per_rank, strict=True):
        assert math.isclose(ours, theirs, rel_tol=1e-9, abs_tol=1e-9)
    for ours, theirs in zip(summary.bubble_fraction, timeline.bubble_fraction, strict=True):
        assert abs(ours - theirs) <= 1e-12


@pytest.mark.parametrize(
    "kind, p, m, v, recompute",
    [
        (ScheduleKind.ONE_F_ONE_B, 16, 2000, 1, True),
        (ScheduleKind.PIPEDREAM_2BW, 16, 2000, 1, True),
        (ScheduleKind.ONE_F_ONE_B, 24, 1000, 1, False),
        (ScheduleKind.INTERLEAVED, 8, 400, 2, True),
    ],
)
def test_a_long_head_start_is_skipped_and_stays_exact(kind, p, m, v, recompute, repeat_searches):
    costs = head_start_costs(p * v, p, 3e-4, 0.1)
    assert_as_simulated(kind, p, m, v, recompute, costs)
    # Without the per-entry skip every steady wave is walked (hundreds of searches).
    assert len(repeat_searches) < 40


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([ScheduleKind.ONE_F_ONE_B, ScheduleKind.PIPEDREAM_2BW, ScheduleKind.INTERLEAVED]),
    st.integers(2, 10),
    st.integers(100, 500),
    st.floats(1e-5, 1e-2),
    st.floats(0.0, 0.2),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_nearly_equal_stages_give_the_simulated_figures(kind, p, m, slower, heavier_last, recompute, rng):
    v = 2 if kind is ScheduleKind.INTERLEAVED else 1
    if v > 1:
        m = p * (m // p)
    assert_as_simulated(kind, p, m, v, recompute, head_start_costs(p * v, p, slower, heavier_last, rng))


def test_cycles_keeping_sides():
    tolerance = 1e-12
    cycles = periodic.cycles_keeping_sides
    # A margin shrinking by 1 a cycle from 4: 3, 2, 1 are safe; one cycle is kept in reserve.
    assert cycles(np_array([5.0, 1.0]), np_array([4.0, 1.0]), tolerance) == 2
    # Growing margins and ties that stay ties never change sides.
    assert cycles(np_array([1.0, 0.0, -2.0]), np_array([2.0, 0.0, -3.0]), tolerance) > 10**9
    # A margin that crossed zero between the two cycles, or sits at zero and drifts: no skip.
    assert cycles(np_array([1.0]), np_array([-1.0]), tolerance) == 0
    assert cycles(np_array([-1.0]), np_array([0.0]), tolerance) == 0


def np_array(values):
    import numpy as np

    return np.array(values)


def test_random_nearly_equal_costs_long_steps():
    rng = random.Random(11)
    for kind, p, m in [(ScheduleKind.ONE_F_ONE_B, 12, 1500), (ScheduleKind.ONE_F_ONE_B, 5, 3000)]:
        assert_as_simulated(kind, p, m, 1, True, head_start_costs(p, p, rng.uniform(1e-4, 1e-3), 0.05, rng))
