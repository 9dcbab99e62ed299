"""One analysis of a run, read from its directory once: `analyse(run_dir) -> RunReport`.

`pipectl status` prints it whole; `launch`, `resize` and `status --follow` print its summary
(`detail=False`). Each file is read once per analysis: metrics.jsonl (with logs/ranks.jsonl) by
`rundir.status.run_status`, the profile copy beside the run's plan once for the utilisation, the
host note and the phases, the morph history with the metrics already read. Rendering is
`report.run_tables`; nothing here draws.

The predicted side is what the plan recorded: its chosen candidate, simulated phase by phase from
the profiles and the cluster the plan was made with (`plan.phases`), never a new search.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from pipectl.artifacts.layout import layout_label
from pipectl.artifacts.morph import MorphRecord
from pipectl.artifacts.profile import ModelProfile
from pipectl.artifacts.run import RankFailure
from pipectl.cluster import busier_note, plan_cluster_spec, plan_files_changed
from pipectl.errors import PipectlError
from pipectl.plan.flops import PRECISION_DTYPE, Utilisation, plan_layer_flops, utilisation
from pipectl.plan.phases import CHECKPOINT_COPY, PHASES, measured_phases, simulated_phases
from pipectl.planfile import load_kind_profiles, load_plan_profile
from pipectl.rundir.failures import read_failures
from pipectl.rundir.heartbeats import job_started_unix
from pipectl.rundir.metrics import MemorySummary, memory_summary
from pipectl.rundir.morph_history import read_history
from pipectl.rundir.status import RunStatus, run_status
from pipectl.rundir.stragglers import StragglerReport, find_stragglers


@dataclass(frozen=True)
class RunUtilisation:
    """MFU and HFU of the run's layout (the run's plan's chosen candidate): predicted from its
    predicted step, measured from the median step time of its metrics lines (the first, warm-up,
    line left out, as for the step-time comparison)."""

    layout: str
    steps: int  # measured steps the median is over (0: none yet)
    predicted: Utilisation
    measured: Utilisation | None

    def to_dict(self) -> dict:
        return {
            "layout": self.layout,
            "steps_measured": self.steps,
            "predicted": self.predicted.to_dict(),
            "measured": None if self.measured is None else self.measured.to_dict(),
        }


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
        """The phase whose measured time differs most from its prediction, in seconds; not the
        checkpoint copy, which the plan prices at 0 by design (a step without a checkpoint)."""
        gaps = [abs(m - p) if m is not None and phase != CHECKPOINT_COPY else -1.0
                for phase, p, m in zip(PHASES, self.predicted, self.measured)]  # fmt: skip
        return PHASES[gaps.index(max(gaps))]


@dataclass(frozen=True)
class PhaseComparison:
    """Where a run's step goes, predicted against measured, per pipeline stage; the phase whose
    measured time is furthest from its prediction is the term to look at first (a wrong layer
    time, a wrong link or bubble, a wrong optimizer or all-reduce cost)."""

    stages: list[StagePhases]
    steps: tuple[int, int]  # the first and last step measured
    layout: str
    count: int = 0  # the steps measured: fewer than the range holds when another layout ran between
    # The plan's cluster or calibration files edited since planning: the prediction prices them as they are now.
    changed: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "layout": self.layout,
            "steps": list(self.steps),
            "steps_counted": self.count,
            "files_changed_since_planning": list(self.changed),
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


@dataclass(frozen=True)
class RunReport:
    """Everything `pipectl status` says of a run. Without detail (`analyse(detail=False)`), the
    memory, phases, morph history and stragglers are left out (None, empty)."""

    status: RunStatus  # progress, metrics, checkpoints, heartbeats, requeues
    utilisation: RunUtilisation
    host_note: str | None  # the host is much busier or quieter than when the profile was measured
    memory: MemorySummary | None = None
    phases: PhaseComparison | None = None
    phases_unavailable: str | None = None  # why there is no phase comparison
    morphs: list[MorphRecord] = field(default_factory=list)
    stragglers: StragglerReport | None = None
    failures: list[RankFailure] = field(default_factory=list)  # an interrupted run's last start's, first first

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (`pipectl status --json`)."""
        return {
            **self.status.to_dict(),
            "memory": None if self.memory is None else self.memory.to_dict(),
            "flops": self.utilisation.to_dict(),
            "morphs": [record.model_dump(mode="json") for record in self.morphs],
            "phases": self.phases.to_dict() if self.phases is not None else {"unavailable": self.phases_unavailable},
        }


