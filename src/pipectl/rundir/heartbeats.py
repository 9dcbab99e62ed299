"""Each rank's heartbeat file (logs/heartbeat-rank{R}.json), written by the rank every second and
read by the launching process and `pipectl status`: which ranks live, which vanished, and whether a
job whose launcher failed had every rank stop cleanly at the same checkpoint.

Torch-free: the CLI reads heartbeats with it. The thread that writes them, the collective timeout
and the watch that names a silent rank are `runtime.liveness`.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic import ValidationError

from pipectl.artifacts.run import HEARTBEAT_FILE, LOGS_DIR, RankHeartbeat, RankState
from pipectl.io import temporary_file

HEARTBEAT_SECONDS = 1.0
SILENT_AFTER_SECONDS = 30.0  # a rank without a heartbeat this long is named (at most)


def heartbeat_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / LOGS_DIR / HEARTBEAT_FILE.format(rank=rank)


def write_heartbeat(run_dir: str | os.PathLike[str], beat: RankHeartbeat) -> None:
    """Write-then-rename without fsync: a reader never sees half a file, and a heartbeat lost to
    a power cut does not matter (a fsync per second per rank would, on a shared filesystem)."""
    path = heartbeat_path(run_dir, beat.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temporary_file(path.parent, path.name)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(beat.model_dump_json() + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_heartbeats(run_dir: str | os.PathLike[str], *, since_unix: float = 0.0) -> dict[int, RankHeartbeat]:
    """Rank -> its heartbeat, for the ranks started at or after `since_unix`; unreadable files
    (a rank writing its first one, a stray file) are left out."""
    beats = {}
    for path in (Path(run_dir) / LOGS_DIR).glob(HEARTBEAT_FILE.format(rank="*")):
        try:
            beat = RankHeartbeat.model_validate_json(path.read_text())
        except (OSError, ValueError, ValidationError):
            continue
        if beat.started_unix >= since_unix:
            beats[beat.rank] = beat
    return beats


def current_heartbeats(run_dir: str | os.PathLike[str], world_size: int) -> dict[int, RankHeartbeat]:
    """`read_heartbeats` less the files of ranks beyond the job's `world_size` that ended before its
    ranks started: a restart into fewer ranks leaves the old ranks' last beats on disk, and a
    finished old rank would read as one still to stop. A rank that left in a live resize beat
    after the job started, and keeps its beat (it says it left)."""
    beats = read_heartbeats(run_dir)
    start = job_started_unix(beats, world_size)
    if start is None:
        return beats
    return {rank: beat for rank, beat in beats.items() if rank < world_size or beat.beat_unix >= start}


def job_started_unix(beats: dict[int, RankHeartbeat], world_size: int) -> float | None:
    """When the job's latest start began: its first rank's start (the ranks below `world_size`);
    None without a beat of one."""
    return min((beat.started_unix for rank, beat in beats.items() if rank < world_size), default=None)


def stage_and_pid(beat: RankHeartbeat) -> str:
    """'stage 1, pid 4242' (the stage when the rank knows it)."""
    return ", ".join(x for x in (f"stage {beat.stage}" if beat.stage is not None else "", f"pid {beat.pid}") if x)


TRAINING_PHASE = "training"  # a heartbeat's phase while the rank trains a step
ENDED = "its process has ended"  # `process_state` of a rank that no longer runs


def process_state(beat: RankHeartbeat) -> str:
    """What this host's OS says of the rank's process: '' for another host's rank."""
    if beat.host != socket.gethostname():
        return ""
    import psutil  # a DeepSpeed dependency; only where a job is watched

    try:
        process = psutil.Process(beat.pid)
        if process.create_time() > beat.started_unix + 1.0:
            return ENDED  # the pid now belongs to another process
        status = process.status()
    except psutil.NoSuchProcess:
        return ENDED
    except psutil.Error:
        return ""
    if status == psutil.STATUS_STOPPED or status == psutil.STATUS_TRACING_STOP:
        return "its process is stopped (SIGSTOP, or a debugger)"
    if status == psutil.STATUS_ZOMBIE:
        return ENDED
    if status == psutil.STATUS_DISK_SLEEP:
        return "its process is blocked in the kernel (uninterruptible I/O)"
    return f"its process is {status}"


