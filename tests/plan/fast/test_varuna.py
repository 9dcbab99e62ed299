"""Varuna's flat-array timing gives the event-driven simulator's figures on non-uniform costs."""

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.plan.fast import varuna, varuna_flags
from pipectl.plan.stage_costs import StageCosts
from pipectl.plan.simulate import simulate
from pipectl.plan.timing import step_seconds_of, summary_of
from pipectl.schedule import generate
from pipectl.schedule.ir import ScheduleKind
from builders import random_stage_costs


def random_costs(p, rng, spread):
    return random_stage_costs(p, 1, rng, spread)


def same(a, b, rel=1e-12):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 10), st.integers(1, 50), st.sampled_from([1.0, 0.05, 0.0]), st.randoms(use_true_random=False))
def test_equals_the_event_driven_simulator(p, m, spread, rng):
    costs = random_costs(p, rng, spread)
    timeline = simulate(generate(ScheduleKind.VARUNA, p, m), costs)
    fast = varuna.summary(p, m, costs)
    assert same(fast.step_seconds, timeline.step_seconds)
    assert same(varuna.step_seconds(p, m, costs), timeline.step_seconds)
    noise = max(1e-12, 1e-12 * timeline.step_seconds)  # see test_skipping_repeated_cycles_...
    assert math.isclose(fast.communication_seconds, timeline.communication_seconds, rel_tol=1e-9, abs_tol=noise)
    for mine, theirs in zip(fast.bubble_fraction, timeline.bubble_fraction, strict=True):
        assert math.isclose(mine, theirs, rel_tol=1e-9, abs_tol=1e-12)
    for mine, theirs in zip(fast.communication_seconds_per_rank, timeline.communication_seconds_per_rank, strict=True):
        assert math.isclose(mine, theirs, rel_tol=1e-9, abs_tol=noise)


def test_planner_entry_points_take_the_flat_path_and_agree():
    rng = random.Random(7)
    costs = random_costs(6, rng, 1.0)
    timeline = simulate(generate(ScheduleKind.VARUNA, 6, 40), costs)
    assert same(step_seconds_of(ScheduleKind.VARUNA, 6, 40, 1, True, costs), timeline.step_seconds)
    assert same(summary_of(ScheduleKind.VARUNA, 6, 40, 1, True, costs).step_seconds, timeline.step_seconds)


def test_a_slow_link_shows_as_exposed_communication():
    rng = random.Random(3)
    costs = random_costs(4, rng, 0.0)
    slow = StageCosts(**{**costs.__dict__, "send_forward_seconds": [5.0, 5.0, 5.0]})
    assert varuna.summary(4, 12, slow).communication_seconds > varuna.summary(4, 12, costs).communication_seconds
    assert varuna.step_seconds(4, 12, slow) > varuna.step_seconds(4, 12, costs)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.integers(40, 400), st.sampled_from([1.0, 0.05, 0.0]), st.randoms(use_true_random=False))
def test_skipping_repeated_cycles_keeps_the_simulated_figures(p, m, spread, rng):
    costs = random_costs(p, rng, spread)
    timeline = simulate(generate(ScheduleKind.VARUNA, p, m), costs)
    fast = varuna.summary(p, m, costs)
    assert same(fast.step_seconds, timeline.step_seconds)
    # Exposed communication is a difference of event times of order the step: near zero it is
    # rounding (6.0e-11 against 6.1e-11 s in a 891 s step), so it is compared on the step's scale.
    noise = 1e-12 * timeline.step_seconds
    assert math.isclose(fast.communication_seconds, timeline.communication_seconds, rel_tol=1e-9, abs_tol=noise)
    for mine, theirs in zip(fast.communication_seconds_per_rank, timeline.communication_seconds_per_rank, strict=True):
        assert math.isclose(mine, theirs, rel_tol=1e-9, abs_tol=max(1e-9, noise))


def test_long_steps_skip_cycles():
    p, m = 6, 600
    flags = varuna_flags.forward_flags(p, m)
    starts, q = varuna_flags.cycle(p)
    run = varuna._Run(p, m, flags, random_costs(p, random.Random(5), 1.0))
    walked = []
    advance = run.advance
    run.advance = lambda stop: walked.append(stop) or advance(stop)
    varuna._run_with_cycle_jump(run, flags, starts, q)
    # A handful of cycles walked, then the rest of the periodic part skipped in one go.
    assert len(walked) < m // (4 * q)
    assert min(run.forwards_done) > m - 8 * q * p
