"""The run directory `runs/NAME/`: create it (never clobbering a run by accident) and read it back.

    runs/NAME/plan.json  job.json  ds_config.json  launch.sh  [hostfile | job.sbatch]
             metrics.jsonl  checkpoints/  schedule_rank{R}.txt  logs/

An existing run is only touched with `resume=True` (its checkpoints and metrics are kept and the
worker continues from the newest verified checkpoint) or `force=True` (it is deleted first).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipectl.artifacts.plan import Plan
from pipectl.artifacts.run import (
    CHECKPOINTS_DIR,
    DS_CONFIG_FILE,
    JOB_FILE,
    LAUNCH_SCRIPT,
    LOGS_DIR,
    PLAN_FILE,
    JobSpec,
    StepMetrics,
)
from pipectl.errors import UserInputError
from pipectl.io import load_model, read_mapping, write_json_atomic
from pipectl.launch.engines import LaunchCommand, launch_script
from pipectl.planfile import copy_plan
from pipectl.runtime.checkpoint import list_checkpoints
from pipectl.runtime.metrics import PredictionSummary, prediction_summary, read_metrics


@dataclass(frozen=True)
class RunFiles:
    """A run directory's inputs, read back and validated."""

    path: Path
    job: JobSpec
    plan: Plan
    ds_config: dict[str, Any]


def is_run_dir(path: Path) -> bool:
    return (path / JOB_FILE).is_file()


def prepare_run_dir(run_dir: str | os.PathLike[str], *, resume: bool = False, force: bool = False) -> Path:
    """Make `run_dir` ready for a new launch; refuse to clobber an existing run.

    - absent or empty: created;
    - an existing run + `force`: deleted and re-created;
    - an existing run + `resume`: kept (checkpoints and metrics stay);
    - an existing run otherwise, or a non-empty folder that is not a run: `UserInputError`.
    """
    path = Path(run_dir)
    if resume and force:
        raise UserInputError("--resume and --force contradict each other: keep the run, or start over")
    if path.exists() and not path.is_dir():
        raise UserInputError(f"run directory {path} is a file")
    if path.is_dir() and any(path.iterdir()):
        if not is_run_dir(path):
            if resume:
                raise UserInputError(f"cannot resume {path}: it holds no {JOB_FILE}")
            raise UserInputError(
                f"{path} is not empty and is not a pipectl run; refusing to write into it",
                hint="choose another --run-dir",
            )
        if force:
            shutil.rmtree(path)
        elif not resume:
            raise UserInputError(
                f"run directory {path} already exists",
                hint=f"continue it with --resume, start over with --force, or see `pipectl status {path}`",
            )
    elif resume:
        raise UserInputError(f"cannot resume {path}: no such run")
    path.mkdir(parents=True, exist_ok=True)
    (path / LOGS_DIR).mkdir(exist_ok=True)
    (path / CHECKPOINTS_DIR).mkdir(exist_ok=True)
    return path


def write_run_files(
    run_dir: Path,
    *,
    plan: Plan,
    job: JobSpec,
    ds_config: dict[str, Any],
    command: LaunchCommand,
    plan_dir: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """plan.json with its profile copy (taken from `plan_dir`, default the run directory itself),
    job.json, ds_config.json, launch.sh and the engine's side files."""
    written = [
        copy_plan(plan, run_dir if plan_dir is None else plan_dir, run_dir / PLAN_FILE),
        write_json_atomic(run_dir / JOB_FILE, job),
        write_json_atomic(run_dir / DS_CONFIG_FILE, ds_config),
    ]
    script = run_dir / LAUNCH_SCRIPT
    script.write_text(launch_script(command, run_dir))
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    written.append(script)
    for name, content in command.files.items():
        target = run_dir / name
        target.write_text(content)
        written.append(target)
    return written


def read_run(run_dir: str | os.PathLike[str]) -> RunFiles:
    """job.json + plan.json + ds_config.json of a run, validated (errors name the file)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise UserInputError(f"no run directory at {path}")
    if not is_run_dir(path):
        raise UserInputError(f"{path} is not a pipectl run (no {JOB_FILE})", hint="start one with pipectl launch")
    job = load_model(JobSpec, path / JOB_FILE)
    plan = load_model(Plan, path / job.plan_file)
    ds_config = read_mapping(path / job.ds_config_file)
    return RunFiles(path, job, plan, ds_config)


def schedule_files(run_dir: Path) -> dict[int, Path]:
    """schedule_rank{R}.txt files the ranks wrote, by rank."""
    found = {}
    for path in run_dir.glob("schedule_rank*.txt"):
        suffix = path.stem.removeprefix("schedule_rank")
        if suffix.isdigit():
            found[int(suffix)] = path
    return dict(sorted(found.items()))


def ds_config_text(ds_config: dict[str, Any]) -> str:
    return json.dumps(ds_config, indent=2)


@dataclass(frozen=True)
class CheckpointStatus:
    tag: str
    step: int | None
    verified: bool  # manifest present and every file present (hashes: `pipectl status --verify`)
    bytes: int
    problems: tuple[str, ...]


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

    @property
    def steps_done(self) -> int:
        return self.metrics[-1].step if self.metrics else 0

    @property
    def last_loss(self) -> float | None:
        return self.metrics[-1].loss if self.metrics else None

    @property
    def finished(self) -> bool:
        return self.steps_done >= self.job.steps

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (`pipectl status --json`)."""
        return {
            "run_dir": str(self.path),
            "model": self.job.model,
            "engine": self.job.engine.value,
            "steps_done": self.steps_done,
            "steps": self.job.steps,
            "finished": self.finished,
            "last_loss": self.last_loss,
            "first_loss": self.metrics[0].loss if self.metrics else None,
            "samples_per_second": self.metrics[-1].samples_per_second if self.metrics else None,
            "layouts": self.layouts,
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
        }


def run_status(run_dir: str | os.PathLike[str], *, verify_hashes: bool = False) -> RunStatus:
    """Read a run's job, plan, metrics and checkpoints (hashing every file only if asked)."""
    files = read_run(run_dir)
    metrics = read_metrics(files.path)
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
        prediction=prediction_summary(metrics),
        checkpoints=checkpoints,
        layouts=layouts,
    )
