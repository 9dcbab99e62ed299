"""Where a run's step goes, predicted against measured, per pipeline stage: `pipectl status`.

Predicted: the plan's candidate simulated again from the run's copies of its profiles and its
cluster (`plan.simulate`, as `pipectl simulate` does): per stage, the forward time (recomputes
included), the backward time, and the rest of the step (waiting in the pipeline's bubble, exposed
communication, the all-reduce and the optimizer step). Measured: what each rank's heartbeat
records every step (`RankTiming`: its forward and recompute time, its backward time), the rest
being the step time less those; medians over the steps of the current layout after its first, and
over the ranks of a stage. The phase whose measured time is furthest from its prediction is the
term to look at first: a wrong layer time (compute), a wrong link (the rest), or both.
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

PHASES = ("forward", "backward", "rest of step")


@dataclass(frozen=True)
class StagePhases:
    """One stage's seconds per phase (`PHASES`), predicted and measured."""

    stage: int
    predicted: tuple[float, float, float]
    measured: tuple[float, float, float]

    @property
    def furthest(self) -> str:
        """The phase whose measured time differs most from its prediction, in seconds."""
        gaps = [abs(m - p) for p, m in zip(self.predicted, self.measured)]
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
                {"stage": s.stage, "predicted": dict(zip(PHASES, s.predicted)), "measured": dict(zip(PHASES, s.measured))}
                for s in self.stages
            ],
        }


def predicted_phases(status: RunStatus) -> list[tuple[float, float, float]]:
    """Per stage of the run's chosen candidate: simulated forward, backward and rest-of-step seconds."""
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
        records = timeline.rank_records(rank)
        forward = sum(r.end - r.start for r in records if r.action.kind in (ActionKind.FORWARD, ActionKind.RECOMPUTE))
        backward = sum(r.end - r.start for r in records if r.action.kind is ActionKind.BACKWARD)
        phases.append((forward, backward, timeline.step_seconds - forward - backward))
    return phases


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
    measured: dict[int, list[tuple[float, float, float]]] = {}
    for step in steps:
        for rank in step.ranks:
            rest = step.step_seconds - rank.forward_seconds - rank.backward_seconds
            measured.setdefault(rank.stage, []).append((rank.forward_seconds, rank.backward_seconds, rest))
    stages = [
        StagePhases(stage, predicted[stage], tuple(statistics.median(v[k] for v in values) for k in range(3)))
        for stage, values in sorted(measured.items())
        if stage < len(predicted)
    ]
    return PhaseComparison(stages, (steps[0].step, steps[-1].step), label), None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def phase_table(comparison: PhaseComparison) -> Table:
    """Per stage: each phase predicted / measured in ms, and the phase furthest from its prediction."""
    table = Table(
        title=f"where the step goes, predicted / measured ms (medians over steps {comparison.steps[0]}-{comparison.steps[1]})",
        box=box.SIMPLE,
        title_justify="left",
    )
    table.add_column("stage", justify="right")
    for phase in PHASES:
        table.add_column(phase, justify="right")
    table.add_column("furthest from its prediction")
    for s in comparison.stages:
        cells = [f"{_ms(p)} / {_ms(m)}" for p, m in zip(s.predicted, s.measured)]
        table.add_row(str(s.stage), *cells, s.furthest)
    table.caption = "rest of step: the bubble, exposed communication, all-reduce and optimizer step"
    return table
