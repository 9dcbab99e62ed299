"""The wave form of GPipe / 1F1B / 2BW / interleaved gives the event-driven simulator's figures."""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.plan.fast import waves
from pipectl.plan.simulate import simulate, simulate_step_seconds
from pipectl.plan.stage_costs import uniform_costs
from pipectl.plan.timing import actions_per_step, step_seconds_of, summary_of
from pipectl.schedule import generate
from pipectl.schedule.ir import ScheduleKind
from builders import random_stage_costs

WAVE_KINDS = [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.PIPEDREAM_2BW, ScheduleKind.INTERLEAVED]


random_costs = random_stage_costs


def same(a, b, rel=1e-12):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(WAVE_KINDS),
    st.integers(1, 9),
    st.integers(1, 40),
    st.integers(2, 4),
    st.booleans(),
    st.sampled_from([1.0, 0.05, 0.0]),
    st.randoms(use_true_random=False),
)
def test_equals_the_event_driven_simulator(kind, p, m, v, recompute, spread, rng):
    if kind is ScheduleKind.INTERLEAVED:
        m = p * (1 + m % 6)
    else:
        v = 1
    costs = random_costs(p, v, rng, spread)
    timeline = simulate(generate(kind, p, m, v, recompute), costs)
    assert same(step_seconds_of(kind, p, m, v, recompute, costs), timeline.step_seconds)
    summary = summary_of(kind, p, m, v, recompute, costs)
    assert same(summary.step_seconds, timeline.step_seconds)
    for ours, theirs in zip(summary.bubble_fraction, timeline.bubble_fraction, strict=True):
        assert abs(ours - theirs) <= 1e-12
    for ours, theirs in zip(summary.communication_seconds_per_rank, timeline.communication_seconds_per_rank, strict=True):
        assert same(ours, theirs, 1e-9)
    assert same(summary.communication_seconds, timeline.communication_seconds, 1e-9)


@pytest.mark.parametrize(
    "kind, p, m, v",
    [
        (ScheduleKind.ONE_F_ONE_B, 6, 300, 1),
        (ScheduleKind.ONE_F_ONE_B, 12, 200, 1),
        (ScheduleKind.INTERLEAVED, 4, 96, 2),
        (ScheduleKind.INTERLEAVED, 3, 60, 3),
        (ScheduleKind.GPIPE, 8, 200, 1),
    ],
)
@pytest.mark.parametrize("seed", range(4))
def test_long_steps_with_a_periodic_jump_stay_exact(kind, p, m, v, seed):
    """Many micro-batches: the skipped steady waves must add exactly what simulating them would."""
    rng = random.Random(seed)
    for spread in (0.0, 0.01, 1.0):
        costs = random_costs(p, v, rng, spread)
        schedule = generate(kind, p, m, v, seed % 2 == 1)
        assert same(step_seconds_of(kind, p, m, v, seed % 2 == 1, costs), simulate_step_seconds(schedule, costs))


@pytest.mark.parametrize("kind, p, v", [(ScheduleKind.ONE_F_ONE_B, 4, 1), (ScheduleKind.INTERLEAVED, 4, 2)])
def test_a_long_step_skips_its_repeating_waves(kind, p, v, repeat_searches):
    """A repeat is found early and the rest of the steady part is skipped, not simulated."""
    costs = random_costs(p, v, random.Random(7), 0.05)
    long_step = step_seconds_of(kind, p, 40_000, v, False, costs)
    assert len(repeat_searches) < 200
    short_step = step_seconds_of(kind, p, 400, v, False, costs)
    assert short_step == pytest.approx(simulate_step_seconds(generate(kind, p, 400, v), costs), rel=1e-12)
    # Past the transient the step grows by the same amount per micro-batch.
    middle_step = step_seconds_of(kind, p, 20_200, v, False, costs)
    assert long_step - middle_step == pytest.approx(middle_step - short_step, rel=1e-9)


def test_jitter_and_varuna_take_the_event_driven_path():
    assert not waves.supported(ScheduleKind.VARUNA, 0.0)
    assert not waves.supported(ScheduleKind.ONE_F_ONE_B, 0.1)
    costs = uniform_costs(3, 1, 1.0, 2.0, jitter=0.2, seed=5)
    schedule = generate(ScheduleKind.ONE_F_ONE_B, 3, 5)
    assert step_seconds_of(ScheduleKind.ONE_F_ONE_B, 3, 5, 1, False, costs) == simulate_step_seconds(schedule, costs)
    varuna = uniform_costs(3, 1, 1.0, 2.0)
    assert step_seconds_of(ScheduleKind.VARUNA, 3, 5, 1, True, varuna) == simulate_step_seconds(
        generate(ScheduleKind.VARUNA, 3, 5), varuna
    )


@pytest.mark.parametrize("kind", list(ScheduleKind))
@pytest.mark.parametrize("recompute", [False, True])
def test_actions_per_step_counts_the_timed_actions(kind, recompute):
    p, m, v = 3, 6, (2 if kind in (ScheduleKind.INTERLEAVED, ScheduleKind.ZBV) else 1)
    schedule = generate(kind, p, m, v, recompute)
    timed = sum(1 for actions in schedule.actions.values() for a in actions if not a.kind.is_p2p)
    assert actions_per_step(kind, p, m, v, recompute) == timed
