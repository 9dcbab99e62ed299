"""ZB-V (Qi et al., ICLR 2024, §4): two chunks per rank in the V placement, the split backward.

The placement is written once (`stage_rank`, read through `Schedule.rank_of`); the validator, the
communication pass and the simulator all see it: the turn of the V (stages p − 1 and p, both on
rank p − 1) has no send. Timing: with T_F = T_B = T_W per rank (each chunk's F, I and W half of
that) and free communication, one flushed step takes m(T_F + T_B + T_W) + (p − 1) T_F / 2: the
paper's zero bubble in the steady state, plus the wait of the last rank for micro-batch 0 to come
through p − 1 chunk forwards, which no schedule on this placement avoids (a lower bound)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.errors import ScheduleError
from pipectl.plan.memory import in_flight_units, peak_in_flight_units
from pipectl.plan.simulate import simulate, simulate_rendezvous
from pipectl.plan.stage_costs import uniform_costs
from pipectl.schedule import Schedule, ScheduleKind, deepspeed_runnable, generate, stage_rank, torch_runnable, zbv
from pipectl.schedule.comm import add_communication
from pipectl.schedule.ir import Action, ActionKind
from pipectl.schedule.validate import validate

F, I, W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
SF, RF, SB, RB = (ActionKind.SEND_FORWARD, ActionKind.RECV_FORWARD, ActionKind.SEND_BACKWARD,
                  ActionKind.RECV_BACKWARD)  # fmt: skip


def _uniform(p: int, chunks: int, forward: float = 1.0, backward: float = 2.0, fraction: float = 0.5, send: float = 0.0):
    """Per-rank forward and backward times; I = fraction x B, W the rest."""
    costs = uniform_costs(p, chunks, forward, backward, send=send)
    return dataclasses.replace(costs, backward_input_fraction=fraction)


def test_v_placement_puts_stage_s_on_rank_s_then_back():
    assert [stage_rank(s, 4, v_placement=True) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_rank(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    schedule = generate(ScheduleKind.ZBV, 4, 8, 2)
    assert [schedule.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert generate(ScheduleKind.INTERLEAVED, 4, 8, 2).rank_of(4) == 0  # the loop placement stays


def test_the_kind_parses_from_its_name_and_generate_dispatches_it():
    assert ScheduleKind("zbv") is ScheduleKind.ZBV and ScheduleKind.ZBV.splits_backward
    schedule = generate(ScheduleKind.ZBV, 3, 6, 2)
    assert schedule == zbv(3, 6) and schedule.chunks == 2
    assert schedule.to_text().startswith("# zbv p=3 m=6 v=2")
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert not deepspeed_runnable(ScheduleKind.ZBV, 2) and torch_runnable(ScheduleKind.ZBV)


@pytest.mark.parametrize("p, m", [(2, 2), (4, 6), (3, 1)])
def test_too_few_micro_batches_are_refused_naming_the_values(p, m):
    with pytest.raises(ScheduleError, match=rf"m >= 2p - 1 = {2 * p - 1} for p={p}, got m={m}"):
        generate(ScheduleKind.ZBV, p, m, 2)


@pytest.mark.parametrize("v", [1, 3])
def test_it_holds_exactly_two_chunks(v):
    with pytest.raises(ScheduleError, match=rf"exactly 2 chunks per rank \(a V\), got v={v}"):
        generate(ScheduleKind.ZBV, 2, 4, v)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(0, 12))
def test_every_rank_runs_f_i_w_once_per_chunk_and_micro_batch_in_that_order(p, extra):
    m = 2 * p - 1 + extra
    schedule = generate(ScheduleKind.ZBV, p, m, 2)
    validate(schedule)
    validate(add_communication(schedule))  # blocking sends and receives do not deadlock
    for rank in range(p):
        order = schedule.compute_order(rank)
        assert {a.stage for a in order} == {rank, 2 * p - 1 - rank}
        assert len(order) == 2 * 3 * m
        for stage in (rank, 2 * p - 1 - rank):
            for i in range(m):
                positions = [order.index(Action(stage, kind, i)) for kind in (F, I, W)]
                assert positions == sorted(positions)


def test_the_turn_of_the_v_sends_nothing_and_the_validator_reads_the_placement():
    p, m = 3, 5
    with_comm = add_communication(generate(ScheduleKind.ZBV, p, m, 2))
    p2p = [a for actions in with_comm.actions.values() for a in actions if a.kind.is_p2p]
    # No transfer across the turn: stage 2 -> 3 (both on rank 2), in either direction.
    assert not [a for a in p2p if (a.kind is SF and a.stage == p - 1) or (a.kind is RF and a.stage == p)]
    assert not [a for a in p2p if (a.kind is SB and a.stage == p) or (a.kind is RB and a.stage == p - 1)]
    # Every other boundary carries each micro-batch both ways: 4 p2p actions x (2p - 2) boundaries.
    assert len(p2p) == 4 * m * (2 * p - 2)
    # The chunk-1 stage 2p - 2 = 4 sends its input gradient to stage 3 on rank 2, not rank 1.
    assert Action(3, RB, 0) in with_comm.actions[2] and Action(4, SB, 0) in with_comm.actions[1]
    # A loop-placed copy of the same actions puts stage 5 on rank 2, not 0: the validator refuses it.
    looped = Schedule(ScheduleKind.INTERLEAVED, p, m, 2, dict(generate(ScheduleKind.ZBV, p, m, 2).actions))
    with pytest.raises(ScheduleError, match="5F0 names virtual stage 5, which lives on rank 2"):
        validate(looped)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
def test_uniform_step_is_the_closed_form_and_meets_the_lower_bound(p):
    # T_F = T_B = T_W = 1 per rank: forward 1, backward 2 split evenly; chunks take half of each.
    for m in sorted({2 * p - 1, 2 * p, 3 * p, 4 * p + 1}):
        step = simulate(generate(ScheduleKind.ZBV, p, m, 2), _uniform(p, 2)).step_seconds
        assert step == pytest.approx(m * (1 + 1 + 1) + (p - 1) * 1 / 2)
        # ZB-H1 at the same work: m (T_F + T_B + T_W) + (p - 1)(T_F + T_B - T_W) (the paper's Table 3).
        zb_h1 = simulate(generate(ScheduleKind.ZB_H1, p, m), _uniform(p, 1)).step_seconds
        assert zb_h1 == pytest.approx(3 * m + (p - 1) * 1)
        assert step <= zb_h1


@pytest.mark.parametrize("forward, backward, fraction, send", [
    (1.0, 2.0, 0.6, 0.0), (1.0, 3.0, 0.4, 0.0), (2.0, 2.0, 0.5, 0.0), (1.0, 2.0, 0.5, 0.1), (1.0, 2.0, 0.5, 0.5),
])  # fmt: skip
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_never_slower_than_zb_h1_at_the_same_work(p, forward, backward, fraction, send):
    for m in sorted({2 * p - 1, 2 * p, 3 * p, 4 * p + 1}):
        v = simulate(generate(ScheduleKind.ZBV, p, m, 2), _uniform(p, 2, forward, backward, fraction, send))
        h1 = simulate(generate(ScheduleKind.ZB_H1, p, m), _uniform(p, 1, forward, backward, fraction, send))
        assert v.step_seconds <= h1.step_seconds + 1e-9


def test_blocking_transfers_time_it_too():
    p, m = 3, 6
    timeline = simulate_rendezvous(generate(ScheduleKind.ZBV, p, m, 2), _uniform(p, 2))
    assert timeline.step_seconds >= m * 3 + (p - 1) / 2 - 1e-9


@pytest.mark.parametrize("p, m", [(1, 1), (2, 3), (2, 8), (3, 5), (4, 7), (4, 16)])
def test_in_flight_is_1f1bs_peak_in_full_stages(p, m):
    # 2p chunk-micro-batches of half a rank's layers each: p full-stage activations, 1F1B's stage 0.
    schedule = generate(ScheduleKind.ZBV, p, m, 2)
    assert in_flight_units(ScheduleKind.ZBV, p, m, 2) == peak_in_flight_units(schedule) == (2 * p,) * p
    assert max(in_flight_units(ScheduleKind.ONE_F_ONE_B, p, m)) == p  # in full stages
    assert simulate(schedule, _uniform(p, 2)).peak_in_flight == (2 * p,) * p