def analyse(run_dir: str | os.PathLike[str], *, verify_hashes: bool = False, detail: bool = True) -> RunReport:
    """Read the run once and say what it shows (hashing every checkpoint file only if asked)."""
    status = run_status(run_dir, verify_hashes=verify_hashes)
    try:
        profile: ModelProfile | None = load_plan_profile(status.path / status.job.plan_file, status.plan)
    except PipectlError:
        profile = None
    report = RunReport(
        status=status,
        utilisation=run_utilisation(status, profile),
        host_note=None if profile is None or status.prediction is None else busier_note(profile.host, status.job.host_at_launch),
    )
    if not detail:
        return report
    comparison, unavailable = phase_comparison(status, profile)
    return replace(
        report,
        memory=run_memory(status),
        phases=comparison,
        phases_unavailable=unavailable,
        morphs=read_history(status.path, metrics=status.metrics),
        stragglers=find_stragglers(status.metrics),
        failures=_last_start_failures(status),
    )


def _last_start_failures(status: RunStatus) -> list[RankFailure]:
    """The ranks' failure records of the job's last start, for a run no rank runs that did not
    stop at a checkpoint (killed, or failed): what ended it, as `launch` said at the time."""
    if status.state != "interrupted":
        return []
    started = job_started_unix(status.heartbeats, status.job.world_size)
    return read_failures(status.path, since_unix=started - 1.0 if started is not None else 0.0)


def run_utilisation(status: RunStatus, profile: ModelProfile | None) -> RunUtilisation:
    """Predicted and measured MFU/HFU, in the run's precision (job.json) against the catalog's peak
    of its devices (`plan.flops`); model FLOPs from the model's shape, else the run's profile copy."""
    plan, candidate = status.plan, status.plan.chosen
    flops = plan_layer_flops(plan)
    if flops is None and plan.profile is not None and profile is not None:
        flops = plan_layer_flops(plan, profile)
    dtype = PRECISION_DTYPE[status.job.precision.value]
    label = layout_label(candidate)
    lines = [m for m in status.metrics if m.layout == label]
    if not lines and not any(m.layout for m in status.metrics):
        lines = list(status.metrics)  # lines written before layouts were recorded
    measured_seconds = [m.step_seconds for m in lines[1:] if m.step_seconds > 0]
    batch = plan.global_batch
    measured = None
    if measured_seconds:
        measured = utilisation(candidate, flops, dtype, statistics.median(measured_seconds), global_batch=batch)
    predicted = utilisation(candidate, flops, dtype, global_batch=batch)
    return RunUtilisation(label, len(measured_seconds), predicted, measured)


def run_memory(status: RunStatus) -> MemorySummary | None:
    """Predicted vs measured memory of the run's last layout (the plan's figure if the metrics
    lines predate recording it and the layout is the plan's own)."""
    if not status.metrics:
        return None
    chosen = status.plan.chosen
    fallback = chosen.peak_memory_bytes if status.metrics[-1].layout == layout_label(chosen) else None
    return memory_summary(status.metrics, fallback)


def phase_comparison(status: RunStatus, profile: ModelProfile | None = None) -> tuple[PhaseComparison | None, str | None]:
    """The comparison for the run's current layout, or None and the reason there is none."""
    chosen = status.plan.chosen
    label = layout_label(chosen)
    if chosen.chunks != 1:
        return None, "the layout runs several chunks per rank: phases are compared per stage of one chunk"
    if len(set(chosen.replica_kinds)) > 1:
        return None, "the layout splits its replicas over device kinds: phases are compared for layouts of one kind"
    measured = measured_phases(status.metrics, label)
    if measured is None:
        if sum(m.layout == label for m in status.metrics) >= 2:  # the steps are there, their ranks' detail not
            return None, f"no phases per rank recorded for the steps of {label} (logs/ranks.jsonl missing?)"
        return None, f"phases are compared after two steps of {label}"
    try:
        if profile is None:  # not readable: the error names the file
            profile = load_plan_profile(status.path / status.job.plan_file, status.plan)
        kinds = load_kind_profiles(status.path / status.job.plan_file, status.plan)
        predicted, _ = simulated_phases(chosen, profile, plan_cluster_spec(status.plan), kinds)
    except PipectlError as exc:
        return None, f"no prediction per phase: {exc.message}"
    stages = [
        StagePhases(stage, predicted[stage], phases, unaccounted)
        for stage, (phases, unaccounted) in measured.stages.items()
        if stage < len(predicted)
    ]
    return PhaseComparison(stages, measured.steps, label, measured.count, tuple(plan_files_changed(status.plan))), None
