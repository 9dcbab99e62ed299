"""Where a run's step goes, predicted against measured, per pipeline stage: `pipectl status`.

Four phases of a rank's step:

- forward: its forwards and recomputes;
- backward: its backwards;
- pipeline waits: its sends and receives, waiting for its peers included (the bubble and the
  transfers between stages);
- end of step: the tied and data-parallel gradient reductions and the optimizer step (a stage
  that finishes its backwards early waits there for the slowest peer of its reductions).

Predicted: the plan's candidate simulated again from the run's copies of its profiles and its
cluster (`plan.simulate`, as `pipectl simulate` does); the waits are what the step leaves besides
the rank's compute and its end of step. Measured: what each rank records every step
(`RankTiming`, timed around DeepSpeed's instructions by `runtime.executor`); medians over the
steps of the current layout after its first, and over the ranks of a stage. What the measured
phases do not cover (loading micro-batches, the engine's own bookkeeping) is shown apart. The
phase whose measured time is furthest from its prediction is the term to look at first: a wrong
layer time (compute), a wrong link or bubble (waits), a wrong optimizer or all-reduce cost.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from rich import box
from rich.table import Table

from pipectl.artifacts.layout import layout_label
from pipectl.cluster import load_cluster
from pipectl.errors import PipectlError
from pipectl.launch.rundir import RunStatus
from pipectl.plan.costs import stage_costs_for
from pipectl.plan.simulate import simulate
from pipectl.planfile import load_kind_profiles, load_plan_profile
from pipectl.schedule import generate
from pipectl.schedule.ir import ActionKind

PHASES = ("forward", "backward", "pipeline waits", "end of step")


@dataclass(frozen=True)
class StagePhases:
    """One stage's seconds per phase (`PHASES`), predicted and measured (None: not recorded, by a
    run of an older pipectl), and the measured time no phase covers."""

    stage: int
    predicted: tuple[float, ...]
    measured: tuple[float | None, ...]
    unaccounted: float | None = None

    @property
    def furthest(self) -> str:
        """The phase whose measured time differs most from its prediction, in seconds."""
        gaps = [abs(m - p) if m is not None else -1.0 for p, m in zip(self.predicted, self.measured)]
        return PHASES[gaps.index(max(gaps))]


@dataclass(frozen=True)
class PhaseComparison:
    stages: list[StagePhases]
    steps: tuple[int, int]  # the first and last step measured
    layout: str

    def to_dict(self) -> dict:
        return {
            "layout": self.layout,
            "steps": list(self.steps),
            "stages": [
                {
                    "stage": s.stage,
                    "predicted": dict(zip(PHASES, s.predicted)),
                    "measured": dict(zip(PHASES, s.measured)),
                    "unaccounted": s.unaccounted,
                    "furthest": s.furthest,
                }
                for s in self.stages
            ],
        }


def predicted_phases(status: RunStatus) -> list[tuple[float, float, float, float]]:
    """Per stage of the run's chosen candidate: simulated seconds of each phase (`PHASES`)."""
    plan, candidate = status.plan, status.plan.chosen
    plan_path = status.path / status.job.plan_file
    costs = stage_costs_for(
        candidate, load_plan_profile(plan_path, plan), load_cluster(plan.cluster), load_kind_profiles(plan_path, plan)
    )
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
        backward = seconds[ActionKind.BACKWARD]
        end = seconds[ActionKind.ALL_REDUCE] + seconds[ActionKind.OPTIMIZER_STEP]
        phases.append((forward, backward, timeline.step_seconds - forward - backward - end, end))
    return phases


def _median(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else statistics.median(values)


def phase_comparison(status: RunStatus) -> tuple[PhaseComparison | None, str | None]:
    """The comparison for the run's current layout, or None and the reason there is none."""
    label = layout_label(status.plan.chosen)
    steps = [m for m in status.metrics if m.layout == label and m.ranks]
    if status.plan.chosen.chunks != 1:
        return None, "the layout runs several chunks per rank: phases are compared per stage of one chunk"
    if len(steps) < 2:
        return None, f"phases are compared after two steps of {label}"
    steps = steps[1:]  # the first step of a layout warms up
    try:
        predicted = predicted_phases(status)
    except PipectlError as exc:
        return None, f"no prediction per phase: {exc.message}"
    measured: dict[int, list[tuple]] = {}
    for step in steps:
        for rank in step.ranks:
            phases = (rank.forward_seconds, rank.backward_seconds, rank.p2p_seconds, rank.end_of_step_seconds)
            known = sum(v for v in phases if v is not None)
            left = step.step_seconds - known if None not in phases else None
            measured.setdefault(rank.stage, []).append((*phases, left))
    stages = []
    for stage, rows in sorted(measured.items()):
        if stage < len(predicted):
            medians = [_median([row[k] for row in rows]) for k in range(5)]
            stages.append(StagePhases(stage, predicted[stage], tuple(medians[:4]), medians[4]))
    return PhaseComparison(stages, (steps[0].step, steps[-1].step), label), None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def phase_table(comparison: PhaseComparison) -> Table:
    """Per stage: each phase predicted / measured in ms, what no phase covers, and the phase
    furthest from its prediction."""
    table = Table(
        title=f"where the step goes, predicted / measured ms (medians over steps {comparison.steps[0]}-{comparison.steps[1]})",
        box=box.SIMPLE,
        title_justify="left",
    )
    table.add_column("stage", justify="right")
    for phase in PHASES:
        table.add_column(phase, justify="right")
    table.add_column("other", justify="right")
    table.add_column("furthest from its prediction")
    for s in comparison.stages:
        cells = [f"{_ms(p)} / {_ms(m) if m is not None else '-'}" for p, m in zip(s.predicted, s.measured)]
        other = _ms(s.unaccounted) if s.unaccounted is not None else "-"
        table.add_row(str(s.stage), *cells, other, s.furthest)
    table.caption = (
        "pipeline waits: sends and receives, waiting for peers included (bubble and transfers); end of step: "
        "gradient reductions and the optimizer; other: measured time no phase covers"
    )
    return table
