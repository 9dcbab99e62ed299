"""A step split into phases, per pipeline stage, as the simulator predicts it and as ranks measure it.

Six phases of a rank's step (`PHASES`):

- forward: its forwards and recomputes;
- backward: its backwards;
- pipeline waits: its sends and receives, waiting for its peers included (the bubble and the
  transfers between stages);
- gradient reductions: the tied and data-parallel reductions at the end of the step (a stage that
  finishes its backwards early waits there for the slowest peer of its reductions; DeepSpeed's
  ordinary engine, one stage, reduces in the last backward instead, where its ranks time them);
- optimizer: the optimizer step (with ZeRO, its gather of the updated parameters; the gradient
  norm's collective waits for the slowest rank too).
- checkpoint copy: the optimizer step's wait for a checkpoint's copies to host memory, which on a
  GPU overlap the step after the checkpoint (`runtime.engines.executor.wait_for_snapshot`). The
  planner prices a step without checkpoints (predicted 0); measured, it is the mean over the steps,
  so that a checkpoint every k steps shows as its wait over k.

`simulated_phases` times a candidate's schedule under its cost table (`plan.simulate`): the waits
are what the step leaves besides the rank's compute, reductions and optimizer. `measured_phases` reads what
each rank records every step (`RankTiming`, timed around DeepSpeed's instructions by
`runtime.engines.executor`): medians over the steps of one layout after its first, and over the ranks of a
stage; what no phase covers (loading micro-batches, the engine's bookkeeping) is kept apart.
`pipectl status` shows both (`report.phase_table`); `pipectl calibrate` fits the profile's engine terms
to them (`profile.calibrate`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipectl.artifacts.cluster import ClusterSpec
from pipectl.artifacts.plan import Candidate
from pipectl.artifacts.profile import ModelProfile
from pipectl.artifacts.run import StepMetrics
from pipectl.plan.cost_table import stage_costs_for
from pipectl.plan.simulate import simulate
from pipectl.schedule import generate
from pipectl.schedule.ir import ActionKind

CHECKPOINT_COPY = "checkpoint copy"  # priced 0: the plan's step has no checkpoint
PHASES = ("forward", "backward", "pipeline waits", "gradient reductions", "optimizer", CHECKPOINT_COPY)
Phases = tuple[float, float, float, float, float, float]


def simulated_phases(
    candidate: Candidate, profile: ModelProfile, cluster: ClusterSpec, kind_profiles: Sequence[ModelProfile] = ()
) -> tuple[list[Phases], float]:
    """Per stage of `candidate` (one chunk per rank): the simulated seconds of each phase, and the step."""
    costs = stage_costs_for(candidate, profile, cluster, kind_profiles)
    schedule = generate(
        candidate.schedule, candidate.pipeline_parallel, candidate.micro_batches, candidate.chunks, candidate.recompute
    )
    timeline = simulate(schedule, costs)
    phases = []
    for rank in range(candidate.pipeline_parallel):
        seconds = dict.fromkeys(ActionKind, 0.0)
        for record in timeline.rank_records(rank):
            seconds[record.action.kind] += record.end - record.start
        forward = seconds[ActionKind.FORWARD] + seconds[ActionKind.RECOMPUTE]
        backward = (  # a split backward's I and W are its backward phase
            seconds[ActionKind.BACKWARD] + seconds[ActionKind.BACKWARD_INPUT] + seconds[ActionKind.BACKWARD_WEIGHT]
        )
        reductions, optimizer = seconds[ActionKind.ALL_REDUCE], seconds[ActionKind.OPTIMIZER_STEP]
        waits = timeline.step_seconds - forward - backward - reductions - optimizer
        waits = waits if waits > 1e-9 * timeline.step_seconds else 0.0
        phases.append((forward, backward, waits, reductions, optimizer, 0.0))
    return phases, timeline.step_seconds


@dataclass(frozen=True)
class MeasuredPhases:
    """Medians of one layout's steps after its first (the checkpoint copy: their mean): per stage,
    each phase (None: not recorded, by a run of an older pipectl) and the time no phase covers; per
    stage the end of the step less a checkpoint's wait (reductions and optimizer step together, as
    recorded before the two were timed apart); and the step."""

    stages: dict[int, tuple[tuple[float | None, ...], float | None]]
    steps: tuple[int, int]  # the first and last step counted
    step_seconds: float
    end_of_step: dict[int, float | None] = field(default_factory=dict)
    count: int = 0  # how many steps: fewer than the range holds when another layout ran between


def _median(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else statistics.median(values)


def _mean(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else statistics.fmean(values)


def steady_steps(metrics: Sequence[StepMetrics], layout: str) -> list[StepMetrics]:
    """The steps of `layout` but the first of each start, which warms up (allocator, lazy
    initialisation): a start begins the run, follows a step of another layout (a resize), or goes
    back to a step already trained (a resume from an older checkpoint).

        >>> from pipectl.artifacts.run import StepMetrics
        >>> rows = [StepMetrics(step=s, loss=1.0, step_seconds=1.0, samples_per_second=1.0, global_batch=1,
        ...                     world_size=1, layout=layout) for s, layout in [(1, "a"), (2, "a"), (3, "b"), (4, "a"), (5, "a")]]
        >>> [m.step for m in steady_steps(rows, "a")]
        [2, 5]
    """
    steady, previous = [], None
    for row in metrics:
        starts = previous is None or row.layout != previous.layout or row.step <= previous.step
        if row.layout == layout and not starts:
            steady.append(row)
        previous = row
    return steady


def measured_phases(metrics: Sequence[StepMetrics], layout: str) -> MeasuredPhases | None:
    """The medians of the steps of `layout` but each start's first (`steady_steps`); None without any."""
    steps = [m for m in steady_steps(metrics, layout) if m.ranks]
    if not steps:
        return None
    rows: dict[int, list[tuple]] = {}
    for step in steps:
        for rank in step.ranks:
            end, optimizer, checkpoint = rank.end_of_step_seconds, rank.optimizer_seconds, rank.checkpoint_seconds
            reductions = None if end is None or optimizer is None else max(0.0, end - optimizer - (checkpoint or 0.0))
            phases = (rank.forward_seconds, rank.backward_seconds, rank.p2p_seconds, reductions, optimizer, checkpoint)
            covered = (rank.forward_seconds, rank.backward_seconds, rank.p2p_seconds, end)  # end holds the checkpoint's
            left = step.step_seconds - sum(covered) if None not in covered else None
            # The end of the step as the planner prices it: without a checkpoint's wait.
            priced_end = None if end is None else end - (checkpoint or 0.0)
            rows.setdefault(rank.stage, []).append((*phases, left, priced_end))
    count = len(PHASES)
    average = [_mean if phase == CHECKPOINT_COPY else _median for phase in PHASES]
    stages = {
        stage: (tuple(average[k]([row[k] for row in values]) for k in range(count)), _median([row[count] for row in values]))
        for stage, values in sorted(rows.items())
    }
    ends = {stage: _median([row[count + 1] for row in values]) for stage, values in sorted(rows.items())}
    step_seconds = statistics.median(m.step_seconds for m in steps)
    return MeasuredPhases(stages, (steps[0].step, steps[-1].step), step_seconds, ends, len(steps))
