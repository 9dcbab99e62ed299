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
    """The cross-stage action this one waits for: F(s−1, i) for F(s, i), B(s+1, i) for B(s, i)."""
    if action.kind is ActionKind.FORWARD and action.stage > 0:
        return (ActionKind.FORWARD, action.stage - 1, action.microbatch)  # type: ignore[return-value]
    if action.kind is ActionKind.BACKWARD and action.stage < last_stage:
        return (ActionKind.BACKWARD, action.stage + 1, action.microbatch)  # type: ignore[return-value]
    return None


def execution_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """(rank, action) pairs of every non-p2p action in an order that respects all dependencies.

    Sweeps the ranks, advancing each one while the dependency of its next action is done; a sweep
    without progress means a cycle (a deadlock), reported as a grid with each stuck rank marked.
    """
    last_stage = schedule.virtual_stages - 1
    ranks = sorted(schedule.actions)
    per_rank = {r: [a for a in schedule.actions[r] if not a.kind.is_p2p] for r in ranks}
    steps = {r: [k for k, a in enumerate(schedule.actions[r]) if not a.kind.is_p2p] for r in ranks}
    done: set[ActionKey] = set()
    heads = dict.fromkeys(ranks, 0)
    order: list[tuple[int, Action]] = []
    remaining = sum(len(v) for v in per_rank.values())
    while remaining:
        progressed = False
        for rank in ranks:
            actions = per_rank[rank]
            head = heads[rank]
            while head < len(actions):
                action = actions[head]
                needed = dependency(action, last_stage)
                if needed is not None and needed not in done:
                    break
                if action.microbatch is not None:
                    done.add((action.kind, action.stage, action.microbatch))
                order.append((rank, action))
                head += 1
                remaining -= 1
                progressed = True
            heads[rank] = head
        if not progressed:
            stuck = {r: steps[r][heads[r]] for r in ranks if heads[r] < len(per_rank[r])}
            waits = ", ".join(
                f"rank {r} waits at {per_rank[r][heads[r]]}" for r in ranks if heads[r] < len(per_rank[r])
            )
            raise ScheduleError(
                f"schedule deadlocks: no rank can go on ({waits}); each waits for an input that "
                "another rank produces only later\n" + format_grid(schedule, stuck)
            )
    return order
