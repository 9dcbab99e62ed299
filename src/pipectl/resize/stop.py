"""Find a run's live processes and stop them at a step boundary (after their checkpoint).

A run is running when a process on this machine was started for it: every engine runs
`... pipectl.runtime.worker --run-dir RUN` (the launcher's own argv carries it as well), so the
processes are found from their command lines (psutil), with no pid file to go stale.

Stopping is the runtime's own path: the file RUN/stop_requested is polled collectively at every
step boundary; the ranks finish the step, write a checkpoint and exit 0 (and then so does their
launcher). Ranks that do not react within `signal_after_seconds` also get SIGTERM, which the
worker turns into the same stop at the next step boundary.

Only this machine's processes are visible. On a multi-node job, resize from a node that hosts
ranks: the stop decision is collective (every rank stops at the same step boundary), so once the
ranks here have checkpointed and exited, so have the others; the stop file reaches them through
the shared run directory. From a host with none of the job's processes (a Slurm login node), the
ranks' heartbeats in the shared run directory show a live job (`runtime.liveness`): the stop file
is written the same way and `wait_for_ranks` waits until every rank's heartbeat has ended;
`cancel_slurm_job` cancels the recorded Slurm job when asked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pipectl.artifacts.run import SLURM_JOB_ID_FILE, RankHeartbeat
from pipectl.errors import LaunchError
from pipectl.rundir.processes import RunProcess, find_run_processes, is_alive
from pipectl.rundir.lock import lock_holder
from pipectl.rundir.heartbeats import live_ranks, pid_alive, read_heartbeats
from pipectl.rundir.checkpoints import RESIZE_STOP


@dataclass(frozen=True)
class StopOutcome:
    processes: tuple[RunProcess, ...]
    seconds: float  # request -> every process gone
    signalled: bool  # SIGTERM had to be sent too


def request_stop(run_dir: str | os.PathLike[str], stop_file: str) -> Path:
    """Create RUN/<stop_file>: the ranks stop at their next step boundary, after a checkpoint."""
    stop_path = Path(run_dir) / stop_file
    stop_path.write_text(f"{RESIZE_STOP}: requested at {time.time():.3f} by pid {os.getpid()}\n")
    return stop_path


def starting_launch(run_dir: str | os.PathLike[str]) -> list[int]:
    """The live pids holding the run's lock (`rundir.lock.lock_run_dir`) other than this process:
    a launch between taking the lock and starting its ranks (its pre-flight, DeepSpeed's config
    check) has no process `find_run_processes` sees yet."""
    return [pid for pid in lock_holder(run_dir) if pid != os.getpid() and pid_alive(pid)]


def wait_for_start(
    run_dir: str | os.PathLike[str], *, timeout_seconds: float = 300.0, poll_seconds: float = 0.1
) -> list[RunProcess]:
    """Wait until a starting launch (`starting_launch`) has started its ranks (they are returned)
    or has let go of the run (nothing is). `LaunchError` after `timeout_seconds`."""
    started = time.monotonic()
    while True:
        processes = find_run_processes(run_dir)
        if processes or not starting_launch(run_dir):
            return processes
        if time.monotonic() - started >= timeout_seconds:
            raise LaunchError(
                f"the job starting in {run_dir} started no rank within {timeout_seconds:.0f} s",
                hint="wait for it, or stop it (kill -TERM " + " ".join(map(str, starting_launch(run_dir))) + ")",
            )
        time.sleep(poll_seconds)


def wait_for_exit(
    run_dir: str | os.PathLike[str],
    processes: list[RunProcess],
    *,
    signal_after_seconds: float = 60.0,
    timeout_seconds: float = 300.0,
    poll_seconds: float = 0.05,
    started: float | None = None,
    include_launchers: bool = False,
) -> StopOutcome:
    """Wait until the run's ranks are gone; SIGTERM the ranks still alive after `signal_after_seconds`.

    The ranks are what holds devices and writes the checkpoint; a launcher (torchrun, DeepSpeed's
    runner) exits by itself shortly after its ranks have exited 0, so it is waited
    for only while it has no rank yet (it could still start one), or with `include_launchers` (an
    elastic launcher may restart ranks that failed). Ranks that appear meanwhile are waited for too.

    Raises `LaunchError` if ranks are still alive after `timeout_seconds` (nothing is killed: a
    rank that is writing its checkpoint must not be cut off; the message names the pids).
    `started` is the `time.monotonic()` of the stop request (default: now).
    """
    started = time.monotonic() if started is None else started
    signalled = False
    seen = {p.pid: p for p in processes}
    while True:
        for process in find_run_processes(run_dir):
            seen.setdefault(process.pid, process)
        alive = [p for p in seen.values() if is_alive(p)]
        ranks = [p for p in alive if p.is_worker]
        blocking = alive if include_launchers else (ranks or alive)  # a launcher alone may start ranks
        elapsed = time.monotonic() - started
        if not blocking or (not include_launchers and not ranks and any(p.is_worker for p in seen.values())):
            return StopOutcome(tuple(seen.values()), elapsed, signalled)
        if not signalled and elapsed >= signal_after_seconds:
            for process in ranks:
                try:
                    os.kill(process.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
            signalled = True
        if elapsed >= timeout_seconds:
            pids = ", ".join(str(p.pid) for p in blocking)
            raise LaunchError(
                f"the run at {run_dir} did not stop within {timeout_seconds:.0f} s (pids {pids} still alive)",
                hint="wait for its checkpoint and resize again, or stop it yourself",
            )
        time.sleep(poll_seconds)


def wait_for_ranks(
    run_dir: str | os.PathLike[str],
    ranks: list[RankHeartbeat],
    *,
    timeout_seconds: float = 300.0,
    poll_seconds: float = 0.5,
    started: float | None = None,
) -> StopOutcome:
    """Wait until each of `ranks` (seen live through its heartbeat) has ended: its last heartbeat
    says finished, stopped or failed, or it has gone silent. Raises `LaunchError` naming the ranks
    still training after `timeout_seconds`."""
    started = time.monotonic() if started is None else started
    wanted = {b.rank: b.started_unix for b in ranks}
    while True:
        now = time.time()
        beats = read_heartbeats(run_dir, since_unix=min(wanted.values(), default=0.0))
        still = [b for b in live_ranks(beats, now) if wanted.get(b.rank) == b.started_unix]
        elapsed = time.monotonic() - started
        if not still:
            return StopOutcome((), elapsed, False)
        if elapsed >= timeout_seconds:
            hosts = sorted({b.host for b in still})
            raise LaunchError(
                f"the run at {run_dir} did not stop within {timeout_seconds:.0f} s (ranks "
                f"{', '.join(str(b.rank) for b in sorted(still, key=lambda b: b.rank))} on {', '.join(hosts)} still training)",
                hint="wait for its checkpoint and resize again, or cancel it (resize --scancel for a Slurm job)",
            )
        time.sleep(poll_seconds)


def cancel_slurm_job(run_dir: str | os.PathLike[str]) -> str:
    """`scancel` the Slurm job whose id the run's sbatch script recorded; its id."""
    path = Path(run_dir) / SLURM_JOB_ID_FILE
    try:
        job_id = path.read_text().strip()
    except OSError:
        raise LaunchError(f"no Slurm job id recorded in {path}: the job has not started (or was not submitted from this run)") from None
    if not job_id.isdigit():
        raise LaunchError(f"{path} holds {job_id!r}, not a Slurm job id")
    try:
        done = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise LaunchError("scancel is not on this host's PATH", hint=f"cancel job {job_id} where Slurm's commands are") from None
    if done.returncode != 0:
        raise LaunchError(f"scancel {job_id} failed: {done.stderr.strip() or done.stdout.strip()}")
    return job_id


def stop_run(
    run_dir: str | os.PathLike[str],
    processes: list[RunProcess],
    *,
    stop_file: str,
    signal_after_seconds: float = 60.0,
    timeout_seconds: float = 300.0,
    poll_seconds: float = 0.05,
    include_launchers: bool = False,
) -> StopOutcome:
    """Ask the run to stop at its next step boundary and wait until its ranks are gone."""
    started = time.monotonic()
    request_stop(run_dir, stop_file)
    return wait_for_exit(
        run_dir,
        processes,
        signal_after_seconds=signal_after_seconds,
        timeout_seconds=timeout_seconds,
        poll_seconds=poll_seconds,
        started=started,
        include_launchers=include_launchers,
    )
