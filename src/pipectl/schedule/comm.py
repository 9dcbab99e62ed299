"""The communication pass: add the sends and receives a schedule needs, in a deadlock-free order.

Every micro-batch crosses every boundary between stages on different ranks twice: its activation
forward (SF(s, i) on the producer after F(s, i), RF(s+1, i) on the consumer before F(s+1, i)) and
its gradient backward (SB(s+1, i) after B(s+1, i), RB(s, i) before B(s, i)).

Where to put them so that blocking send/receive (gloo: a send returns only once the matching
receive runs; messages between two ranks pair up in order) never deadlocks? Naively placing each
send right after its compute deadlocks 1F1B already: with p=2, rank 0 sends F1's activation while
rank 1 sends B0's gradient, and both wait. DeepSpeed avoids it with per-stage parity arithmetic;
we use an argument that holds for any schedule instead:

    If there is one global order of all events (computes, and each send/receive pair as one
    rendezvous) and every rank performs its events in that order, nothing can deadlock: the
    earliest unperformed event always has all its participants ready.

The global order comes from timing the schedule once with uniform costs (F = R = 1, B = 2, free
transfers): a compute is placed at its start time, a transfer at its producer's end time, and at
equal times transfers go first. Projected onto each rank this puts every send right after its
compute and every receive just before the compute that needs it (or earlier, when the data is
ready earlier). `add_communication` then runs the validator, which replays blocking semantics, so
it never returns a schedule that could deadlock.

    >>> from pipectl.schedule.generators import one_f_one_b
    >>> print(add_communication(one_f_one_b(2, 2)).to_text(), end="")
    # 1f1b p=2 m=2 v=1
    0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0AR 0STEP
    1: 1RF0 1F0 1RF1 1B0 1SB0 1F1 1B1 1SB1 1AR 1STEP
"""

from __future__ import annotations

from pipectl.schedule.dag import dependency, execution_order
from pipectl.schedule.ir import Action, ActionKind, Schedule
from pipectl.schedule.validate import validate

F, B, R = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECOMPUTE

# Uniform durations used only to pick a global order (any positive values give a valid order).
_ORDERING_SECONDS = {F: 1.0, B: 2.0, R: 1.0, ActionKind.BACKWARD_INPUT: 1.0, ActionKind.BACKWARD_WEIGHT: 1.0}


def add_communication(schedule: Schedule) -> Schedule:
    """Return `schedule` with SF/RF/SB/RB inserted so that blocking p2p cannot deadlock.

    Existing sends and receives are dropped and placed afresh. Stages on the same rank (p = 1, or
    adjacent chunks on one rank) exchange nothing. Raises `ScheduleError` (with a step × rank grid)
    if the compute order itself is malformed or cannot run.
    """
    p = schedule.pipeline_parallel
    last_stage = schedule.virtual_stages - 1
    compute_only = Schedule(
        schedule.kind,
        p,
        schedule.micro_batches,
        schedule.chunks,
        {r: tuple(a for a in acts if not a.kind.is_p2p) for r, acts in schedule.actions.items()},
    )
    validate(compute_only)

    # Time every compute with uniform costs (a longest-path pass over the dependency DAG).
    rank_free = dict.fromkeys(compute_only.actions, 0.0)
    ends: dict[tuple[ActionKind, int, int], float] = {}
    # (time, 0 = transfer / 1 = compute, tie-break index, rank, action) events; sorted below.
    events: list[tuple[float, int, int, int, Action]] = []
    for index, (rank, action) in enumerate(execution_order(compute_only)):
        if not action.kind.is_compute:
            continue  # AR and STEP stay at the end of each rank
        needed = dependency(action, last_stage)
        start = max(rank_free[rank], ends[needed] if needed is not None else 0.0)
        end = start + _ORDERING_SECONDS[action.kind]
        rank_free[rank] = end
        ends[(action.kind, action.stage, action.microbatch)] = end  # type: ignore[index]
        events.append((start, 1, index, rank, action))
        for send, receive in _transfers_after(action, last_stage):
            receiver = compute_only.rank_of(receive.stage)
            if receiver != rank:
                events.append((end, 0, index, rank, send))
                events.append((end, 0, index, receiver, receive))
    events.sort(key=lambda e: e[:3])

    per_rank: dict[int, list[Action]] = {r: [] for r in compute_only.actions}
    for _, _, _, rank, action in events:
        per_rank[rank].append(action)
    actions = {
        r: tuple(per_rank[r]) + tuple(a for a in compute_only.actions[r] if not a.kind.has_microbatch)
        for r in compute_only.actions
    }
    result = Schedule(schedule.kind, p, schedule.micro_batches, schedule.chunks, actions)
    validate(result)
    return result


def _transfers_after(action: Action, last_stage: int) -> list[tuple[Action, Action]]:
    """The (send, receive) pair that follows a compute, if its output crosses a boundary."""
    s, i = action.stage, action.microbatch
    if action.kind is F and s < last_stage:
        return [(Action(s, ActionKind.SEND_FORWARD, i), Action(s + 1, ActionKind.RECV_FORWARD, i))]
    if action.kind.computes_input_gradient and s > 0:  # B, or I of a split backward
        return [(Action(s, ActionKind.SEND_BACKWARD, i), Action(s - 1, ActionKind.RECV_BACKWARD, i))]
    return []
