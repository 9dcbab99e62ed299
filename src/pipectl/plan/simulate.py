"""Event-driven simulation of one pipeline step (Varuna §4.2's simulator; docs/design.md, 'Simulator').

`simulate(schedule, costs) -> Timeline` is a pure function. It reads the same `Schedule` the
runtime executes and times every compute action (F, B, R, and the split backward's I and W), the
data-parallel all-reduce and the optimizer step. An action starts when both

* the previous action on its rank has ended (ranks run one action at a time), and
* its cross-stage input has arrived: F(s, i) needs F(s−1, i) plus the activation transfer
  s−1 → s; B(s, i) needs B(s+1, i) plus the gradient transfer s+1 → s
  (transfer = latency + bytes / bandwidth, precomputed per boundary by the caller, plus an
  optional seeded random jitter per transfer, |N(0, σ)|). In a split-backward (zero-bubble)
  schedule I(s, i) needs I(s+1, i) plus the gradient transfer, and W(s, i) needs nothing from
  another stage (only its own I, earlier on the rank): W sends nothing.

So the earliest start of every action is max(end of its predecessor on the rank, end of its
dependency + transfer): a longest-path pass over a DAG. Sends and receives are not timed as
actions of their own: p2p actions in a schedule (after `add_communication`) are skipped and the
transfer is an edge delay, i.e. transfers overlap with compute (asynchronous p2p, as on GPUs).
The all-reduce starts after the rank's last backward (no overlap with backward assumed), then
the optimizer step runs; the step ends when the last rank's optimizer step ends.

Blocking transfers. Cost tables with `blocking_p2p` (gloo, the CPU backend) are timed by the
second model of this module, `simulate_rendezvous`, on the schedule with its sends and receives:
see "Blocking transfers" below. `simulate` picks the model by the cost table, so it is the one
definition of a step's time for either kind of device.

Units. Every cost is seconds per micro-batch per *virtual stage*. With v chunks per rank, a chunk
holds 1/v of the rank's layers, so if a rank's whole share costs t_f forward and t_b backward per
micro-batch, each chunk costs t_f/v and t_b/v (`uniform_costs` does this division). In that uniform,
free-communication case the simulator reproduces the closed forms exactly (docs/design.md, 'Schedules and the
bubble'; Narayanan et al. 2021 §2.2):

    GPipe, 1F1B:   step = (m + p − 1)(t_f + t_b)
    interleaved:   step = (m + (p − 1)/v)(t_f + t_b)
    zb-h1:         step = m (t_f + t_b) + (p − 1)(t_f + t_I − t_W)      (m ≥ p, t_W ≤ min(t_f, t_I))

The split backward: I and W take `StageCosts.backward_input_fraction` of a backward and the rest
(`plan.stage_costs`).

Bubble conventions. `Timeline.bubble_fraction[r]` is idle / step (idle = step − the rank's busy
time, all-reduce and optimizer step counted as busy), in [0, 1]. The papers' (p − 1)/m and
(p − 1)/(v·m) are idle / useful compute: that is `Timeline.bubble_ratio[r]`. For GPipe/1F1B in the
uniform case, bubble_fraction = (p − 1)/(m + p − 1) and bubble_ratio = (p − 1)/m.

Worked example (p=2, m=2, 1F1B, t_f=1, t_b=2 per micro-batch, free communication):

    >>> from pipectl.schedule import ScheduleKind, generate
    >>> from pipectl.plan.stage_costs import uniform_costs
    >>> timeline = simulate(generate(ScheduleKind.ONE_F_ONE_B, 2, 2), uniform_costs(2, 1, 1.0, 2.0))
    >>> timeline.step_seconds, (2 + 2 - 1) * (1.0 + 2.0)
    (9.0, 9.0)
    >>> timeline.bubble_ratio
    (0.5, 0.5)
    >>> [(str(r.action), r.start, r.end) for r in timeline.records if r.rank == 1][:2]
    [('1F0', 1.0, 2.0), ('1B0', 2.0, 4.0)]

Speed. The dependency structure of a schedule (topological order, predecessor and dependency
indices, which cost each action reads) is compiled once per `Schedule` object and cached (and
`generate` itself is cached), so a call costs one tight list pass over the actions;
`simulate_step_seconds` skips building records. See benchmarks/simulator_speed.py. The planner
reaches this module through `pipectl.plan.timing`, which uses the exact fast paths of
`pipectl.plan.fast` where they apply.

Blocking transfers (gloo). With gloo a send returns only once the peer has posted the matching
receive, for any message size (a send whose receive is posted late takes as long as the delay,
plus its transfer). So a rank that reaches `SF(s, i)` before its neighbour
reaches `RF(s+1, i)` sits idle until it does, and the order in which the communication pass
(`pipectl.schedule.comm`) placed the sends and receives decides who waits. `simulate_rendezvous`
runs every rank's actions in list order, one at a time; a send and its matching receive form one
*rendezvous*:

    start = max(end of the sender's previous action, end of the receiver's previous action)
    end   = start + transfer (latency + bytes / bandwidth of that boundary)

and both ranks go on from `end`. Compute actions, the all-reduce and the optimizer step take
their cost table durations as above. A schedule without sends and receives is given them first
(`add_communication`, what the runtime executes). A schedule the communication pass accepted
cannot deadlock under these semantics (it replays blocking send/receive); `ScheduleError`
otherwise. Transfer jitter is not applied here.

Worked example (p=2, m=2, 1F1B, F=1, B=2, transfer 0.5). Rank 1 receives F1's activation before
its B0 (where the communication pass put it), so its B0 waits for rank 0's F1; rank 0's send of
F1 waited for nothing, but its B1 waits for rank 1 to finish B1 and hand the gradient over. The
step takes 11, against 10 with asynchronous transfers:

    >>> costs = uniform_costs(2, 1, 1.0, 2.0, send=0.5)
    >>> schedule = generate(ScheduleKind.ONE_F_ONE_B, 2, 2)
    >>> timeline = simulate_rendezvous(schedule, costs)
    >>> timeline.step_seconds, simulate(schedule, costs).step_seconds
    (11.0, 10.0)
    >>> [(str(r.action), r.start, r.end) for r in timeline.records if r.rank == 1]
    [('1F0', 1.5, 2.5), ('1B0', 3.0, 5.0), ('1F1', 5.5, 6.5), ('1B1', 6.5, 8.5), ('1AR', 9.0, 9.0), ('1STEP', 9.0, 9.0)]
    >>> from dataclasses import replace
    >>> simulate(schedule, replace(costs, blocking_p2p=True)).step_seconds
    11.0
"""

