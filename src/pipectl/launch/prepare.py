"""The run directory `runs/NAME/` made ready for a launch, never clobbering a run by accident, and
read back with its stored options checked.

    runs/NAME/plan.json  job.json  ds_config.json  launch.sh  [hostfile | job.sbatch]
             metrics.jsonl  checkpoints/  schedule_rank{R}.txt  logs/

An existing run is only touched with `resume=True` (its checkpoints and metrics are kept and the
worker continues from the newest verified checkpoint) or `force=True` (it is deleted first).

The lock that keeps one job per run directory is `rundir.lock`.
"""

from __future__ import annotations

import json
import os
import shutil
from shlex import quote
from pathlib import Path
from typing import Any

from pipectl.artifacts.plan import Plan
from pipectl.artifacts.run import (
    CHECKPOINTS_DIR,
    DS_CONFIG_FILE,
    JOB_FILE,
    LAUNCH_SCRIPT,
    LOCK_FILE,
    LOGS_DIR,
    PLAN_FILE,
    JobSpec,
    run_holding,
)
from pipectl.errors import PipectlError, UserInputError
from pipectl.io import artifact_kind, file_kind, nearest_existing_parent, read_mapping, write_json_atomic, write_text_atomic
from pipectl.launch.engines import LaunchCommand, launch_script
from pipectl.planfile import copy_plan
from pipectl.launch.options import check_stored_options
from pipectl.rundir.checkpoints import list_checkpoints
from pipectl.rundir.metrics import read_metrics
from pipectl.rundir.run import RunFiles, check_name_lengths, is_run_dir, read_run_files, runs_inside_hint
from pipectl.words import count


def prepare_run_dir(run_dir: str | os.PathLike[str], *, resume: bool = False, force: bool = False) -> Path:
    """Make `run_dir` ready for a new launch; refuse to clobber an existing run.

    - absent or empty: created;
    - an existing run + `force`: emptied (the lock file stays: take it first, `lock_run_dir`);
    - an existing run + `resume`: kept (checkpoints and metrics stay);
    - an existing run otherwise, or a non-empty folder that is not a run: `UserInputError`
      (`check_run_dir`, which a dry run asks alone).
    """
    path = check_run_dir(run_dir, resume=resume, force=force)
    if force and is_run_dir(path):  # everything but the lock, which the caller holds (`lock_run_dir`)
        for entry in path.iterdir():
            if entry.name == LOCK_FILE:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    path.mkdir(parents=True, exist_ok=True)
    (path / LOGS_DIR).mkdir(exist_ok=True)
    (path / CHECKPOINTS_DIR).mkdir(exist_ok=True)
    return path


def forced_away(run_dir: Path) -> str | None:
    """What `--force` deletes in `run_dir`, in words: 'runs/x (12 steps trained, 3 checkpoints, the
    newest at step 12)'; None when no run is there."""
    if not is_run_dir(run_dir):
        return None
    metrics = read_metrics(run_dir)
    kept = [info for info in list_checkpoints(run_dir) if info.verified]
    newest = f", the newest at step {kept[-1].step}" if kept and kept[-1].step is not None else ""
    trained = max((m.step for m in metrics), default=0)
    return f"{run_dir} ({count(trained, 'step')} trained, {count(len(kept), 'checkpoint')}{newest})"


def check_run_dir(run_dir: str | os.PathLike[str], *, resume: bool = False, force: bool = False) -> Path:
    """What `prepare_run_dir` refuses, refused without touching anything (see there)."""
    path = Path(run_dir)
    check_name_lengths(path)
    if resume and force:
        raise UserInputError("--resume and --force contradict each other: keep the run, or start over")
    if path.exists() and not path.is_dir():
        raise UserInputError(f"run directory {path} is a file")
    inside = run_holding(path)
    if inside is not None:  # its files would read as the outer run's, and --force of that one deletes it
        raise UserInputError(f"run directory {path} lies inside the run in {inside}", hint="choose a folder outside it")
    above = nearest_existing_parent(path)
    if not path.exists() and above is not None and not (above.is_dir() and os.access(above, os.W_OK | os.X_OK)):
        # A dry run creates nothing: what would stop the launch from creating it is said now.
        why = "is not a folder" if not above.is_dir() else "is not writable"
        raise UserInputError(f"cannot create run directory {path}: {above} {why}", hint="choose another --run-dir")
    if path.is_dir() and any(entry.name != LOCK_FILE for entry in path.iterdir()):
        if not is_run_dir(path):
            if resume:
                raise UserInputError(f"cannot resume {path}: it holds no {JOB_FILE}", hint=runs_inside_hint(path))
            raise UserInputError(
                f"{path} is not empty and is not a pipectl run; refusing to write into it",
                hint="choose another --run-dir",
            )
        if force:  # it deletes the folder: only a run's, not any folder that holds a file of that name
            try:  # a run's job.json by its keys (one another version wrote may not validate here)
                is_job = artifact_kind(read_mapping(path / JOB_FILE)) == JobSpec.__name__
            except PipectlError:
                is_job = False
            if not is_job:
                what = file_kind(path / JOB_FILE) or "not a run's"
                raise UserInputError(f"--force deletes a pipectl run, and {path} is not one: its {JOB_FILE} is {what}",
                                     hint="choose another --run-dir, or delete the folder yourself")
        if not force and not resume:
            from pipectl.rundir.status import run_status

            status = run_status(path)
            if status.finished:
                go_on = f"it trained all its {status.job.steps} steps: train on with --resume --steps N (a larger total), "
            elif status.checkpointed_step:
                go_on = "continue it with --resume, "
            else:  # --resume would be refused: nothing to resume from
                go_on = "it has no checkpoint to resume from: "
            raise UserInputError(
                f"run directory {path} already exists",
                hint=f"{go_on}start over with --force, or see `pipectl status {quote(str(path))}`",
            )
    elif resume:
        raise UserInputError(f"cannot resume {path}: no such run")
    return path


def run_files(plan: Plan, job: JobSpec, ds_config: dict[str, Any], command: LaunchCommand, run_dir: Path) -> dict[str, str]:
    """What `write_run_files` writes besides the plan and profile copies, name -> text (a dry run
    prints them): job.json, ds_config.json, launch.sh and the engine's side files (job.sbatch,
    hostfile, .deepspeed_env)."""
    return {
        JOB_FILE: job.model_dump_json(indent=2) + "\n",
        DS_CONFIG_FILE: json.dumps(ds_config, indent=2) + "\n",
        LAUNCH_SCRIPT: launch_script(command, run_dir),
        **command.files,
    }


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
    texts = run_files(plan, job, ds_config, command, run_dir)
    for name in [LAUNCH_SCRIPT, *command.files]:
        # Atomically: a resize by restart rewrites them while the old job's batch shell may
        # still be reading launch.sh (bash reads a script as it runs it).
        written.append(write_text_atomic(run_dir / name, texts[name], executable=name == LAUNCH_SCRIPT))
    return written


def ds_config_text(ds_config: dict[str, Any]) -> str:
    return json.dumps(ds_config, indent=2)


def read_run(run_dir: str | os.PathLike[str]) -> RunFiles:
    """`rundir.run.read_run_files`, and the run's stored options (job.json's `options`) checked as a
    resume or a resize would take them back: a value this version refuses is named with its key."""
    files = read_run_files(run_dir)
    if files.job.options:
        check_stored_options(files.job.options, files.path / JOB_FILE)
    return files
