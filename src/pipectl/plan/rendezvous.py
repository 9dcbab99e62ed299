"""One pipeline step with blocking point-to-point transfers (gloo): a send waits for its receive.

`pipectl.plan.simulate` times a transfer as an edge delay: the producer sends and goes on, and the
consumer's compute starts once the bytes have landed (asynchronous p2p, as NCCL on GPUs overlaps
it). With gloo (the CPU backend) a send returns only once the peer has posted the matching
receive, for any message size; measured here: a 1 KiB send whose receive is posted 100 ms late
takes 100.4-100.7 ms, an 8 MiB one 103-105 ms. So a rank that reaches `SF(s, i)` before its
neighbour reaches `RF(s+1, i)` sits idle until it does, and the order in which the communication
pass (`pipectl.schedule.comm`) placed the sends and receives decides who waits.

The model: every rank runs its actions in list order, one at a time. A send and its matching
receive form one *rendezvous*:

    start = max(end of the sender's previous action, end of the receiver's previous action)
    end   = start + transfer (latency + bytes / bandwidth of that boundary)

and both ranks go on from `end`. Compute actions, the all-reduce and the optimizer step take
their cost table durations as in `simulate`. The schedule must carry its sends and receives (the
schedule the runtime executes, `add_communication(generate(...))`); one without them is given
them first. A schedule the communication pass accepted cannot deadlock under these semantics
(it replays blocking send/receive), so the walk below always finishes; it raises
`ScheduleError` otherwise. Transfer jitter (`StageCosts.jitter_seconds`) is not applied here.

Worked example (p=2, m=2, 1F1B, F=1, B=2, transfer 0.5). Rank 1 receives F1's activation before
its B0 (where the communication pass put it), so its B0 waits for rank 0's F1; rank 0's send of
F1 waited for nothing, but its B1 waits for rank 1 to finish B1 and hand the gradient over. The
step takes 11, against 10 with asynchronous transfers:

    >>> from pipectl.plan.simulate import simulate, uniform_costs
    >>> from pipectl.schedule import ScheduleKind, generate
    >>> costs = uniform_costs(2, 1, 1.0, 2.0, send=0.5)
    >>> schedule = generate(ScheduleKind.ONE_F_ONE_B, 2, 2)
    >>> timeline = simulate_rendezvous(schedule, costs)
    >>> timeline.step_seconds, simulate(schedule, costs).step_seconds
    (11.0, 10.0)
    >>> [(str(r.action), r.start, r.end) for r in timeline.records if r.rank == 1]
    [('1F0', 1.5, 2.5), ('1B0', 3.0, 5.0), ('1F1', 5.5, 6.5), ('1B1', 6.5, 8.5), ('1AR', 9.0, 9.0), ('1STEP', 9.0, 9.0)]
"""

from __future__ import annotations

from functools import lru_cache

from pipectl.errors import ScheduleError
from pipectl.plan.simulate import StageCosts, Timeline, TimedAction, check_costs, peak_memory_counts, timeline_of
from pipectl.schedule.comm import add_communication
from pipectl.schedule.generators import generate
from pipectl.schedule.ir import Action, ActionKind, Schedule, ScheduleKind

__all__ = ["simulate_rendezvous", "rendezvous_step_seconds", "executed_schedule"]

F, B, R = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECOMPUTE
SF, RF, SB, RB = ActionKind.SEND_FORWARD, ActionKind.RECV_FORWARD, ActionKind.SEND_BACKWARD, ActionKind.RECV_BACKWARD

# A p2p action's partner: (its kind, the partner's stage minus this action's stage).
_PARTNER = {SF: (RF, +1), RF: (SF, -1), SB: (RB, -1), RB: (SB, +1)}


@lru_cache(maxsize=256)
def executed_schedule(kind: ScheduleKind, pipeline_parallel: int, micro_batches: int, chunks: int,
                      recompute: bool) -> Schedule:
    """`generate(...)` with the sends and receives the runtime executes (cached)."""
    schedule = generate(kind, pipeline_parallel, micro_batches, chunks, recompute)
    return add_communication(schedule) if pipeline_parallel > 1 else schedule


