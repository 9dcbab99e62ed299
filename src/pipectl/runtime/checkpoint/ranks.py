"""What the ranks do together with checkpoints: agree on the newest one that loads (rank 0 decides,
every rank loads the same tag, re-cut for its own stage and tensor slice), stop at a step boundary
on a signal or the stop file, and name why a save failed (a full disk, a file size limit).

The store on disk (where checkpoints lie, what makes one committed) is `rundir.checkpoints`; this
module adds what needs torch.distributed or the shard reader.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipectl.errors import CheckpointError
from pipectl.rundir.checkpoints import (
    RESIZE_STOP,
    SHARDS_FORMAT,
    STOP_FILE,
    CheckpointInfo,
    checkpoints_dir,
    list_checkpoints,
    mark_rejected,
    resume_point,
)

# torch, DeepSpeed and the tensor-parallel model code are imported inside the functions that use
# them: `pipectl status` and `resize` list and verify checkpoints without loading either.

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- collective helpers


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (identity without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_from_ranks(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank ([value] without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


# --------------------------------------------------------------------------- a save that failed


_SAVE_HINT = "free space or fix the folder's permissions, then continue with pipectl launch --resume"
_DISK_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file size limit reached",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
}
_LOW_SPACE_BYTES = 64 << 20  # less than this free after a failed write: the disk is full


def _write_failure_cause(exc: BaseException, folder: Path) -> str | None:
    """Why writing under `folder` failed, when the file system says so; None when it does not.

    An `OSError` names its errno. torch's own writer (`torch.save` to a path) reports only
    "file write failed" or "unexpected pos", so the folder is examined instead: free space
    (`statvfs`), the process's file-size limit (`ulimit -f`; Python ignores SIGXFSZ, so the write
    fails with EFBIG instead of killing the rank), and write permission.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_ERRNOS:
            cause = _DISK_ERRNOS[current.errno]
            return cause + (f" ({_size_limit_text()})" if current.errno == errno.EFBIG else "")
        current = current.__cause__ or current.__context__
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None:
        return None
    try:
        stats = os.statvfs(existing)
    except OSError:
        return None
    free = stats.f_bavail * stats.f_frsize
    if free < _LOW_SPACE_BYTES:
        return f"no space left on device ({free / 2**20:.1f} MiB free under {existing})"
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        return f"file size limit reached ({_size_limit_text()})"
    if not os.access(existing, os.W_OK):
        return f"permission denied ({existing} is not writable)"
    return None


def _size_limit_text() -> str:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return "no file size limit" if soft == resource.RLIM_INFINITY else f"ulimit -f: files up to {soft:,} bytes"


def save_failure_message(exc: BaseException, run_dir: str | os.PathLike[str], step: int) -> str:
    """'no space left on device (…) while writing checkpoint step N in RUN/checkpoints; checkpoint
    step M is intact', or the exception itself when the file system gives no cause."""
    root = checkpoints_dir(run_dir)
    intact = [info.step for info in list_checkpoints(run_dir) if info.verified and info.step is not None]
    tail = f"checkpoint step {intact[-1]} is intact" if intact else "the run has no earlier checkpoint"
    cause = _write_failure_cause(exc, root)
    if cause is not None:
        return f"{cause} while writing checkpoint step {step} in {root}; {tail}"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"writing checkpoint step {step} failed ({type(exc).__name__}" + (f": {first}" if first else "") + f"); {tail}"


# --------------------------------------------------------------------------- load


def unloadable_problem(info: CheckpointInfo) -> str | None:
    """Why a verified checkpoint cannot be read back, or None when it can.

    A file can match its manifest and still not load: one rewritten with its hash recomputed, or a
    checkpoint in a format this version does not read. Every rank file's header is parsed and its
    tensor table checked against the file's size (memory-mapped: the tensor bytes are not read).
    Needs torch (the shard reader).
    """
    from pipectl.runtime.checkpoint.shards import ShardReader

    if info.manifest is None:
        return f"{info.path}: no manifest to say which files it holds"
    if info.manifest.format != SHARDS_FORMAT:
        return (
            f"{info.path}: written in the {info.manifest.format} format of an earlier pipectl; this version "
            f"reads its own {SHARDS_FORMAT} files"
        )
    try:
        ShardReader(info.path, info.manifest.files)
    except CheckpointError as exc:
        return exc.message
    return None


