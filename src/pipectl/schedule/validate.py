"""Prove a schedule well formed, or say exactly where it is not (as a step × rank grid).

`validate(schedule)` checks, in this order:

1. shape: ranks 0..p−1; every action's virtual stage lives on its rank (`Schedule.rank_of`) and is < p·v;
   micro-batches < m; every rank ends with exactly one AR then one STEP;
2. completeness: every micro-batch is forwarded and backwarded exactly once per virtual stage;
   a recompute R(i) at most once, after its F(i) and before its B(i); a split backward is I(i)
   then W(i) in place of B(i);
3. communication (when the schedule has any send/receive): every boundary crossing has exactly
   one send and one receive — SF(s, i) after F(s, i) paired with RF(s+1, i) before F(s+1, i), and
   SB(s, i) after B(s, i) paired with RB(s−1, i) before B(s−1, i) (I in place of B where the
   backward is split into I and W) — and none between stages on the same rank;
4. execution under blocking point-to-point semantics (gloo: a send completes only when the
   matching receive runs, and messages between two ranks pair up in order): F(s, i) only after
   F(s−1, i), B(s, i) only after B(s+1, i); a send and its receive must be at the head of both ranks
   together. A head-of-line send/receive pair that names different micro-batches is an order
   mismatch (gloo would hand one tensor to the other); no rank able to move is a deadlock.

Every failure is a `ScheduleError` whose message ends with the grid, offending steps marked.

    >>> from pipectl.schedule.generators import one_f_one_b
    >>> validate(one_f_one_b(4, 8))
    >>> from pipectl.schedule.ir import Action, Schedule, ScheduleKind
    >>> swapped = {0: tuple(map(Action.parse, "0F0 0B0 0AR 0STEP".split())),
    ...            1: tuple(map(Action.parse, "1B0 1F0 1AR 1STEP".split()))}
    >>> validate(Schedule(ScheduleKind.ONE_F_ONE_B, 2, 1, 1, swapped))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pipectl.errors.ScheduleError: rank 1 runs 1B0 before 1F0...
"""

from __future__ import annotations

from pipectl.errors import ScheduleError
from pipectl.schedule.dag import dependency
from pipectl.schedule.grid import format_grid
from pipectl.schedule.ir import Action, ActionKind, Schedule

F, B, R = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECOMPUTE
I, W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
SF, RF, SB, RB = (
    ActionKind.SEND_FORWARD,
    ActionKind.RECV_FORWARD,
    ActionKind.SEND_BACKWARD,
    ActionKind.RECV_BACKWARD,
)
Key = tuple[ActionKind, int, int]


