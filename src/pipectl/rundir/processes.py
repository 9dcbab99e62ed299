"""Every process of a job pipectl started: the launcher and all it started, found and ended.

A process group is not enough: torchrun starts each rank in a session of its own, so `killpg` of
the launcher's group leaves the ranks running (measured: both ranks outlived `launch --timeout`).
`JobProcesses` keeps every descendant of the launcher it has seen (psutil, refreshed while the job
runs), because a rank whose launcher died is re-parented and no longer a descendant of anything
pipectl knows. A `psutil.Process` remembers its start time, so a recycled pid is never signalled.

Ending the job (`end`): SIGTERM to every live process, then SIGKILL to those still alive after
`grace_seconds`. A stopped process (SIGSTOP) cannot act on SIGTERM until continued; SIGKILL ends it.

A run's processes on this machine, whoever started them (`find_run_processes`), are found from
their command lines: every engine runs `... pipectl.runtime.worker --run-dir RUN` (the launcher's
own argv carries it as well), so no pid file can go stale.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

WORKER_MODULE = "pipectl.runtime.worker"


@dataclass(frozen=True)
class RunProcess:
    """A live process started for a run: a launcher (torchrun, deepspeed) or a rank."""

    pid: int
    argv: tuple[str, ...]

    @property
    def is_worker(self) -> bool:
        """A rank itself (the worker module is what it runs), not a launcher that starts ranks."""
        return _module_of(self.argv) == WORKER_MODULE


def _module_of(argv: tuple[str, ...]) -> str | None:
    """The `-m MODULE` the interpreter runs (the first one: a launcher's own module)."""
    for flag, value in zip(argv, argv[1:]):
        if flag == "-m":
            return value
    return None


def run_dir_argument(argv: tuple[str, ...]) -> str | None:
    """The value after the last `--run-dir` (or `--run-dir=...`), if the argv starts the worker."""
    if WORKER_MODULE not in argv:
        return None
    found = None
    for index, arg in enumerate(argv):
        if arg == "--run-dir" and index + 1 < len(argv):
            found = argv[index + 1]
        elif arg.startswith("--run-dir="):
            found = arg.split("=", 1)[1]
    return found


def _resolve(argument: str, process: psutil.Process) -> Path:
    path = Path(argument)
    if not path.is_absolute():
        try:
            path = Path(process.cwd()) / path
        except psutil.Error:
            pass
    return path.resolve()


def find_run_processes(run_dir: str | os.PathLike[str]) -> list[RunProcess]:
    """Live processes on this machine started for `run_dir` (empty when it is not running here)."""
    target = Path(run_dir).resolve()
    found = []
    for process in psutil.process_iter(["cmdline"]):
        argv = tuple(process.info["cmdline"] or ())
        if process.pid == os.getpid() or not argv:
            continue
        argument = run_dir_argument(argv)
        if argument is not None and _resolve(argument, process) == target:
            found.append(RunProcess(process.pid, argv))
    return sorted(found, key=lambda p: p.pid)


def find_run_ranks(run_dir: str | os.PathLike[str]) -> list[RunProcess]:
    """The ranks among `find_run_processes(run_dir)` (not their launchers)."""
    return [process for process in find_run_processes(run_dir) if process.is_worker]


def is_alive(process: RunProcess) -> bool:
    """Still running and still the same program (a recycled pid does not count)."""
    try:
        found = psutil.Process(process.pid)
        # a zombie has exited; only its parent has not collected it yet
        return tuple(found.cmdline()) == process.argv and found.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class JobProcesses:
    """The launcher `proc` and every process below it seen so far."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.launcher = proc
        self._seen: dict[int, psutil.Process] = {}
        try:
            self._seen[proc.pid] = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            pass
        self.refresh()

    def refresh(self) -> None:
        """Add the launcher's current descendants."""
        root = self._seen.get(self.launcher.pid)
        if root is None:
            return
        try:
            children = root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for child in children:
            self._seen.setdefault(child.pid, child)

    def alive(self) -> list[psutil.Process]:
        """The processes seen that still run (not zombies: those have exited)."""
        found = []
        for process in self._seen.values():
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
            except psutil.NoSuchProcess:
                continue
        return found

    def workers(self) -> list[psutil.Process]:
        """The live ranks: processes running the pipectl worker (not a torchrun whose command line
        names it)."""
        found = []
        for process in self.alive():
            try:
                if _module_of(tuple(process.cmdline())) == WORKER_MODULE:
                    found.append(process)
            except psutil.Error:
                continue
        return found

    def signal(self, processes: list[psutil.Process], signum: int) -> None:
        for process in processes:
            try:
                process.send_signal(signum)
            except psutil.NoSuchProcess:
                continue

    def stop_gracefully(self) -> None:
        """SIGTERM to the ranks only: each finishes its step, checkpoints and exits 0, so the
        launcher (torchrun, DeepSpeed's) sees its workers succeed and exits 0 as well. Signalling
        the launcher itself makes torchrun exit 1 even after a clean stop (measured). With no rank
        started yet, the launcher gets it."""
        self.refresh()
        self.signal(self.workers() or self.alive(), signal.SIGTERM)

    def end(self, grace_seconds: float = 10.0) -> list[int]:
        """SIGTERM to every live process of the job, SIGKILL to those left after `grace_seconds`;
        the pids that had to be killed."""
        self.refresh()
        alive = self.alive()
        self.signal(alive, signal.SIGTERM)
        _, left = psutil.wait_procs(alive, timeout=grace_seconds)
        self.signal(left, signal.SIGKILL)
        psutil.wait_procs(left, timeout=5)
        self._reap()
        return sorted(p.pid for p in left)

    def _reap(self) -> None:
        try:
            self.launcher.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
