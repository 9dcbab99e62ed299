from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.errors import ScheduleError
from pipectl.schedule import generate
from pipectl.schedule.comm import add_communication
from pipectl.schedule.ir import Action, ActionKind, Schedule, ScheduleKind
from pipectl.schedule.validate import validate

P2P = {ActionKind.SEND_FORWARD, ActionKind.RECV_FORWARD, ActionKind.SEND_BACKWARD, ActionKind.RECV_BACKWARD}


def naive_communication(schedule):
    """Sends right after their compute, receives right before theirs: deadlocks for 1F1B."""
    last = schedule.virtual_stages - 1
    actions = {}
    for rank, acts in schedule.actions.items():
        out = []
        for a in acts:
            s, i = a.stage, a.microbatch
            if a.kind is ActionKind.FORWARD and s > 0:
                out.append(Action(s, ActionKind.RECV_FORWARD, i))
            if a.kind is ActionKind.BACKWARD and s < last:
                out.append(Action(s, ActionKind.RECV_BACKWARD, i))
            out.append(a)
            if a.kind is ActionKind.FORWARD and s < last:
                out.append(Action(s, ActionKind.SEND_FORWARD, i))
            if a.kind is ActionKind.BACKWARD and s > 0:
                out.append(Action(s, ActionKind.SEND_BACKWARD, i))
        actions[rank] = tuple(out)
    return Schedule(schedule.kind, schedule.pipeline_parallel, schedule.micro_batches, schedule.chunks, actions)


def test_naive_placement_deadlocks_but_the_pass_does_not():
    schedule = generate(ScheduleKind.ONE_F_ONE_B, 2, 4)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(naive_communication(schedule))
    validate(add_communication(schedule))


@st.composite
def generated(draw):
    kind = draw(st.sampled_from(list(ScheduleKind)))
    p = draw(st.integers(1, 8))
    v = draw(st.integers(1, 4)) if kind is ScheduleKind.INTERLEAVED else 1
    m = draw(st.integers(1, 4)) * p if v > 1 else draw(st.integers(1, 16))
    if kind is ScheduleKind.ZBV:  # two chunks placed as a V, m >= 2p - 1
        v, m = 2, 2 * p - 1 + draw(st.integers(0, 8))
    return generate(kind, p, m, v, draw(st.booleans()))


@settings(max_examples=120, deadline=None)
@given(generated())
def test_communication_never_deadlocks_and_keeps_the_compute_order(schedule):
    with_comm = add_communication(schedule)
    validate(with_comm)  # replays blocking send/recv semantics
    p, m, stages = schedule.pipeline_parallel, schedule.micro_batches, schedule.virtual_stages
    for rank in range(p):
        assert with_comm.compute_order(rank) == schedule.compute_order(rank)
        assert with_comm.actions[rank][-2:] == schedule.actions[rank][-2:]
    counts = Counter(a.kind for acts in with_comm.actions.values() for a in acts if a.kind in P2P)
    crossings = sum(1 for s in range(stages - 1) if schedule.rank_of(s) != schedule.rank_of(s + 1)) * m
    assert counts == (Counter({k: crossings for k in P2P}) if crossings else Counter())


@pytest.mark.parametrize("kind", list(ScheduleKind))
def test_sends_come_right_after_their_compute_and_receives_right_before_theirs(kind):
    """Only other sends/receives may sit between a transfer and its compute (to break ties)."""
    v = 2 if kind in (ScheduleKind.INTERLEAVED, ScheduleKind.ZBV) else 1
    with_comm = add_communication(generate(kind, 4, 8, v))
    for acts in with_comm.actions.values():
        for k, a in enumerate(acts):
            if a.kind in (ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD):
                j = k - 1
                while acts[j].kind in P2P:
                    j -= 1
                backward = ActionKind.BACKWARD_INPUT if kind.splits_backward else ActionKind.BACKWARD
                compute = ActionKind.FORWARD if a.kind is ActionKind.SEND_FORWARD else backward
                assert (acts[j].kind, acts[j].stage, acts[j].microbatch) == (compute, a.stage, a.microbatch)


def test_existing_communication_is_replaced_not_duplicated():
    once = add_communication(generate(ScheduleKind.GPIPE, 3, 4))
    assert add_communication(once) == once


def test_single_rank_needs_no_communication():
    schedule = generate(ScheduleKind.ONE_F_ONE_B, 1, 4)
    assert add_communication(schedule).actions == schedule.actions


def test_a_malformed_compute_order_is_rejected():
    bad = Schedule(
        ScheduleKind.ONE_F_ONE_B, 2, 2, 1,
        {0: tuple(map(Action.parse, "0F0 0B0 0F1 0B1 0AR 0STEP".split())),
         1: tuple(map(Action.parse, "1F0 1F1 1B0 1B1 1AR 1STEP".split()))},
    )
    with pytest.raises(ScheduleError, match="deadlock"):
        add_communication(bad)
