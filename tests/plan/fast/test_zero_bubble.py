"""`pipectl.plan.fast.zero_bubble` equals the event-driven simulation of the generated zb-h1
schedule (exactly: the same operations in the same order per action), on random costs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.plan.fast import zero_bubble
from pipectl.plan.stage_costs import StageCosts, uniform_costs
from pipectl.plan.simulate import simulate, simulate_step_seconds
from pipectl.plan.timing import summary_of
from pipectl.schedule import ScheduleKind, generate
from pipectl.schedule.ir import ActionKind

KINDS = {0: ActionKind.FORWARD, 1: ActionKind.BACKWARD_INPUT, 2: ActionKind.BACKWARD_WEIGHT}


@pytest.mark.parametrize("p, m", [(1, 1), (2, 3), (4, 2), (4, 8), (8, 5), (6, 20)])
def test_rank_orders_are_the_generators(p, m):
    schedule = generate(ScheduleKind.ZB_H1, p, m)
    for rank, order in enumerate(zero_bubble.rank_orders(p, m)):
        assert [(KINDS[kind], i) for kind, i in order] == [(a.kind, a.microbatch) for a in schedule.compute_order(rank)]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), st.integers(1, 30), st.randoms(use_true_random=False), st.booleans())
def test_equals_the_simulation_on_random_costs(p, m, rng, free_links):
    costs = StageCosts(
        forward_seconds=[rng.uniform(0.1, 2.0) for _ in range(p)],
        backward_seconds=[rng.uniform(0.2, 4.0) for _ in range(p)],
        recompute_seconds=[0.0] * p,
        send_forward_seconds=[0.0 if free_links else rng.uniform(0.0, 0.5) for _ in range(p - 1)],
        send_backward_seconds=[0.0 if free_links else rng.uniform(0.0, 0.5) for _ in range(p - 1)],
        allreduce_seconds=[rng.uniform(0.0, 2.0) for _ in range(p)],
        optimizer_seconds=[rng.uniform(0.0, 1.0) for _ in range(p)],
        backward_input_fraction=rng.uniform(0.0, 1.0),
    )
    schedule = generate(ScheduleKind.ZB_H1, p, m)
    assert zero_bubble.step_seconds(p, m, costs) == simulate_step_seconds(schedule, costs)
    assert zero_bubble.summary(p, m, costs) == simulate(schedule, costs).summary()
    assert summary_of(ScheduleKind.ZB_H1, p, m, 1, False, costs) == simulate(schedule, costs).summary()


def test_the_closed_form():
    assert zero_bubble.step_seconds(4, 8, uniform_costs(4, 1, 1.0, 2.0)) == 27.0
