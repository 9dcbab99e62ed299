"""ZB-H1 as a schedule kind of its own: generated with that kind, valid, the split backward (I then
W) once per micro-batch and stage, and refused by DeepSpeed's engine but run by torch's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.errors import ScheduleError
from pipectl.schedule import (
    Schedule,
    ScheduleKind,
    deepspeed_runnable,
    generate,
    torch_runnable,
    zb_h1,
)
from pipectl.schedule.comm import add_communication
from pipectl.schedule.ir import Action, ActionKind
from pipectl.schedule.validate import validate

F, I, W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def test_the_kind_parses_from_its_name_and_generate_dispatches_it():
    assert ScheduleKind("zb-h1") is ScheduleKind.ZB_H1
    schedule = generate(ScheduleKind.ZB_H1, 4, 8)
    assert schedule.kind is ScheduleKind.ZB_H1 and schedule == zb_h1(4, 8)
    assert schedule.to_text().startswith("# zb-h1 p=4 m=8 v=1")
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert ScheduleKind.ZB_H1.splits_backward and not ScheduleKind.ONE_F_ONE_B.splits_backward


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 8), st.integers(1, 20))
def test_each_micro_batch_runs_f_i_w_once_per_stage_in_that_order(p, m):
    schedule = generate(ScheduleKind.ZB_H1, p, m)
    validate(schedule)
    validate(add_communication(schedule))  # blocking sends and receives do not deadlock
    for rank in range(p):
        order = schedule.compute_order(rank)
        assert all(a.kind in (F, I, W) and a.stage == rank for a in order)
        for i in range(m):
            positions = [order.index(Action(rank, kind, i)) for kind in (F, I, W)]
            assert positions == sorted(positions)
        assert len(order) == 3 * m


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 2)])
def test_it_keeps_1f1bs_order_with_i_in_bs_place(p, m):
    one_f_one_b = generate(ScheduleKind.ONE_F_ONE_B, p, m)
    zb = generate(ScheduleKind.ZB_H1, p, m)
    for rank in range(p):
        without_w = [a for a in zb.compute_order(rank) if a.kind is not W]
        as_1f1b = [Action(a.stage, ActionKind.BACKWARD if a.kind is I else a.kind, a.microbatch) for a in without_w]
        assert as_1f1b == one_f_one_b.compute_order(rank)


def test_a_w_before_its_i_is_caught():
    schedule = generate(ScheduleKind.ZB_H1, 2, 2)
    actions = list(schedule.actions[0])
    i, w = actions.index(Action(0, I, 0)), actions.index(Action(0, W, 0))
    actions[i], actions[w] = actions[w], actions[i]
    broken = Schedule(schedule.kind, 2, 2, 1, {**schedule.actions, 0: tuple(actions)})
    with pytest.raises(ScheduleError):
        validate(broken)


def test_deepspeed_cannot_run_it_torch_can():
    assert not deepspeed_runnable(ScheduleKind.ZB_H1)
    assert torch_runnable(ScheduleKind.ZB_H1)
    assert torch_runnable(ScheduleKind.INTERLEAVED) and torch_runnable(ScheduleKind.ONE_F_ONE_B)
    assert not torch_runnable(ScheduleKind.VARUNA) and not torch_runnable(ScheduleKind.PIPEDREAM_2BW)
    assert not torch_runnable(ScheduleKind.ONE_F_ONE_B, recompute=True)
