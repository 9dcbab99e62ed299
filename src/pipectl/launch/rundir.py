"""The run directory `runs/NAME/`: create it (never clobbering a run by accident) and read it back.

    runs/NAME/plan.json  job.json  ds_config.json  launch.sh  [hostfile | job.sbatch]
             metrics.jsonl  checkpoints/  schedule_rank{R}.txt  logs/

An existing run is only touched with `resume=True` (its checkpoints and metrics are kept and the
worker continues from the newest verified checkpoint) or `force=True` (it is deleted first).

One job per run directory: the process that runs a job holds an exclusive OS lock (`flock`) on
RUN/job.lock for the job's life, and writes its pid (and its launcher's) into that file. The kernel
releases the lock when the process dies, however it dies, so a lock is never stale; a launch, a
resume or a `--force` on a run whose lock is held is refused, naming the pids.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipectl.artifacts.plan import Plan
from pipectl.artifacts.run import (
    CHECKPOINTS_DIR,
    CheckpointEvent,
    CheckpointOutcome,
    DS_CONFIG_FILE,
    JOB_FILE,
    LAUNCH_SCRIPT,
    LOCK_FILE,
    LOGS_DIR,
    PLAN_FILE,
    JobSpec,
    RankHeartbeat,
    RankState,
    REQUEUE_FILE,
    RequeueOutcome,
    RequeueRecord,
    StepMetrics,
)
from pipectl.launch.options import check_stored_options
from pipectl.runtime.liveness import live_ranks, pid_alive, read_heartbeats, stopped_cleanly
from pipectl.errors import UserInputError
from pipectl.io import load_model, read_mapping, read_records, write_json_atomic
from pipectl.launch.engines import LaunchCommand, launch_script
from pipectl.launch.processes import find_run_processes
from pipectl.planfile import copy_plan
from pipectl.runtime.checkpoint import CheckpointInfo, list_checkpoints, read_events, staging_leftovers
from pipectl.runtime.metrics import PredictionSummary, prediction_summary, read_metrics, read_metrics_and_unreadable


@dataclass(frozen=True)
class RunFiles:
    """A run directory's inputs, read back and validated."""

    path: Path
    job: JobSpec
    plan: Plan
    ds_config: dict[str, Any]



def is_run_dir(path: Path) -> bool:
    return (path / JOB_FILE).is_file()