def _fail(schedule: Schedule, message: str, marks: dict[int, int]) -> ScheduleError:
    return ScheduleError(f"{message}\n{format_grid(schedule, marks)}")


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` (with a step × rank grid) unless the schedule is well formed."""
    positions = _check_shape(schedule)
    _check_completeness(schedule, positions)
    if any(a.kind.is_p2p for actions in schedule.actions.values() for a in actions):
        _check_communication(schedule, positions)
    _check_execution(schedule)


def _check_shape(schedule: Schedule) -> dict[Key, tuple[int, int]]:
    """Per-action checks; returns (kind, stage, micro-batch) -> (rank, step) for every action."""
    p, m, stages = schedule.pipeline_parallel, schedule.micro_batches, schedule.virtual_stages
    if sorted(schedule.actions) != list(range(p)):
        raise ScheduleError(
            f"schedule must list ranks 0..{p - 1} (p={p}), got ranks {sorted(schedule.actions)}"
        )
    positions: dict[Key, tuple[int, int]] = {}
    for rank in range(p):
        actions = schedule.actions[rank]
        for step, action in enumerate(actions):
            if action.stage >= stages or schedule.rank_of(action.stage) != rank:
                raise _fail(
                    schedule,
                    f"rank {rank} step {step}: {action} names virtual stage {action.stage}, which "
                    f"{'does not exist' if action.stage >= stages else f'lives on rank {schedule.rank_of(action.stage)}'}"
                    f" (p={p}, v={schedule.chunks})",
                    {rank: step},
                )
            if action.microbatch is not None:
                if action.microbatch >= m:
                    raise _fail(
                        schedule, f"rank {rank} step {step}: {action} names micro-batch "
                        f"{action.microbatch}, but m={m}", {rank: step}
                    )
                key = (action.kind, action.stage, action.microbatch)
                if key in positions:
                    first_rank, first_step = positions[key]
                    raise _fail(
                        schedule, f"{action} appears twice (rank {rank} steps {first_step} and {step})",
                        {rank: step},
                    )
                positions[key] = (rank, step)
        tail = [a.kind for a in actions if not a.kind.has_microbatch]
        if tail != [ActionKind.ALL_REDUCE, ActionKind.OPTIMIZER_STEP] or [a.kind for a in actions[-2:]] != tail:
            raise _fail(
                schedule,
                f"rank {rank} must end with exactly one AR then one STEP, found "
                f"{' '.join(str(a) for a in actions if not a.kind.has_microbatch) or 'neither'}",
                {rank: max(len(actions) - 1, 0)},
            )
    return positions


def _check_completeness(schedule: Schedule, positions: dict[Key, tuple[int, int]]) -> None:
    m = schedule.micro_batches
    for s in range(schedule.virtual_stages):
        for i in range(m):
            f = positions.get((F, s, i))
            b = positions.get((B, s, i))
            r = positions.get((R, s, i))
            split_i, split_w = positions.get((I, s, i)), positions.get((W, s, i))
            if split_i is not None or split_w is not None:  # the zero-bubble split backward
                if b is not None:
                    raise _fail(schedule, f"rank {schedule.rank_of(s)} runs both {s}B{i} and a split backward of it", {schedule.rank_of(s): b[1]})
                if split_i is None or split_w is None:
                    missing = Action(s, I if split_i is None else W, i)
                    raise _fail(schedule, f"rank {schedule.rank_of(s)} never runs {missing} (the other half of its split backward)", {})
                if split_w[1] < split_i[1]:
                    raise _fail(schedule, f"rank {schedule.rank_of(s)} runs {s}W{i} before {s}I{i}", {schedule.rank_of(s): split_w[1]})
                b = split_i  # I plays B's part below: after F (and after R)
            if f is None or b is None:
                missing = Action(s, F if f is None else B, i)
                raise _fail(schedule, f"rank {schedule.rank_of(s)} never runs {missing}", {})
            if b[1] < f[1]:
                raise _fail(schedule, f"rank {schedule.rank_of(s)} runs {s}B{i} before {s}F{i}", {schedule.rank_of(s): b[1]})
            if r is not None and not f[1] < r[1] < b[1]:
                raise _fail(
                    schedule, f"rank {schedule.rank_of(s)} must run {s}R{i} after {s}F{i} and before {s}B{i}",
                    {schedule.rank_of(s): r[1]},
                )


def _check_communication(schedule: Schedule, positions: dict[Key, tuple[int, int]]) -> None:
    """Exactly the sends and receives the boundaries need, each on the right side of its compute."""
    m, stages = schedule.micro_batches, schedule.virtual_stages
    # (p2p kind, stage) -> (compute it belongs to, must come after it?, peer stage offset)
    rules = {
        SF: (F, True, +1),
        RF: (F, False, -1),
        SB: (B, True, -1),
        RB: (B, False, +1),
    }
    for (kind, stage, i), (rank, step) in positions.items():
        if kind not in rules:
            continue
        compute, after, offset = rules[kind]
        if compute is B and (B, stage, i) not in positions and (I, stage, i) in positions:
            compute = I  # a split backward: its input gradient comes from I
        peer = stage + offset
        action = Action(stage, kind, i)
        if not 0 <= peer < stages or schedule.rank_of(peer) == rank:
            raise _fail(
                schedule,
                f"{action} has no peer on another rank (stage {peer} "
                f"{'does not exist' if not 0 <= peer < stages else 'is on the same rank'})",
                {rank: step},
            )
        own = positions[(compute, stage, i)][1]
        if (step < own) if after else (step > own):
            raise _fail(
                schedule,
                f"{action} must come {'after' if after else 'before'} {Action(stage, compute, i)} on rank {rank}",
                {rank: step},
            )
    for s in range(stages - 1):
        if schedule.rank_of(s) == schedule.rank_of(s + 1):
            continue
        for i in range(m):
            for needed in (Action(s, SF, i), Action(s + 1, RF, i), Action(s + 1, SB, i), Action(s, RB, i)):
                if (needed.kind, needed.stage, needed.microbatch) not in positions:
                    raise _fail(
                        schedule,
                        f"rank {schedule.rank_of(needed.stage)} lacks {needed}: stages {s} and {s + 1} are on "
                        f"different ranks, so micro-batch {i} must cross that boundary both ways",
                        {},
                    )


def _peer(action: Action) -> tuple[int, Action]:
    """The stage and the matching action of a send or receive's counterpart."""
    s, i = action.stage, action.microbatch
    if action.kind is SF:
        return s + 1, Action(s + 1, RF, i)
    if action.kind is RF:
        return s - 1, Action(s - 1, SF, i)
    if action.kind is SB:
        return s - 1, Action(s - 1, RB, i)
    return s + 1, Action(s + 1, SB, i)


def _check_execution(schedule: Schedule) -> None:
    """Run the schedule under blocking rendezvous semantics; report order mismatches and deadlocks."""
    p, last_stage = schedule.pipeline_parallel, schedule.virtual_stages - 1
    actions = schedule.actions
    heads = [0] * p
    done: set[Key] = set()
    unfinished = sum(len(actions[r]) for r in range(p))
    while unfinished:
        progressed = False
        for rank in range(p):
            while heads[rank] < len(actions[rank]):
                action = actions[rank][heads[rank]]
                if action.kind.is_p2p:
                    peer_stage, counterpart = _peer(action)
                    peer_rank = schedule.rank_of(peer_stage)
                    if heads[peer_rank] >= len(actions[peer_rank]):
                        break
                    peer_head = actions[peer_rank][heads[peer_rank]]
                    if peer_head == counterpart:
                        heads[peer_rank] += 1
                        unfinished -= 1
                    elif _pairs_with(peer_head, schedule, rank, action):
                        raise _fail(
                            schedule,
                            f"send/receive order mismatch between ranks {rank} and {peer_rank}: {action} "
                            f"meets {peer_head} (messages between two ranks must be received in the "
                            "order they are sent)",
                            {rank: heads[rank], peer_rank: heads[peer_rank]},
                        )
                    else:
                        break
                else:
                    needed = dependency(action, last_stage)
                    if needed is not None and needed not in done:
                        break
                    if action.microbatch is not None:
                        done.add((action.kind, action.stage, action.microbatch))
                heads[rank] += 1
                unfinished -= 1
                progressed = True
        if not progressed:
            stuck = {r: heads[r] for r in range(p) if heads[r] < len(actions[r])}
            waits = ", ".join(f"rank {r} at {actions[r][heads[r]]}" for r in stuck)
            raise _fail(
                schedule,
                f"schedule deadlocks under blocking send/receive: no rank can go on ({waits})",
                stuck,
            )


def _pairs_with(peer_head: Action, schedule: Schedule, rank: int, action: Action) -> bool:
    """Whether `peer_head` is a p2p action in the opposite role toward `rank` (gloo would pair them)."""
    if not peer_head.kind.is_p2p:
        return False
    peer_stage, _ = _peer(peer_head)
    sending = action.kind in (SF, SB)
    peer_sending = peer_head.kind in (SF, SB)
    return schedule.rank_of(peer_stage) == rank and sending != peer_sending