@dataclass
class LoadedCheckpoint:
    """What `load_latest` restored."""

    tag: str
    step: int
    path: Path
    data_position: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def load_latest(
    engine: Any, run_dir: str | os.PathLike[str], *, restore_rng: bool = True
) -> LoadedCheckpoint | None:
    """Load the newest verified checkpoint into `engine` (weights, optimizer state, schedule, RNG),
    whatever layout wrote it. EVERY rank.

    Returns None when the run has no checkpoint (a fresh start). Corrupted newer checkpoints are
    skipped with a warning naming the bad file (in `.warnings`, also logged). One that verifies but
    fails to load on some rank (a file that hashes clean and lacks a parameter) is skipped too, on
    every rank alike, with each failing rank's reason, and the next older one is loaded. When no
    committed checkpoint loads, `CheckpointError` lists them all: never a silent restart.
    """
    from pipectl.runtime.checkpoint import engine_state
    from pipectl.runtime.checkpoint.shards import ShardReader

    rank, _ = rank_and_world()
    failed: list[str] = []  # tags that verified but did not load, newest first
    failures: list[str] = []  # why, one message each
    passed_over: dict[str, str] = {}  # rank 0: every committed tag skipped, and why
    while True:
        choice: tuple[str | None, list[str], str | None, list[str], int | None] = (None, [], None, [], None)
        if rank == 0:  # one rank hashes; all load the same tag
            info, warnings, problem = None, [], None
            try:
                info, warnings = resume_point(run_dir, load_check=unloadable_problem, skip=failed, skipped=passed_over)
            except CheckpointError as exc:
                problem = "; ".join([exc.message, *failures])
            if info is None and failures and problem is None:
                problem = f"no checkpoint of {Path(run_dir)} can be loaded: " + "; ".join([*failures, *warnings])
            for warning in warnings if not failed else ():
                log.warning(warning)
            files = sorted(info.manifest.files) if info is not None and info.manifest is not None else []
            choice = (info.tag if info else None, warnings, problem, files, info.step if info else None)
        tag, warnings, problem, files, step = broadcast_from_rank0(choice)
        if problem is not None:  # raised on every rank, before any of them loads
            raise CheckpointError(problem, hint="restore a good checkpoint, or start over with --force")
        if tag is None:
            return None
        path = checkpoints_dir(run_dir) / tag
        header, error = None, None
        try:
            header = engine_state.restore(engine, ShardReader(path, files), restore_rng=restore_rng)
        except (CheckpointError, KeyError, ValueError, RuntimeError, OSError) as exc:
            error = f"rank {rank}: {getattr(exc, 'message', None) or exc}"
        errors = [e for e in all_gather_from_ranks(error) if e]
        if not errors:
            if rank == 0:
                mark_rejected(run_dir, passed_over)
            return LoadedCheckpoint(
                tag=tag,
                step=header.step,
                path=path,
                data_position=dict(header.data_position),
                warnings=[*warnings, *failures],
            )
        message = f"checkpoint {f'step {step}' if step is not None else tag} could not be loaded ({'; '.join(errors)})"
        log.warning(message)
        failed.append(tag)
        failures.append(message)
        passed_over[tag] = message


# --------------------------------------------------------------------------- stopping


def stop_file_reason(path: Path) -> str:
    """Why RUN/stop_requested asks the ranks to stop, from its first line: `pipectl resize` writes
    `RESIZE_STOP` (an earlier version, 'requested at ...'); a Slurm job's time-limit trap its own
    words ('time limit in 120 s (Slurm USR1)'), which the requeue step tells from a resize's."""
    try:
        first = path.read_text(errors="replace").strip().splitlines()[:1]
    except OSError:  # removed between the check and the read: a resize's, as any other
        first = []
    text = first[0].strip() if first else ""
    if not text or text.startswith(RESIZE_STOP) or text.startswith("requested at"):
        return RESIZE_STOP
    return text[:200]


class StopFlag:
    """Set by SIGTERM/SIGINT (or a RUN/stop_requested file): stop at the next step boundary."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        self.reason = self.reason or reason
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


def install_sigterm_handler(signals: tuple[int, ...] = (signal.SIGTERM,)) -> StopFlag:
    """Turn SIGTERM (a spot VM's pre-emption warning) into a flag the training loop polls.

    The worker finishes the current step, checkpoints, and exits 0 (see `should_stop`).
    Must be called from the main thread.
    """
    flag = StopFlag()

    def _handler(signum: int, _frame: Any) -> None:
        flag.set(signal.Signals(signum).name)

    for signum in signals:
        signal.signal(signum, _handler)
    return flag


@dataclass(frozen=True)
class Boundary:
    """What every rank decided together at a step boundary."""

    stop: bool  # any rank was signalled, or RUN/stop_requested exists
    checkpoint: bool  # any rank's clock says a wall-time checkpoint is due
    resize: int  # the generation of a live resize to take now (`runtime.elastic.live_resize`), else 0
    announced: int = 0  # the generation of a live resize some rank saw, taken now or not


def step_boundary(
    flag: StopFlag,
    run_dir: str | os.PathLike[str] | None = None,
    checkpoint_due: bool = False,
    resize: int = 0,
    preparing: bool = False,
) -> Boundary:
    """Collective, once per step boundary on every rank: stop if ANY rank was signalled or
    RUN/stop_requested exists; checkpoint if any rank's clock says a wall-time checkpoint is due
    (`CheckpointSchedule`); resize live if any rank saw a request (`resize`: its generation) and
    no rank is still preparing for it (`preparing`: `live_resize.Preparation`, touching the memory its
    next engine takes while the job trains on). One all-reduce of four numbers: one rank deciding
    alone would deadlock the others. A stop wins over a resize.
    """
    import torch
    import torch.distributed as dist

    if run_dir is not None and (Path(run_dir) / STOP_FILE).exists():
        flag.set(stop_file_reason(Path(run_dir) / STOP_FILE))
    votes = torch.tensor(
        [1.0 if flag.is_set() else 0.0, 1.0 if checkpoint_due else 0.0, float(resize), 1.0 if preparing else 0.0]
    )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    stop, due = bool(votes[0].item()), bool(votes[1].item())
    if stop and not flag.is_set():
        flag.set("another rank")
    announced = int(votes[2].item())
    return Boundary(stop, due, 0 if stop or votes[3].item() > 0 else announced, announced)


def should_stop(flag: StopFlag, run_dir: str | os.PathLike[str] | None = None) -> bool:
    """Collective: True on every rank if ANY rank was signalled or RUN/stop_requested exists."""
    return step_boundary(flag, run_dir).stop
