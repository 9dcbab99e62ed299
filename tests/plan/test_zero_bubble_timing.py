"""The simulator times ZB-H1's split backward (I, W) and the planner's memory model counts what
it holds.

Hand-computed instance (f = 1, b = 2 split as I = W = 1, no communication), p = 2, m = 4:

    rank 0: F0 0-1  F1 1-2  I0 3-4  W0 4-5  F2 5-6  I1 6-7  W1 7-8  F3 8-9  I2 9-10 W2 10-11 I3 11-12 W3 12-13
    rank 1: F0 1-2  I0 2-3  F1 3-4  I1 4-5  W0 5-6  F2 6-7  I2 7-8  W1 8-9  F3 9-10 I3 10-11 W2 11-12 W3 12-13

13 against 1F1B's (m + p − 1)(f + b) = 15. In general (m ≥ p, W ≤ f and W ≤ I) the step is
m (f + b) + (p − 1)(f + I − W): the zero-bubble paper's ZB-H1 bubble (p − 1)(T_F + T_B − T_W)
(Qi et al., ICLR 2024, Table 1; their T_B is our I) against 1F1B's (p − 1)(T_F + T_B + T_W).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.errors import UserInputError
from pipectl.plan.fast.bounds import zero_bubble_bound_seconds
from pipectl.plan.memory import in_flight_units, peak_in_flight_units
from pipectl.plan.stage_costs import BACKWARD_INPUT_FRACTION, StageCosts, uniform_costs
from pipectl.plan.simulate import simulate, simulate_step_seconds
from pipectl.plan.timing import actions_per_step, step_seconds_of, summary_of
from pipectl.schedule import ScheduleKind, generate

ZB, ONE_F_ONE_B = ScheduleKind.ZB_H1, ScheduleKind.ONE_F_ONE_B


def test_the_hand_computed_instance():
    timeline = simulate(generate(ZB, 2, 4), uniform_costs(2, 1, 1.0, 2.0))
    assert timeline.step_seconds == 13.0
    assert simulate_step_seconds(generate(ONE_F_ONE_B, 2, 4), uniform_costs(2, 1, 1.0, 2.0)) == 15.0
    rank1 = [(str(r.action), r.start, r.end) for r in timeline.rank_records(1)][:6]
    assert rank1 == [("1F0", 1, 2), ("1I0", 2, 3), ("1F1", 3, 4), ("1I1", 4, 5), ("1W0", 5, 6), ("1F2", 6, 7)]
    assert [(str(r.action), r.start, r.end) for r in timeline.rank_records(0)][2:4] == [("0I0", 3, 4), ("0W0", 4, 5)]


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m_over_p", [1, 2, 3])
def test_the_papers_bubble_for_zb_h1_and_1f1b(p, m_over_p):
    m, f, b = p * m_over_p, 1.0, 2.0
    input_seconds = weight_seconds = b / 2
    costs = uniform_costs(p, 1, f, b)
    zb = simulate(generate(ZB, p, m), costs)
    one_f_one_b = simulate(generate(ONE_F_ONE_B, p, m), costs)
    assert zb.step_seconds == m * (f + b) + (p - 1) * (f + input_seconds - weight_seconds)
    assert one_f_one_b.step_seconds == m * (f + b) + (p - 1) * (f + b)
    assert zb.step_seconds < one_f_one_b.step_seconds
    assert max(zb.bubble_fraction) < min(one_f_one_b.bubble_fraction)


def test_w_sends_nothing_only_i_waits_for_the_next_stage():
    # a slow gradient link delays I on the stage before, W never waits for it
    costs = uniform_costs(2, 1, 1.0, 2.0, send=0.5)
    timeline = simulate(generate(ZB, 2, 2), costs)
    ends = {str(r.action): r for r in timeline.records}
    assert ends["0I0"].start == ends["1I0"].end + 0.5
    assert ends["0W0"].start == ends["0I0"].end  # right after its own I, nothing else
    assert ends["1W0"].start == ends["1I1"].end


def test_the_split_is_a_named_overridable_fraction():
    assert BACKWARD_INPUT_FRACTION == 0.5
    costs = uniform_costs(2, 1, 1.0, 2.0)
    schedule = generate(ZB, 2, 1)  # F0 F0' I0' I0 W0 on the critical path: 1 + 1 + I + I + W
    assert simulate_step_seconds(schedule, costs) == 1 + 1 + 1 + 1 + 1
    skewed = replace(costs, backward_input_fraction=0.75)  # I = 1.5, W = 0.5
    assert simulate_step_seconds(schedule, skewed) == 1 + 1 + 1.5 + 1.5 + 0.5
    with pytest.raises(UserInputError, match="backward_input_fraction"):
        simulate(schedule, replace(costs, backward_input_fraction=1.5))


def test_rendezvous_times_i_and_w_too():
    costs = replace(uniform_costs(4, 1, 1.0, 2.0), blocking_p2p=True)
    assert simulate(generate(ZB, 4, 8), costs).step_seconds == 27.0  # free transfers: as asynchronous


def test_timing_gives_the_simulated_step_and_counts_the_actions():
    costs = uniform_costs(4, 1, 1.0, 2.0)
    assert step_seconds_of(ZB, 4, 8, 1, False, costs) == 27.0
    assert summary_of(ZB, 4, 8, 1, False, costs).step_seconds == 27.0
    schedule = generate(ZB, 3, 5)
    assert actions_per_step(ZB, 3, 5, 1, False) == sum(map(len, schedule.actions.values()))


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("m", range(1, 13))
def test_in_flight_units_are_the_generated_schedules_peak(p, m):
    schedule = generate(ZB, p, m)
    assert in_flight_units(ZB, p, m) == peak_in_flight_units(schedule) == simulate(
        schedule, uniform_costs(p, 1, 1.0, 2.0)).peak_in_flight
    # the paper's claim: ZB-H1 peaks where 1F1B peaks (stage 0), p micro-batches once m >= p
    assert max(in_flight_units(ZB, p, m)) == max(in_flight_units(ONE_F_ONE_B, p, m)) == min(p, m)


def random_costs(p, rng):
    return StageCosts(
        forward_seconds=[rng.uniform(0.5, 2.0) for _ in range(p)],
        backward_seconds=[rng.uniform(1.0, 4.0) for _ in range(p)],
        recompute_seconds=[0.0] * p,
        send_forward_seconds=[rng.uniform(0.0, 0.5) for _ in range(p - 1)],
        send_backward_seconds=[rng.uniform(0.0, 0.5) for _ in range(p - 1)],
        allreduce_seconds=[rng.uniform(0.0, 3.0) for _ in range(p)],
        optimizer_seconds=[rng.uniform(0.0, 1.0) for _ in range(p)],
        backward_input_fraction=rng.uniform(0.2, 0.8),
    )


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 24), st.randoms(use_true_random=False))
def test_the_pruning_bound_never_exceeds_the_simulated_step(p, m, rng):
    import numpy as np

    costs = random_costs(p, rng)
    forward = np.asarray(costs.forward_seconds)
    forward_chain = np.concatenate(([0.0], np.cumsum(forward[:-1] + np.asarray(costs.send_forward_seconds))))
    work = forward + np.asarray(costs.backward_seconds)
    bound = float(zero_bubble_bound_seconds(forward_chain, work, m, np.asarray(costs.allreduce_seconds),
                                            np.asarray(costs.optimizer_seconds)))
    step = simulate_step_seconds(generate(ZB, p, m), costs)
    assert bound <= step
    assert math.isfinite(bound) and bound > 0


@pytest.mark.parametrize("p, m", [(2, 6), (3, 8), (4, 8), (6, 12)])
@pytest.mark.parametrize("f, b, fraction", [(1.0, 2.0, 0.5), (2.0, 2.0, 0.5), (1.0, 2.0, 0.7), (2.0, 4.0, 0.7),
                                            (0.5, 1.0, 0.5), (1.0, 3.0, 0.5), (1.0, 2.0, 0.3), (0.5, 2.0, 0.7)])
def test_the_formula_holds_while_w_fits_its_gap_and_zb_h1_always_beats_1f1b(p, m, f, b, fraction):
    costs = replace(uniform_costs(p, 1, f, b), backward_input_fraction=fraction)
    input_seconds = b * fraction
    weight_seconds = b - input_seconds
    zb = simulate_step_seconds(generate(ZB, p, m), costs)
    formula = m * (f + b) + (p - 1) * (f + input_seconds - weight_seconds)
    if weight_seconds <= min(f, input_seconds) + 1e-12:
        assert zb == pytest.approx(formula, rel=1e-12)
    else:  # a W longer than the gap it fills delays what follows it
        assert zb > formula
    assert zb < simulate_step_seconds(generate(ONE_F_ONE_B, p, m), costs)
