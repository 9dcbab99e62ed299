"""One job per run directory: the process that runs a job holds an exclusive OS lock (`flock`) on
RUN/job.lock for the job's life, and writes its pid (and its launcher's) into that file. The kernel
releases the lock when the process dies, however it dies, so a lock is never stale; a launch, a
resume or a `--force` on a run whose lock is held is refused, naming the pids.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from pipectl.artifacts.run import (
    LOCK_FILE,
)
from pipectl.rundir.heartbeats import pid_alive
from pipectl.errors import UserInputError
from pipectl.rundir.processes import find_run_ranks
from pipectl.rundir.run import make_run_folders


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
    make_run_folders(path)
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
    left = find_run_ranks(path)
    if left:  # the lock dies with the launching processes; ranks they left behind may not have
        lock.release()
        pids = " ".join(str(p.pid) for p in left)
        raise UserInputError(
            f"run directory {path} is in use: ranks of an earlier job still run (pids {pids}), although the "
            "processes that launched them have ended",
            hint=f"end them first (kill -TERM {pids}: they checkpoint and exit; kill -KILL if they are hung)",
        )
    return lock