from __future__ import annotations

import math
import random
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

from pipectl.errors import ScheduleError
from pipectl.schedule.comm import add_communication
from pipectl.schedule.dag import execution_order
from pipectl.schedule.ir import Action, ActionKind, Schedule
from pipectl.plan.stage_costs import StageCosts, check_costs

__all__ = [
    "peak_memory_counts",
    "simulate",
    "simulate_rendezvous",
    "simulate_step_seconds",
    "StepSummary",
    "TimedAction",
    "Timeline",
    "timeline_of",
    "transfers_block",
]


class TimedAction(NamedTuple):
    """One action of the step with its simulated start and end (seconds from the step's start)."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """The simulated step. Per-rank tuples are indexed by rank."""

    records: tuple[TimedAction, ...]  # every timed action, in a valid execution order
    step_seconds: float
    bubble_fraction: tuple[float, ...]  # per rank: idle / step
    communication_seconds: float  # exposed (non-overlapped) p2p + all-reduce time, max over ranks
    peak_in_flight: tuple[int, ...]  # per rank: max (chunk, micro-batch) pairs holding full activations
    bubble_ratio: tuple[float, ...] = ()  # per rank: idle / compute (F+B+R) -- the papers' (p-1)/m
    communication_seconds_per_rank: tuple[float, ...] = ()  # exposed p2p wait + all-reduce, per rank
    peak_stashed_inputs: tuple[int, ...] = ()  # per rank: max micro-batches forwarded, not yet backwarded

    def rank_records(self, rank: int) -> list[TimedAction]:
        return [r for r in self.records if r.rank == rank]

    def summary(self) -> "StepSummary":
        return StepSummary(
            step_seconds=self.step_seconds,
            bubble_fraction=self.bubble_fraction,
            communication_seconds=self.communication_seconds,
            communication_seconds_per_rank=self.communication_seconds_per_rank,
        )


@dataclass(frozen=True)
class StepSummary:
    """What the planner records of a step: `Timeline.summary()`, or a fast path's equal figures."""

    step_seconds: float
    bubble_fraction: tuple[float, ...]  # per rank: idle / step
    communication_seconds: float  # exposed p2p waits + all-reduce, max over ranks
    communication_seconds_per_rank: tuple[float, ...]


