"""Where a run stands, read from its directory alone: progress, last loss, predicted against measured
step time, checkpoints (verified, staged, their events), heartbeats, requeues, and whether a launch
holds the run now. `pipectl status`, `launch` and `resize` print it; nothing here imports torch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipectl.artifacts.plan import Plan
from pipectl.artifacts.run import (
    CheckpointEvent,
    CheckpointOutcome,
    JobSpec,
    RankHeartbeat,
    RankState,
    RequeueOutcome,
    RequeueRecord,
    StepMetrics,
)
from pipectl.plan.phases import steady_steps
from pipectl.rundir.heartbeats import ENDED, live_ranks, pid_alive, process_state, current_heartbeats, stopped_cleanly
from pipectl.rundir.checkpoints import list_checkpoints, read_events, staging_leftovers
from pipectl.rundir.metrics import PredictionSummary, prediction_summary, read_metrics_and_unreadable
from pipectl.rundir.failures import read_failures
from pipectl.rundir.run import read_requeues, read_run_files
from pipectl.rundir.lock import lock_holder


@dataclass(frozen=True)
class CheckpointStatus:
    tag: str
    step: int | None
    verified: bool  # manifest present, every file present at its size (hashes: `pipectl status --verify`)
    bytes: int
    problems: tuple[str, ...]


FRESH_HEARTBEAT_SECONDS = 15.0  # a rank rewrites its heartbeat every second; older than this, it is gone or frozen


@dataclass(frozen=True)
class RunStatus:
    """Where a run stands: progress, last loss, prediction quality, checkpoints."""

    path: Path
    job: JobSpec
    plan: Plan
    metrics: list[StepMetrics]
    prediction: PredictionSummary | None
    checkpoints: list[CheckpointStatus]
    layouts: list[str]  # distinct layouts seen in metrics, in order (resizes show up here)
    staging: list[Path] = field(default_factory=list)  # checkpoints/.staging: saves running, or left by dead ones
    checkpoint_events: list[CheckpointEvent] = field(default_factory=list)  # logs/checkpoints.jsonl
    unreadable_metrics_lines: list[int] = field(default_factory=list)  # of metrics.jsonl, skipped
    heartbeats: dict[int, RankHeartbeat] = field(default_factory=dict)  # each rank's last, by rank
    requeues: list[RequeueRecord] = field(default_factory=list)  # logs/requeues.jsonl: a Slurm job's starts
    launching: bool = False  # a live `pipectl launch` (or resize) holds the run's lock
    failures_recorded: bool = False  # logs/ holds a rank's failure record (`rundir.failures`)
    read_unix: float = 0.0  # when this was read: heartbeats are fresh against it

    @property
    def ranks_beating(self) -> bool:
        """Some rank of the run is alive and training (its heartbeat, rewritten every second, is
        recent and says running): on this host or another, under any engine. A rank of this host
        whose process has ended is not, however recent its last beat (a job just killed)."""
        return any(
            process_state(beat) != ENDED
            for beat in live_ranks(self.heartbeats, self.read_unix, silent_after=FRESH_HEARTBEAT_SECONDS)
        )

    @property
    def active(self) -> bool:
        """The job runs or starts: its ranks beat, or its launch is alive."""
        return self.ranks_beating or self.launching

    @property
    def ever_started(self) -> bool:
        """Some rank of the job started (it beat, or failed), or Slurm started its job: a run that
        failed before its first step is interrupted, not one that never started."""
        return bool(self.heartbeats or self.requeues or self.failures_recorded)

    @property
    def requeue_count(self) -> int:
        return sum(r.outcome is RequeueOutcome.REQUEUED for r in self.requeues)

    @property
    def steps_done(self) -> int:
        """The last step trained: metrics.jsonl's last line, or a verified checkpoint's step where that
        is later (metrics.jsonl deleted or cut short: the checkpoint still holds the steps)."""
        return max(self.metrics[-1].step if self.metrics else 0, self.checkpointed_step)

    @property
    def checkpointed_step(self) -> int:
        """The step of the newest verified checkpoint (0: none)."""
        return max((c.step or 0 for c in self.checkpoints if c.verified), default=0)

    @property
    def last_loss(self) -> float | None:
        return self.metrics[-1].loss if self.metrics else None

    @property
    def trained(self) -> bool:
        """Every step trained (its final checkpoint may still be missing)."""
        return self.steps_done >= self.job.steps

    @property
    def stopped(self) -> tuple[int, str] | None:
        """(checkpoint step, why) when every rank of the job stopped early with the same checkpoint
        written (a signal, the stop file, its launching pipectl gone); None otherwise."""
        step = stopped_cleanly(self.heartbeats, self.job.world_size)
        beats = [b for b in self.heartbeats.values() if b.state is RankState.STOPPED]
        if step is None or not beats:
            return None
        # A rank told by the others says "another rank": the reason is the one that saw it first.
        return step, next((b.stop_reason for b in beats if b.stop_reason not in ("", "another rank")), "")

    @property
    def finished(self) -> bool:
        """Every step trained AND a verified checkpoint holds the last one."""
        return self.trained and any(c.verified and (c.step or 0) >= self.job.steps for c in self.checkpoints)

    @property
    def last_committed(self) -> CheckpointEvent | None:
        """The newest checkpoint event that committed (its stall, write time and size)."""
        return next((e for e in reversed(self.checkpoint_events) if e.outcome is CheckpointOutcome.COMMITTED), None)

    @property
    def checkpoint_problem(self) -> str | None:
        """Why the newest checkpoint attempt did not commit (failed or skipped), or None."""
        last = self.checkpoint_events[-1] if self.checkpoint_events else None
        return last.message if last is not None and last.outcome is not CheckpointOutcome.COMMITTED else None

    @property
    def state(self) -> str:
        """Where the run stands, one word (`status --json`; the table says it in words): finished,
        trained (every step, the last not in a checkpoint), stopped (at a checkpoint: a signal, a
        stop request), running, starting, not-started, or interrupted (no rank runs, and the run
        did not stop at a checkpoint: killed, or failed)."""
        if self.finished:
            return "finished"
        if self.trained:
            return "trained"
        if self.stopped is not None:
            return "stopped"
        if not self.metrics and not self.steps_done:
            return "starting" if self.active else "interrupted" if self.ever_started else "not-started"
        return "running" if self.active else "interrupted"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (`pipectl status --json`)."""
        return {
            "run_dir": str(Path(self.path).absolute()),  # as `launch --json` gives it, whatever the caller's folder
            "model": self.job.model,
            "engine": self.job.engine.value,
            "state": self.state,
            "steps_done": self.steps_done,
            "steps": self.job.steps,
            "finished": self.finished,
            "active": self.active,
            "trained": self.trained,
            "checkpoint_problem": self.checkpoint_problem,
            "last_checkpoint_stall_seconds": self.last_committed.stall_seconds if self.last_committed else None,
            "last_loss": self.last_loss,
            "first_loss": self.metrics[0].loss if self.metrics else None,
            "samples_per_second": self.metrics[-1].samples_per_second if self.metrics else None,
            "layouts": self.layouts,
            "unreadable_metrics_lines": self.unreadable_metrics_lines,
            "prediction": None if self.prediction is None else {
                "steps_compared": self.prediction.steps,
                "median_measured_step_seconds": self.prediction.median_measured_seconds,
                "median_predicted_step_seconds": self.prediction.median_predicted_seconds,
                "median_abs_error": self.prediction.median_abs_error,
                "max_abs_error": self.prediction.max_abs_error,
            },
            "checkpoints": [
                {"tag": c.tag, "step": c.step, "verified": c.verified, "bytes": c.bytes, "problems": list(c.problems)}
                for c in self.checkpoints
            ],
            "staging": [str(path) for path in self.staging],
            "slurm": None if not self.requeues else {
                "requeues": self.requeue_count,
                "last": self.requeues[-1].model_dump(mode="json"),
            },
        }