def _transfer_seconds(action: Action, costs: StageCosts) -> float:
    """The transfer time of the boundary a p2p action crosses (both ends read the same entry)."""
    kind, stage = action.kind, action.stage
    if kind is SF:
        return costs.send_forward_seconds[stage]
    if kind is RF:
        return costs.send_forward_seconds[stage - 1]
    if kind is SB:
        return costs.send_backward_seconds[stage - 1]
    return costs.send_backward_seconds[stage]


def _duration(rank: int, action: Action, costs: StageCosts) -> float:
    kind = action.kind
    if kind is F:
        return costs.forward_seconds[action.stage]
    if kind is B:
        return costs.backward_seconds[action.stage]
    if kind is R:
        return costs.recompute_seconds[action.stage]
    if kind is ActionKind.ALL_REDUCE:
        return costs.allreduce_seconds[rank]
    return costs.optimizer_seconds[rank]


def simulate_rendezvous(schedule: Schedule, costs: StageCosts) -> Timeline:
    """Time one step of `schedule` with blocking p2p (see the module docstring).

    Records hold the compute actions, the all-reduce and the optimizer step (as `simulate`'s do);
    `communication_seconds_per_rank` counts, per rank, the time spent inside rendezvous (the
    transfers) plus the all-reduce; waiting for a late partner counts as idle (bubble).
    """
    p = schedule.pipeline_parallel
    check_costs(p, schedule.virtual_stages, costs)
    if p > 1 and not any(a.kind.is_p2p for actions in schedule.actions.values() for a in actions):
        schedule = add_communication(schedule)
    actions = [schedule.actions.get(rank, ()) for rank in range(p)]
    position = [0] * p
    free = [0.0] * p
    busy = [0.0] * p
    compute = [0.0] * p
    exposed = [0.0] * p
    records: list[TimedAction] = []
    remaining = sum(len(a) for a in actions)
    while remaining:
        progressed = False
        for rank in range(p):
            own = actions[rank]
            while position[rank] < len(own):
                action = own[position[rank]]
                if not action.kind.is_p2p:
                    start = free[rank]
                    seconds = _duration(rank, action, costs)
                    free[rank] = start + seconds
                    busy[rank] += seconds
                    if action.kind.is_compute:
                        compute[rank] += seconds
                    elif action.kind is ActionKind.ALL_REDUCE:
                        exposed[rank] += seconds
                    records.append(TimedAction(rank, action, start, free[rank]))
                    position[rank] += 1
                    remaining -= 1
                    progressed = True
                    continue
                partner_kind, offset = _PARTNER[action.kind]
                partner_stage = action.stage + offset
                peer = partner_stage % p
                waiting = actions[peer][position[peer]] if position[peer] < len(actions[peer]) else None
                if waiting != Action(partner_stage, partner_kind, action.microbatch):
                    break  # the partner is not there yet: run the other ranks
                start = max(free[rank], free[peer])
                seconds = _transfer_seconds(action, costs)
                free[rank] = free[peer] = start + seconds
                exposed[rank] += seconds
                exposed[peer] += seconds
                position[rank] += 1
                position[peer] += 1
                remaining -= 2
                progressed = True
        if not progressed:
            stuck = ", ".join(
                f"rank {rank} at {actions[rank][position[rank]]}" for rank in range(p) if position[rank] < len(actions[rank])
            )
            raise ScheduleError(f"blocking send/receive deadlocks: {stuck}")

    peaks = [peak_memory_counts([a for a in actions[rank] if not a.kind.is_p2p]) for rank in range(p)]
    records.sort(key=lambda record: (record.start, record.rank))
    return timeline_of(
        records, max(free, default=0.0), busy, compute, exposed,
        [full for full, _ in peaks], [stashed for _, stashed in peaks],
    )  # fmt: skip


def rendezvous_step_seconds(kind: ScheduleKind, pipeline_parallel: int, micro_batches: int, chunks: int,
                            recompute: bool, costs: StageCosts) -> float:
    """The step time of the schedule the runtime executes for (kind, p, m, v, recompute)."""
    schedule = executed_schedule(kind, pipeline_parallel, micro_batches, chunks, recompute)
    return simulate_rendezvous(schedule, costs).step_seconds