# --------------------------------------------------------------------------- compiled structure


@dataclass(frozen=True)
class _Compiled:
    """A schedule's dependency DAG, flattened into lists over a topological order of its actions.

    Position k reads `end[prev[k]]` (previous action on its rank) and `end[dep[k]]` (cross-stage
    dependency); index -1 is a sentinel slot whose end is 0. Costs are looked up through
    `durations` (into forward|backward|recompute|allreduce|optimizer concatenated) and `delays`
    (into [0]|send_forward|send_backward).
    """

    pipeline_parallel: int
    virtual_stages: int
    ranks: tuple[int, ...]
    actions: tuple[Action, ...]
    prev: tuple[int, ...]
    dep: tuple[int, ...]
    duration_index: tuple[int, ...]
    delay_index: tuple[int, ...]
    durations: itemgetter
    delays: itemgetter
    transfer_positions: tuple[int, ...]  # positions whose dependency crosses ranks (jitter applies)
    rank_last: tuple[int, ...]  # position of each rank's last action
    compute_kinds: tuple[bool, ...]  # F/B/R/I/W (counts toward bubble_ratio's denominator)
    allreduce_positions: tuple[int, ...]
    peak_in_flight: tuple[int, ...]
    peak_stashed_inputs: tuple[int, ...]
    splits_backward: bool = False  # has I/W actions: the cost table grows by their durations


_TIMED = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.RECOMPUTE,
    ActionKind.ALL_REDUCE,
    ActionKind.OPTIMIZER_STEP,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)

