"""Where a run's step goes, predicted against measured, per pipeline stage: `pipectl status`.

The phases and how each side is obtained are `plan.phases`'s; here the prediction is the run's
candidate simulated again from the run's own copies of its profiles and its cluster, and the phase
whose measured time is furthest from its prediction is named: the term to look at first (a wrong
layer time, a wrong link or bubble, a wrong optimizer or all-reduce cost).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich import box
from rich.table import Table

from pipectl.artifacts.layout import layout_label
from pipectl.cluster import plan_cluster_spec
from pipectl.errors import PipectlError
from pipectl.rundir.status import RunStatus
from pipectl.plan.phases import PHASES, measured_phases, simulated_phases
from pipectl.planfile import load_kind_profiles, load_plan_profile


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
    plan = status.plan
    plan_path = status.path / status.job.plan_file
    phases, _ = simulated_phases(
        plan.chosen, load_plan_profile(plan_path, plan), plan_cluster_spec(plan), load_kind_profiles(plan_path, plan)
    )
    return phases


def phase_comparison(status: RunStatus) -> tuple[PhaseComparison | None, str | None]:
    """The comparison for the run's current layout, or None and the reason there is none."""
    label = layout_label(status.plan.chosen)
    if status.plan.chosen.chunks != 1:
        return None, "the layout runs several chunks per rank: phases are compared per stage of one chunk"
    if len(set(status.plan.chosen.replica_kinds)) > 1:
        return None, "the layout splits its replicas over device kinds: phases are compared for layouts of one kind"
    measured = measured_phases(status.metrics, label)
    if measured is None:
        return None, f"phases are compared after two steps of {label}"
    try:
        predicted = predicted_phases(status)
    except PipectlError as exc:
        return None, f"no prediction per phase: {exc.message}"
    stages = [
        StagePhases(stage, predicted[stage], phases, unaccounted)
        for stage, (phases, unaccounted) in measured.stages.items()
        if stage < len(predicted)
    ]
    return PhaseComparison(stages, measured.steps, label), None


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