class RunLock:
    """The exclusive lock on RUN/job.lock that marks a run as in use (`lock_run_dir`).

    Held while this object's descriptor is open (by this process, and by a launcher given it with
    `fileno()`: the lock belongs to the open file, shared by every process that holds it).
    """

    def __init__(self, path: Path, fd: int, role: str = "launch") -> None:
        self.path = path
        self._fd: int | None = fd
        self.role = role  # what holds the run: launch, or resize (which relaunches the job itself)

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.path}: lock already released")
        return self._fd

    def record(self, *pids: int) -> None:
        """Write the pids of the processes running the job (this one first), and the role, into the lock file."""
        fd = self.fileno()
        os.ftruncate(fd, 0)
        os.pwrite(fd, " ".join([*(str(pid) for pid in pids), self.role]).encode() + b"\n", 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor of the open file releases the lock
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _lock_role(run_dir: Path) -> str:
    """What the lock file says holds the run (`RunLock.record`): launch or resize."""
    try:
        words = (run_dir / LOCK_FILE).read_text().split()
    except OSError:
        return "launch"
    return next((word for word in words if not word.isdigit()), "launch")


def _check_name_lengths(path: Path) -> None:
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


def _make_folders(path: Path) -> None:
    """`path.mkdir(parents=True)`, taking back the folders it made when it fails (a refused
    launch leaves nothing behind); the failure is named as a `UserInputError`."""
    _check_name_lengths(path)
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


def lock_holder(run_dir: str | os.PathLike[str]) -> list[int]:
    """The pids recorded by the job holding the run's lock (empty if none could be read)."""
    try:
        text = (Path(run_dir) / LOCK_FILE).read_text()
    except OSError:
        return []
    return [int(word) for word in text.split() if word.isdigit()]


def lock_run_dir(run_dir: str | os.PathLike[str], *, wait_seconds: float = 0.0, role: str = "launch") -> RunLock:
    """Take the run's lock (creating the folder if needed), waiting up to `wait_seconds` for a job
    that holds it to end; `UserInputError` naming the live job's pids if it does not, or if ranks
    of the run still run on this machine without a launcher holding the lock (both the launching
    pipectl and torchrun killed with SIGKILL, say)."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise UserInputError(f"run directory {path} is a file")
    _make_folders(path)
    lock_path = path / LOCK_FILE
    if lock_path.is_symlink():
        raise UserInputError(f"{lock_path} is a link; a run's lock file is its own", hint="remove it")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                os.close(fd)
                raise
            if time.monotonic() >= deadline:
                os.close(fd)
                # [] while the holder has not written its pid yet (a race); the pids of a job that
                # ended are left out: another process holds the lock, and a hint names live ones only.
                pids = [pid for pid in lock_holder(path) if pid_alive(pid)]
                if pids and _lock_role(path) == "resize":
                    raise UserInputError(
                        f"run directory {path} is being resized (pipectl resize, pid {pids[0]})",
                        hint="wait for the resize: it relaunches the job itself (pipectl status shows it)",
                    ) from None
                who = "pid unknown"
                if pids:
                    who = f"pid {pids[0]}" + (f", launcher pid {', '.join(map(str, pids[1:]))}" if pids[1:] else "")
                raise UserInputError(
                    f"run directory {path} is in use by a running job ({who})",
                    hint="wait for it to end, stop it (Ctrl-C in its terminal, or kill -TERM "
                    f"{pids[0] if pids else 'PID'}), or move it with pipectl resize",
                ) from None
            time.sleep(0.1)
    lock = RunLock(lock_path, fd, role)
    lock.record(os.getpid())  # at once: a launch refused meanwhile names this pid
    left = [p for p in find_run_processes(path) if p.is_worker]
    if left:  # the lock dies with the launching processes; ranks they left behind may not have
        lock.release()
        pids = " ".join(str(p.pid) for p in left)
        raise UserInputError(
            f"run directory {path} is in use: ranks of an earlier job still run (pids {pids}), although the "
            "processes that launched them have ended",
            hint=f"end them first (kill -TERM {pids}: they checkpoint and exit; kill -KILL if they are hung)",
        )
    return lock


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


def check_run_dir(run_dir: str | os.PathLike[str], *, resume: bool = False, force: bool = False) -> Path:
    """What `prepare_run_dir` refuses, refused without touching anything (see there)."""
    path = Path(run_dir)
    _check_name_lengths(path)
    if resume and force:
        raise UserInputError("--resume and --force contradict each other: keep the run, or start over")
    if path.exists() and not path.is_dir():
        raise UserInputError(f"run directory {path} is a file")
    if path.is_dir() and any(entry.name != LOCK_FILE for entry in path.iterdir()):
        if not is_run_dir(path):
            if resume:
                raise UserInputError(f"cannot resume {path}: it holds no {JOB_FILE}")
            raise UserInputError(
                f"{path} is not empty and is not a pipectl run; refusing to write into it",
                hint="choose another --run-dir",
            )
        if not force and not resume:
            raise UserInputError(
                f"run directory {path} already exists",
                hint=f"continue it with --resume, start over with --force, or see `pipectl status {path}`",
            )
    elif resume:
        raise UserInputError(f"cannot resume {path}: no such run")
    return path


def newest_complete_checkpoint(run_dir: Path) -> CheckpointInfo | None:
    """The newest checkpoint with a manifest and all its files (`CheckpointInfo`), or None.

    Only presence is checked here: hashing a large model's checkpoint takes long, and the ranks
    verify every sha256 when they load it anyway (falling back to an older one if it is corrupted).
    """
    complete = [info for info in list_checkpoints(run_dir, hash_files=False) if info.verified]
    return complete[-1] if complete else None


def check_steps_beyond_trained(run_dir: Path, target_steps: int, more: int) -> None:
    """A new total of steps for a run must lie beyond what it has trained: its newest complete
    checkpoint's step or its last logged one, whichever is later (`more`: the hint's increment)."""
    latest = newest_complete_checkpoint(run_dir)
    metrics = read_metrics(run_dir)
    checkpointed = latest.step if latest is not None and latest.step is not None else 0
    trained = max(checkpointed, metrics[-1].step if metrics else 0)
    if target_steps <= trained:
        raise UserInputError(
            f"--steps {target_steps} is not beyond the {trained} steps the run has already trained",
            hint=f"pass a larger total, e.g. --steps {trained + more}",
        )


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
        target = run_dir / name
        target.write_text(texts[name])
        written.append(target)
    script = run_dir / LAUNCH_SCRIPT
    mode = script.stat().st_mode
    script.chmod(mode | (mode & 0o444) >> 2)  # executable by whoever may read it (umask 077: 0700, not 0711)
    return written


def read_run(run_dir: str | os.PathLike[str]) -> RunFiles:
    """job.json + plan.json + ds_config.json of a run, validated (errors name the file)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise UserInputError(f"no run directory at {path}")
    if not is_run_dir(path):
        raise UserInputError(f"{path} is not a pipectl run (no {JOB_FILE})", hint="start one with pipectl launch")
    job = load_model(JobSpec, path / JOB_FILE)
    if job.options:  # what a resume reads back: refused here as there, naming the key
        check_stored_options(job.options, path / JOB_FILE)
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
    read_unix: float = 0.0  # when this was read: heartbeats are fresh against it

    @property
    def ranks_beating(self) -> bool:
        """Some rank of the run is alive and training (its heartbeat, rewritten every second, is
        recent and says running): on this host or another, under any engine."""
        return bool(live_ranks(self.heartbeats, self.read_unix, silent_after=FRESH_HEARTBEAT_SECONDS))

    @property
    def active(self) -> bool:
        """The job runs or starts: its ranks beat, or its launch is alive."""
        return self.ranks_beating or self.launching

    @property
    def requeue_count(self) -> int:
        return sum(r.outcome is RequeueOutcome.REQUEUED for r in self.requeues)

    @property
    def steps_done(self) -> int:
        return self.metrics[-1].step if self.metrics else 0

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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (`pipectl status --json`)."""
        return {
            "run_dir": str(self.path),
            "model": self.job.model,
            "engine": self.job.engine.value,
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


def read_requeues(run_dir: str | os.PathLike[str]) -> list[RequeueRecord]:
    """The run's requeue records, oldest first (unreadable lines skipped)."""
    return read_records(RequeueRecord, Path(run_dir) / LOGS_DIR / REQUEUE_FILE)


def run_status(run_dir: str | os.PathLike[str], *, verify_hashes: bool = False) -> RunStatus:
    """Read a run's job, plan, metrics and checkpoints (hashing every file only if asked)."""
    files = read_run(run_dir)
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
        # The current layout's steps only: a resize changes the step and its prediction.
        prediction=prediction_summary([m for m in metrics if not layouts or m.layout == layouts[-1]]),
        checkpoints=checkpoints,
        layouts=layouts,
        staging=staging_leftovers(files.path),
        checkpoint_events=read_events(files.path),
        unreadable_metrics_lines=unreadable,
        heartbeats=read_heartbeats(files.path),
        requeues=read_requeues(files.path),
        launching=any(pid != os.getpid() and pid_alive(pid) for pid in lock_holder(files.path)),
        read_unix=time.time(),
    )