_COMPUTE = frozenset(
    (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECOMPUTE, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
)

# id(schedule) -> (weak reference to it, compiled form). Verified through the weak reference, so a
# recycled id never returns a stale entry; entries die with their schedule.
_CACHE: dict[int, tuple[weakref.ref, _Compiled]] = {}


def _compiled(schedule: Schedule) -> _Compiled:
    key = id(schedule)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is schedule:
        return hit[1]
    compiled = _compile(schedule)
    _CACHE[key] = (weakref.ref(schedule, lambda _ref, key=key: _CACHE.pop(key, None)), compiled)
    return compiled


def _compile(schedule: Schedule) -> _Compiled:
    p = schedule.pipeline_parallel
    stages = schedule.virtual_stages
    last_stage = stages - 1
    per_rank = {
        rank: [a for a in schedule.actions.get(rank, ()) if a.kind in _TIMED] for rank in range(p)
    }
    if set(schedule.actions) - set(range(p)):
        raise ScheduleError(
            f"schedule has ranks {sorted(schedule.actions)} but pipeline-parallel degree p={p}"
        )
    _check_compute_structure(schedule, per_rank)

    order = [(rank, a) for rank, a in execution_order(schedule) if a.kind in _TIMED]
    position = {
        (a.kind, a.stage, a.microbatch): k for k, (_, a) in enumerate(order) if a.microbatch is not None
    }

    n = len(order)
    forward, backward, recompute = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECOMPUTE
    allreduce = ActionKind.ALL_REDUCE
    backward_input, backward_weight = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
    last_on_rank = [-1] * p
    # Boundaries s -> s + 1 that nothing crosses: the turn of zbv's V (stages p - 1 and p on one
    # rank). The loop placement charges every boundary's send, also where p = 1 puts every chunk on
    # one rank, as the planner's fast paths do.
    turn = {p - 1} if schedule.kind.v_placement and stages > p else set()
    prev, dep, duration_index, delay_index, transfer_positions = [], [], [], [], []
    allreduce_offset = 3 * stages
    optimizer_offset = allreduce_offset + p
    input_offset = optimizer_offset + p  # split backward: I's then W's durations (`_cost_tables`)
    weight_offset = input_offset + stages
    for k, (rank, action) in enumerate(order):
        prev.append(last_on_rank[rank])
        last_on_rank[rank] = k
        kind, s = action.kind, action.stage
        # Dependencies as in pipectl.schedule.dag.dependency; delays index
        # [0] + send_forward[0..S-2] + send_backward[0..S-2].
        if kind is forward:
            duration_index.append(s)
            if s > 0:
                dep.append(position[(forward, s - 1, action.microbatch)])
                delay_index.append(0 if s - 1 in turn else s)
                if schedule.rank_of(s - 1) != rank:
                    transfer_positions.append(k)
                continue
        elif kind is backward or kind is backward_input:
            duration_index.append(stages + s if kind is backward else input_offset + s)
            if s < last_stage:
                dep.append(position[(kind, s + 1, action.microbatch)])
                delay_index.append(0 if s in turn else stages + s)
                if schedule.rank_of(s + 1) != rank:
                    transfer_positions.append(k)
                continue
        elif kind is recompute:
            duration_index.append(2 * stages + s)
        elif kind is backward_weight:  # waits only for its own I, earlier on this rank
            duration_index.append(weight_offset + s)
        elif kind is allreduce:
            duration_index.append(allreduce_offset + rank)
        else:
            duration_index.append(optimizer_offset + rank)
        dep.append(-1)
        delay_index.append(0)

    peaks = [peak_memory_counts(per_rank[rank]) for rank in range(p)]
    return _Compiled(
        pipeline_parallel=p,
        virtual_stages=stages,
        ranks=tuple(rank for rank, _ in order),
        actions=tuple(action for _, action in order),
        prev=tuple(prev),
        dep=tuple(dep),
        duration_index=tuple(duration_index),
        delay_index=tuple(delay_index),
        durations=itemgetter(*duration_index) if n > 1 else (lambda table: (table[duration_index[0]],)),
        delays=itemgetter(*delay_index) if n > 1 else (lambda table: (table[delay_index[0]],)),
        transfer_positions=tuple(transfer_positions),
        rank_last=tuple(last_on_rank),
        compute_kinds=tuple(a.kind in _COMPUTE for _, a in order),
        allreduce_positions=tuple(k for k, (_, a) in enumerate(order) if a.kind is ActionKind.ALL_REDUCE),
        peak_in_flight=tuple(full for full, _ in peaks),
        peak_stashed_inputs=tuple(stashed for _, stashed in peaks),
        splits_backward=any(a.kind is backward_input for _, a in order),
    )


def _check_compute_structure(schedule: Schedule, per_rank: dict[int, list[Action]]) -> None:
    """What the DAG cannot see by itself: F exactly once, then either B once or I then W once each;
    R at most once, between F and the backward (B, or I)."""
    m, stages = schedule.micro_batches, schedule.virtual_stages
    seen: dict[tuple[ActionKind, int, int], int] = {}
    for rank, actions in per_rank.items():
        for index, action in enumerate(actions):
            if action.microbatch is None:
                continue
            if action.stage >= stages or schedule.rank_of(action.stage) != rank or action.microbatch >= m:
                raise ScheduleError(
                    f"rank {rank} has {action}: stage must be < {stages} and live on this rank "
                    f"(rank_of(stage) == {rank}), micro-batch < {m}"
                )
            key = (action.kind, action.stage, action.microbatch)
            if key in seen:
                raise ScheduleError(f"rank {rank} runs {action} twice")
            seen[key] = index
    for s in range(stages):
        for i in range(m):
            f = seen.get((ActionKind.FORWARD, s, i))
            b = seen.get((ActionKind.BACKWARD, s, i))
            r = seen.get((ActionKind.RECOMPUTE, s, i))
            x = seen.get((ActionKind.BACKWARD_INPUT, s, i))
            w = seen.get((ActionKind.BACKWARD_WEIGHT, s, i))
            if b is not None and (x is not None or w is not None):
                raise ScheduleError(f"rank {schedule.rank_of(s)} runs {s}B{i} and a split backward ({s}I{i}/{s}W{i}) of it")
            if b is None and (x is None) != (w is None):
                missing = f"{s}I{i}" if x is None else f"{s}W{i}"
                raise ScheduleError(f"rank {schedule.rank_of(s)} never runs {missing} (a split backward needs I and W)")
            if f is None or (b is None and x is None):
                missing = f"{s}F{i}" if f is None else f"{s}B{i}"
                raise ScheduleError(f"rank {schedule.rank_of(s)} never runs {missing}")
            backward_name = f"{s}B{i}" if b is not None else f"{s}I{i}"
            first_backward = b if b is not None else x
            if not f < first_backward or (r is not None and not f < r < first_backward):
                raise ScheduleError(f"rank {schedule.rank_of(s)} must run {s}F{i} before {s}R{i} before {backward_name}")
            if w is not None and not x < w:
                raise ScheduleError(f"rank {schedule.rank_of(s)} must run {s}I{i} before {s}W{i}")


def peak_memory_counts(actions: list[Action]) -> tuple[int, int]:
    """(peak full activations, peak stashed inputs) held by a rank, in (chunk, micro-batch) pairs.

    Without recomputation a micro-batch holds its full activations from F until B. With it (an R
    before its B) only the stage's input is kept from F until R, and full activations from R until
    B (docs/design.md, 'Memory model'). A split backward holds them until W, not I: W needs each layer's
    input and output gradient, which is most of what the forward saved (counted whole here).
    """
    recomputed = {(a.stage, a.microbatch) for a in actions if a.kind is ActionKind.RECOMPUTE}
    full = stashed = peak_full = peak_stashed = 0
    for a in actions:
        key = (a.stage, a.microbatch)
        if a.kind is ActionKind.FORWARD:
            stashed += 1
            if key not in recomputed:
                full += 1
        elif a.kind is ActionKind.RECOMPUTE:
            full += 1
        elif a.kind is ActionKind.BACKWARD or a.kind is ActionKind.BACKWARD_WEIGHT:
            stashed -= 1
            full -= 1
        peak_full = max(peak_full, full)
        peak_stashed = max(peak_stashed, stashed)
    return peak_full, peak_stashed


def _cost_tables(compiled: _Compiled, costs: StageCosts) -> tuple[list[float], list[float]]:
    check_costs(compiled.pipeline_parallel, compiled.virtual_stages, costs)
    duration_table = [
        *costs.forward_seconds,
        *costs.backward_seconds,
        *costs.recompute_seconds,
        *costs.allreduce_seconds,
        *costs.optimizer_seconds,
    ]
    if compiled.splits_backward:
        duration_table += _split_backward(costs)
    delay_table = [0.0, *costs.send_forward_seconds, *costs.send_backward_seconds]
    durations = list(compiled.durations(duration_table))
    delays = list(compiled.delays(delay_table))
    if costs.jitter_seconds > 0:
        draw = random.Random(costs.seed).gauss
        sigma = costs.jitter_seconds
        for k in compiled.transfer_positions:
            delays[k] += abs(draw(0.0, sigma))
    return durations, delays


def _split_backward(costs: StageCosts) -> list[float]:
    """Per stage I's seconds, then W's: the backward divided by `backward_input_fraction`."""
    fraction = costs.backward_input_fraction
    inputs = [b * fraction for b in costs.backward_seconds]
    return inputs + [b - i for b, i in zip(costs.backward_seconds, inputs)]


def _ends(compiled: _Compiled, durations: list[float], delays: list[float]) -> list[float]:
    """The longest-path pass: end[k] = max(end[prev], end[dep] + delay) + duration."""
    end = [0.0] * (len(durations) + 1)  # slot -1 is the sentinel "time zero"
    k = 0
    for before, needed, delay, duration in zip(compiled.prev, compiled.dep, delays, durations):
        ready = end[needed] + delay
        free = end[before]
        end[k] = (free if free > ready else ready) + duration
        k += 1
    return end


def simulate_step_seconds(schedule: Schedule, costs: StageCosts) -> float:
    """The step time only (no records); always equal to `simulate(schedule, costs).step_seconds`."""
    if transfers_block(schedule.pipeline_parallel, costs):
        return simulate(schedule, costs).step_seconds
    compiled = _compiled(schedule)
    durations, delays = _cost_tables(compiled, costs)
    end = _ends(compiled, durations, delays)
    return max(end[k] for k in compiled.rank_last if k >= 0)


def transfers_block(pipeline_parallel: int, costs: StageCosts) -> bool:
    """Whether `simulate` times this step's transfers as rendezvous: the cost table's sends block
    and there is more than one stage (one stage has no transfers)."""
    return costs.blocking_p2p and pipeline_parallel > 1


def simulate(schedule: Schedule, costs: StageCosts) -> Timeline:
    """Time one step of `schedule` under `costs`; see the module docstring for the model.

    With `costs.blocking_p2p` (and more than one stage) the transfers are rendezvous instead of
    edge delays: `simulate_rendezvous`.
    """
    if transfers_block(schedule.pipeline_parallel, costs):
        return simulate_rendezvous(schedule, costs)
    compiled = _compiled(schedule)
    durations, delays = _cost_tables(compiled, costs)
    end = _ends(compiled, durations, delays)
    p = compiled.pipeline_parallel
    step = max((end[k] for k in compiled.rank_last if k >= 0), default=0.0)

    busy = [0.0] * p
    compute = [0.0] * p
    exposed = [0.0] * p
    records = []
    for k, (rank, action) in enumerate(zip(compiled.ranks, compiled.actions)):
        needed, before = compiled.dep[k], compiled.prev[k]
        ready = end[needed] + delays[k]
        start = end[before] if end[before] > ready else ready  # as in _ends, so start + duration == end
        records.append(TimedAction(rank, action, start, end[k]))
        busy[rank] += durations[k]
        if compiled.compute_kinds[k]:
            compute[rank] += durations[k]
        if needed >= 0:
            # Waiting that started once the producer had finished is transfer time, not bubble
            # caused by the pipeline's shape: count it as exposed communication.
            waiting_since = max(end[before], end[needed])
            if start > waiting_since:
                exposed[rank] += start - waiting_since
    for k in compiled.allreduce_positions:
        exposed[compiled.ranks[k]] += durations[k]

    return timeline_of(records, step, busy, compute, exposed, compiled.peak_in_flight, compiled.peak_stashed_inputs)


def timeline_of(
    records: Sequence[TimedAction],
    step: float,
    busy: Sequence[float],
    compute: Sequence[float],
    exposed: Sequence[float],
    peak_in_flight: Sequence[int],
    peak_stashed_inputs: Sequence[int],
) -> Timeline:
    """A `Timeline` from per-rank busy, compute (F+B+R) and exposed communication seconds."""
    idle = [max(step - b, 0.0) for b in busy]
    return Timeline(
        records=tuple(records),
        step_seconds=step,
        bubble_fraction=tuple(i / step if step > 0 else 0.0 for i in idle),
        communication_seconds=max(exposed, default=0.0),
        peak_in_flight=tuple(peak_in_flight),
        bubble_ratio=tuple(
            i / c if c > 0 else (0.0 if i == 0 else math.inf) for i, c in zip(idle, compute)
        ),
        communication_seconds_per_rank=tuple(exposed),
        peak_stashed_inputs=tuple(peak_stashed_inputs),
    )


# ------------------------------------------------------------------- blocking transfers (gloo)

F, B, R = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECOMPUTE
SF, RF, SB, RB = ActionKind.SEND_FORWARD, ActionKind.RECV_FORWARD, ActionKind.SEND_BACKWARD, ActionKind.RECV_BACKWARD

# A p2p action's partner: (its kind, the partner's stage minus this action's stage).
_PARTNER = {SF: (RF, +1), RF: (SF, -1), SB: (RB, -1), RB: (SB, +1)}


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
    if kind is ActionKind.BACKWARD_INPUT:
        return costs.backward_seconds[action.stage] * costs.backward_input_fraction
    if kind is ActionKind.BACKWARD_WEIGHT:
        b = costs.backward_seconds[action.stage]
        return b - b * costs.backward_input_fraction
    if kind is ActionKind.ALL_REDUCE:
        return costs.allreduce_seconds[rank]
    return costs.optimizer_seconds[rank]


def simulate_rendezvous(schedule: Schedule, costs: StageCosts) -> Timeline:
    """Time one step of `schedule` with blocking p2p (module docstring: "Blocking transfers").

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
                peer = schedule.rank_of(partner_stage)
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