def run_status(run_dir: str | os.PathLike[str], *, verify_hashes: bool = False) -> RunStatus:
    """Read a run's job, plan, metrics and checkpoints (hashing every file only if asked)."""
    files = read_run_files(run_dir)
    metrics, unreadable = read_metrics_and_unreadable(files.path)
    layouts: list[str] = []
    for m in metrics:
        if m.layout and (not layouts or layouts[-1] != m.layout):
            layouts.append(m.layout)
    checkpoints = [
        CheckpointStatus(
            tag=info.tag,
            step=info.step,
            verified=info.verified,
            bytes=info.manifest.bytes if info.manifest else 0,
            problems=info.problems,
        )
        for info in list_checkpoints(files.path, hash_files=verify_hashes)
    ]
    return RunStatus(
        path=files.path,
        job=files.job,
        plan=files.plan,
        metrics=metrics,
        # The current layout's steps only (a resize changes the step and its prediction), but the
        # first of each start, which warms up.
        prediction=prediction_summary(steady_steps(metrics, layouts[-1] if layouts else ""), warmup_steps=0),
        checkpoints=checkpoints,
        layouts=layouts,
        staging=staging_leftovers(files.path),
        checkpoint_events=read_events(files.path),
        unreadable_metrics_lines=unreadable,
        heartbeats=current_heartbeats(files.path, files.job.world_size),
        requeues=read_requeues(files.path),
        failures_recorded=bool(read_failures(files.path)),
        launching=any(pid != os.getpid() and pid_alive(pid) for pid in lock_holder(files.path)),
        read_unix=time.time(),
    )