def vanished_ranks(run_dir: str | os.PathLike[str], *, since_unix: float = 0.0) -> list[RankHeartbeat]:
    """This host's ranks whose process has ended without a final heartbeat (killed, or crashed in
    a way no handler saw): the cause a peer's "Connection reset by peer" follows from."""
    beats = read_heartbeats(run_dir, since_unix=since_unix)
    return [
        beat for _, beat in sorted(beats.items())
        if beat.state is RankState.RUNNING and process_state(beat) == ENDED
    ]


def vanished_line(beat: RankHeartbeat, trained: int | None = None) -> str:
    """'rank 1 (stage 1, pid 4242) ended without a word in step 7 (live resize: handing the state
    over): it was killed, or its process crashed'. `trained`: the last step the job recorded; a
    rank beats once a second, several steps apart on a fast job, so one that was training is
    named in the step after that when its last beat is older.

        >>> from pipectl.artifacts.run import RankHeartbeat
        >>> beat = RankHeartbeat(rank=1, stage=1, pid=7, step=50, phase=TRAINING_PHASE,
        ...                      started_unix=0.0, beat_unix=0.0, progress_unix=0.0)
        >>> vanished_line(beat, trained=57)
        'rank 1 (stage 1, pid 7) ended without a word in step 58 (training): it was killed, or its process crashed'
    """
    where = stage_and_pid(beat)
    step = beat.step
    if step is not None and beat.phase == TRAINING_PHASE and trained is not None:
        step = max(step, trained + 1)
    seen = (f" in step {step}" if step is not None else "") + (f" ({beat.phase})" if beat.phase else "")
    return f"rank {beat.rank} ({where}) ended without a word{seen}: it was killed, or its process crashed"


def live_ranks(heartbeats: dict[int, RankHeartbeat], now: float, silent_after: float = SILENT_AFTER_SECONDS) -> list[RankHeartbeat]:
    """The ranks still training: running, and beating within `silent_after` seconds. What a
    process list cannot show of ranks on other nodes (a Slurm job seen from the login node).

    >>> beat = dict(pid=1, started_unix=0.0, progress_unix=1.0)
    >>> beats = {0: RankHeartbeat(rank=0, beat_unix=95.0, **beat), 1: RankHeartbeat(rank=1, beat_unix=10.0, **beat)}
    >>> [b.rank for b in live_ranks(beats, now=100.0)]
    [0]
    """
    return [b for b in heartbeats.values() if b.state is RankState.RUNNING and now - b.beat_unix < silent_after]


def stopped_cleanly(heartbeats: dict[int, RankHeartbeat], world_size: int) -> int | None:
    """The checkpoint step, if every one of the `world_size` ranks the job started with has a
    heartbeat and every rank still in the job (not `left` in a live resize; ranks that joined one
    count too) ended finished or stopped with the same checkpoint written; None otherwise.

    >>> beat = dict(pid=1, started_unix=0.0, beat_unix=1.0, progress_unix=1.0)
    >>> beats = {r: RankHeartbeat(rank=r, state=RankState.STOPPED, checkpoint_step=6, **beat) for r in (0, 1)}
    >>> stopped_cleanly(beats, 2), stopped_cleanly(beats, 3)
    (6, None)
    >>> beats[1] = RankHeartbeat(rank=1, state=RankState.LEFT, checkpoint_step=4, **beat)
    >>> stopped_cleanly(beats, 2)
    6
    """
    if not set(range(world_size)) <= set(heartbeats):
        return None
    staying = [b for b in heartbeats.values() if b.state not in (RankState.LEFT, RankState.LOST)]
    clean = (RankState.FINISHED, RankState.STOPPED)
    steps = {b.checkpoint_step for b in staying if b.state in clean}
    if len(steps) != 1 or any(b.state not in clean for b in staying):
        return None
    return steps.pop()


SUPERVISOR_VARIABLE = "PIPECTL_SUPERVISOR_PID"  # the pid of the pipectl process supervising the job


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (signal 0: nothing is sent) and has not exited: a zombie, an
    ended process its parent has not collected yet, counts as ended."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc (macOS), or it ended meanwhile: signal 0 said it exists
        return True
    return stat[stat.rfind(")") + 2:][:1] != "Z"  # the state follows the command name in parentheses
