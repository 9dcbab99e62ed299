"""The dependency structure of a schedule: which action waits for which, and an order that runs.

Compute actions depend on the neighbouring stage: F(s, i) on F(s−1, i) (its input activation),
B(s, i) on B(s+1, i) (its output gradient); within a rank, actions run in list order. Together
these edges form a DAG exactly when the schedule can run; `execution_order` returns a topological
order of it (sends and receives are skipped: they only carry these edges) or raises a
`ScheduleError` showing where every rank is stuck.

    >>> from pipectl.schedule.generators import one_f_one_b
    >>> [str(a) for _, a in execution_order(one_f_one_b(2, 1))]
    ['0F0', '1F0', '1B0', '1AR', '1STEP', '0B0', '0AR', '0STEP']
"""

from __future__ import annotations

from pipectl.errors import ScheduleError
from pipectl.schedule.grid import format_grid
from pipectl.schedule.ir import Action, ActionKind, Schedule

ActionKey = tuple[ActionKind, int, int]


def dependency(action: Action, last_stage: int) -> ActionKey | None:
    """The cross-stage action this one waits for: F(s−1, i) for F(s, i), B(s+1, i) for B(s, i).

    In a split-backward schedule (zero bubble) I(s, i) waits for I(s+1, i); W(s, i) waits only for
    its own I(s, i), on the same rank (list order). A schedule splits the backward on every stage
    or on none.
    """
    if action.kind is ActionKind.FORWARD and action.stage > 0:
        return (ActionKind.FORWARD, action.stage - 1, action.microbatch)  # type: ignore[return-value]
    if action.kind.computes_input_gradient and action.stage < last_stage:
        return (action.kind, action.stage + 1, action.microbatch)  # type: ignore[return-value]
    return None


_P2P = frozenset(kind for kind in ActionKind if kind.is_p2p)


def execution_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """(rank, action) pairs of every non-p2p action in an order that respects all dependencies.

    Runs each rank until its next action waits for an input not yet produced, and resumes it when
    that input is produced; ranks left waiting mean a cycle (a deadlock), reported as a grid with
    each stuck rank marked.
    """
    forward, backward, backward_input = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT
    last_stage = schedule.virtual_stages - 1
    ranks = sorted(schedule.actions)
    # per rank: (action, its own key or None, the key it waits for or None, index in the rank's list)
    per_rank: dict[int, list[tuple[Action, ActionKey | None, ActionKey | None, int]]] = {}
    for rank in ranks:
        entries = []
        for step, action in enumerate(schedule.actions[rank]):
            kind = action.kind
            if kind in _P2P:
                continue
            stage, microbatch = action.stage, action.microbatch
            own = None if microbatch is None else (kind, stage, microbatch)
            if kind is forward and stage > 0:
                needed: ActionKey | None = (forward, stage - 1, microbatch)  # type: ignore[assignment]
            elif (kind is backward or kind is backward_input) and stage < last_stage:
                needed = (kind, stage + 1, microbatch)  # type: ignore[assignment]
            else:
                needed = None
            entries.append((action, own, needed, step))
        per_rank[rank] = entries
    # Kahn's algorithm with one waiter per key: a rank runs until its next action needs a key not
    # yet done, parks on that key, and is woken when the key's action is placed.
    done: set[ActionKey] = set()
    waiting: dict[ActionKey, int] = {}
    heads = dict.fromkeys(ranks, 0)
    runnable = list(reversed(ranks))
    order: list[tuple[int, Action]] = []
    append = order.append
    while runnable:
        rank = runnable.pop()
        entries = per_rank[rank]
        head = heads[rank]
        end = len(entries)
        while head < end:
            action, own, needed, _ = entries[head]
            if needed is not None and needed not in done:
                waiting[needed] = rank
                break
            if own is not None:
                done.add(own)
                woken = waiting.pop(own, None)
                if woken is not None:
                    runnable.append(woken)
            append((rank, action))
            head += 1
        heads[rank] = head
    if len(order) != sum(len(v) for v in per_rank.values()):
        stuck = {r: per_rank[r][heads[r]][3] for r in ranks if heads[r] < len(per_rank[r])}
        waits = ", ".join(
            f"rank {r} waits at {per_rank[r][heads[r]][0]}" for r in ranks if heads[r] < len(per_rank[r])
        )
        raise ScheduleError(
            f"schedule deadlocks: no rank can go on ({waits}); each waits for an input that "
            "another rank produces only later\n" + format_grid(schedule, stuck)
        )
    return order
