"""`JobProcesses`: every process of a job, ranks in sessions of their own included (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from pipectl.artifacts.run import Engine
from pipectl.launch.engines import LaunchCommand
from pipectl.launch.supervise import run_engine
from pipectl.rundir.processes import JobProcesses

# A launcher that starts one 'rank' in a session of its own, as torchrun does, then waits for it.
# The rank's argv runs the worker module (`-m pipectl.runtime.worker`), which is how ranks are told
# from launchers (a torchrun's argv names it too, after its own `-m torch.distributed.run`).
LAUNCHER = (
    "import subprocess, sys\n"
    "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '-m', 'pipectl.runtime.worker'],"
    " start_new_session=True)\n"
    "print(rank.pid, flush=True)\n"
    "{after}\n"
)


def start(after: str = "rank.wait()") -> tuple[subprocess.Popen, int]:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(after=after)], stdout=subprocess.PIPE, text=True)
    rank = int(launcher.stdout.readline())
    return launcher, rank


def wait_until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_a_graceful_stop_signals_the_rank_below_the_launcher_not_the_launcher():
    launcher, rank = start()
    try:
        processes = JobProcesses(launcher)
        # the rank's argv names the worker once it has exec'd (a forked child still shows its parent's)
        assert wait_until(lambda: [p.pid for p in processes.workers()] == [rank])
        assert os.getpgid(rank) != os.getpgid(launcher.pid)  # the group would miss it
        processes.stop_gracefully()
        assert launcher.wait(timeout=10) == 0  # the launcher itself was not signalled: its rank ended
        assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE
    finally:
        launcher.kill()


def test_end_kills_a_stopped_rank_in_its_own_session_and_the_launcher():
    launcher, rank = start()
    try:
        os.kill(rank, signal.SIGSTOP)  # cannot act on SIGTERM: needs the SIGKILL
        # A rank not yet scheduled holds SIGSTOP and the coming SIGTERM both pending, and the kernel
        # delivers the lower-numbered SIGTERM first: wait until it has really stopped.
        assert wait_until(lambda: psutil.Process(rank).status() == psutil.STATUS_STOPPED)
        processes = JobProcesses(launcher)
        started = time.monotonic()
        killed = processes.end(grace_seconds=1.0)
        assert time.monotonic() - started < 10
        assert rank in killed
        assert launcher.poll() is not None
        assert wait_until(lambda: not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE)
    finally:
        launcher.kill()
        try:
            os.kill(rank, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_ranks_left_behind_by_their_launcher_are_ended(tmp_path):
    """A launcher that exits while its rank runs on: run_engine ends the orphan and says so."""
    script = LAUNCHER.format(after="import time; time.sleep(0.5)")  # exits 0, the rank still sleeping
    said = []
    code = run_engine(LaunchCommand(Engine.LOCAL, [sys.executable, "-c", script]), tmp_path, tick_seconds=0.05, say=said.append)
    assert code == 0
    rank = int((tmp_path / "logs" / "engine.log").read_text().split()[0])
    assert said and f"ending 1 rank the launcher left behind: pid {rank} (" in said[0]
    assert wait_until(lambda: not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE)


def test_a_signal_the_process_ignores_stays_ignored_under_pipectls_handlers():
    """`nohup pipectl resize ...` ignores SIGHUP so that the resize outlives its terminal: pipectl's
    handlers (a resize's interruption, a held block) leave an ignored signal ignored, and put back
    what they replaced."""
    from pipectl.launch.supervise import signals_held, signals_interrupt

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with signals_interrupt() as seen:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
            os.kill(os.getpid(), signal.SIGHUP)  # ignored: no KeyboardInterrupt
            with signals_held() as held:
                assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
                os.kill(os.getpid(), signal.SIGHUP)
            assert held == [] and seen == []
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before)
