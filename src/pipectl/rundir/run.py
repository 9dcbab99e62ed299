"""A run directory `runs/NAME/` read back: its job, plan and DeepSpeed config, the schedules the
ranks wrote, its Slurm requeues, and the checks a resume or resize makes before training more.

    runs/NAME/plan.json  job.json  ds_config.json  launch.sh  [hostfile | job.sbatch]
             metrics.jsonl  checkpoints/  schedule_rank{R}.txt  logs/

Writing a new run directory (never clobbering one) is `launch.prepare`; the one-job-at-a-time lock
is `rundir.lock`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from shlex import quote
from typing import Any

from pipectl.artifacts.plan import Plan
from pipectl.artifacts.run import (
    JOB_FILE,
    LOGS_DIR,
    JobSpec,
    REQUEUE_FILE,
    RequeueRecord,
    StepMetrics,
)
from pipectl.errors import UserInputError
from pipectl.io import file_kind, load_model, read_mapping, read_records
from pipectl.rundir.checkpoints import CheckpointInfo, list_checkpoints
from pipectl.rundir.metrics import read_metrics
from pipectl.words import count


@dataclass(frozen=True)
class RunFiles:
    """A run directory's inputs, read back and validated."""

    path: Path
    job: JobSpec
    plan: Plan
    ds_config: dict[str, Any]



def runs_inside_hint(path: Path) -> str | None:
    """'give a run it holds (2 runs): runs/a, runs/b' for a folder of runs given as a run (`runs`
    for `runs/mine`); None for a folder holding none."""
    inside = sorted(child for child in path.iterdir() if child.is_dir() and is_run_dir(child)) if path.is_dir() else []
    if not inside:
        return None
    shown = ", ".join(quote(str(run)) for run in inside[:3]) + (", …" if len(inside) > 3 else "")
    return f"give a run it holds ({count(len(inside), 'run')}): {shown}"


def is_run_dir(path: Path) -> bool:
    return (path / JOB_FILE).is_file()


def newest_complete_checkpoint(run_dir: Path) -> CheckpointInfo | None:
    """The newest checkpoint with a manifest and all its files (`CheckpointInfo`), or None.

    Only presence is checked here: hashing a large model's checkpoint takes long, and the ranks
    verify every sha256 when they load it anyway (falling back to an older one if it is corrupted).
    """
    complete = [info for info in list_checkpoints(run_dir, hash_files=False) if info.verified]
    return complete[-1] if complete else None


def newest_checkpoint_step(run_dir: Path) -> int:
    """The step of the newest complete checkpoint, 0 without one: where a resume starts (unless
    that checkpoint does not load)."""
    latest = newest_complete_checkpoint(run_dir)
    return latest.step if latest is not None and latest.step is not None else 0


def check_steps_beyond_trained(
    run_dir: Path, target_steps: int, more: int, *, given: bool = True, metrics: list[StepMetrics] | None = None
) -> None:
    """A new total of steps for a run must lie beyond what it has trained: its newest complete
    checkpoint's step or its last logged one, whichever is later (`more`: the hint's increment).
    The run's own total (`given` False) must lie beyond its newest checkpoint only: a run whose last
    checkpoints were lost trains their steps again. `metrics`: the run's, when the caller has read them."""
    metrics = read_metrics(run_dir) if metrics is None else metrics
    checkpointed = newest_checkpoint_step(run_dir)
    trained = max(checkpointed, metrics[-1].step if metrics else 0) if given else checkpointed
    if target_steps <= trained:
        raise UserInputError(
            f"--steps {target_steps} is not beyond the {trained} steps the run has already trained" if given
            else f"{run_dir} has trained all its {trained} steps: nothing is left to train",
            hint=f"pass a larger total, e.g. --steps {trained + more}",
        )


def read_run_files(run_dir: str | os.PathLike[str]) -> RunFiles:
    """job.json + plan.json + ds_config.json of a run, validated (errors name the file)."""
    path = check_run_given(run_dir)
    job = load_model(JobSpec, path / JOB_FILE)
    plan = load_model(Plan, path / job.plan_file)
    ds_config = read_mapping(path / job.ds_config_file)
    return RunFiles(path, job, plan, ds_config)


def check_run_given(run_dir: str | os.PathLike[str]) -> Path:
    """`run_dir` as a command was given it, refused unless it is a run directory: a file given in
    its place is named for what it is ("plan.json is a plan (pipectl plan), not a run directory"),
    a folder without job.json points at the runs inside it."""
    path = Path(run_dir)
    if path.is_file():
        raise UserInputError(f"{path} is {file_kind(path) or 'a file'}, not a run directory",
                             hint="give the folder pipectl launch --run-dir created (runs/NAME)")
    if not path.is_dir():
        raise UserInputError(
            f"no run directory at {path}",
            hint=f"pipectl launch PLAN --run-dir {quote(str(path))} writes one (`pipectl status --follow` waits for a run "
            "a launch is about to write)",
        )
    if not is_run_dir(path):
        raise UserInputError(f"{path} is not a pipectl run (no {JOB_FILE})",
                             hint=runs_inside_hint(path) or "start one with pipectl launch")
    return path


def schedule_files(run_dir: Path) -> dict[int, Path]:
    """schedule_rank{R}.txt files the ranks wrote, by rank."""
    found = {}
    for path in run_dir.glob("schedule_rank*.txt"):
        suffix = path.stem.removeprefix("schedule_rank")
        if suffix.isdigit():
            found[int(suffix)] = path
    return dict(sorted(found.items()))


def read_requeues(run_dir: str | os.PathLike[str]) -> list[RequeueRecord]:
    """The run's requeue records, oldest first (unreadable lines skipped)."""
    return read_records(RequeueRecord, Path(run_dir) / LOGS_DIR / REQUEUE_FILE)


def check_name_lengths(path: Path) -> None:
    """Refuse a folder name the filesystem cannot hold, naming it, before anything is created."""
    missing = []
    existing = path.absolute()
    while not existing.exists() and existing != existing.parent:
        missing.append(existing.name)
        existing = existing.parent
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255  # what Linux's filesystems allow
    for name in reversed(missing):
        size = len(os.fsencode(name))
        if size > limit:
            shown = name if len(name) <= 40 else f"{name[:20]}…{name[-12:]}"
            raise UserInputError(
                f"run directory {shown!r}: the name is {size} bytes; the filesystem holding {existing} allows at most {limit}",
                hint="choose a shorter --run-dir",
            )


def make_run_folders(path: Path) -> None:
    """`path.mkdir(parents=True)`, taking back the folders it made when it fails (a refused
    launch leaves nothing behind); the failure is named as a `UserInputError`."""
    check_name_lengths(path)
    made: list[Path] = []
    try:
        for folder in reversed([path, *path.parents]):
            if not folder.exists():
                try:
                    folder.mkdir()
                except FileExistsError:
                    continue  # made meanwhile by another process: not ours to take back
                made.append(folder)
    except OSError as exc:
        for folder in reversed(made):
            try:
                folder.rmdir()
            except OSError:
                pass
        raise UserInputError(f"cannot create run directory {path}: {exc.strerror or exc}") from None
