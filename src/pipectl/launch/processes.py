"""Every process of a job pipectl started: the launcher and all it started, found and ended.

A process group is not enough: torchrun starts each rank in a session of its own, so `killpg` of
the launcher's group leaves the ranks running (measured: both ranks outlived `launch --timeout`).
`JobProcesses` keeps every descendant of the launcher it has seen (psutil, refreshed while the job
runs), because a rank whose launcher died is re-parented and no longer a descendant of anything
pipectl knows. A `psutil.Process` remembers its start time, so a recycled pid is never signalled.

Ending the job (`end`): SIGTERM to every live process, then SIGKILL to those still alive after
`grace_seconds`. A stopped process (SIGSTOP) cannot act on SIGTERM until continued; SIGKILL ends it.
"""

from __future__ import annotations

import signal
import subprocess

import psutil

WORKER_MODULE = "pipectl.runtime.worker"


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
        """The live ranks: processes running the pipectl worker."""
        found = []
        for process in self.alive():
            try:
                if WORKER_MODULE in process.cmdline():
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

    def kill(self) -> None:
        """SIGKILL to every live process of the job, now."""
        self.refresh()
        alive = self.alive()
        self.signal(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
        self._reap()

    def _reap(self) -> None:
        try:
            self.launcher.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
