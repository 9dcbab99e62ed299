"""Running a launch command and supervising its job until it ends.

`run_engine` starts the launcher (`engines.build_command`'s argument list, no shell) with its
output in RUN/logs/engine.log and watches every process of the job until the launcher exits:
signals to pipectl become a graceful stop of the ranks (then harder ones), `on_tick` may end the
job, and ranks left behind by their launcher are ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import psutil

from pipectl.artifacts.morph import LIVE_REQUEST_FILE
from pipectl.artifacts.run import LOGS_DIR, PREVIOUS_RESUME_FILE, RESUME_FILE
from pipectl.errors import LaunchError
from pipectl.launch.engines import ENGINE_LOG, LaunchCommand
from pipectl.rundir.heartbeats import SUPERVISOR_VARIABLE
from pipectl.rundir.processes import JobProcesses
from pipectl.words import count

KILL_AFTER_SECONDS = 10.0  # after a second Ctrl-C / SIGTERM to pipectl
# SIGHUP: the terminal closed. The launcher runs in a session of its own, so only this process
# hears it; handled as SIGTERM, the job stops at the step's end with a checkpoint instead of
# training on unsupervised.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_engine(
    command: LaunchCommand,
    run_dir: Path,
    *,
    on_tick: Callable[[], str | None] | None = None,
    tick_seconds: float = 0.5,
    timeout_seconds: float | None = None,
    lock: Any = None,
    say: Callable[[str], None] | None = None,
    signals: list[int] | None = None,
    held: list[int] | None = None,
) -> int:
    """Run the launcher, its output in RUN/logs/engine.log; return its exit code.

    `lock`, the run's `RunLock`, is shared with the launcher (its descriptor is inherited), so the
    run stays locked while the launcher lives even if this process is killed; the launcher's pid
    is recorded beside this one's.

    The launcher gets its own process group, and every process of the job is tracked
    (`JobProcesses`: torchrun starts ranks in sessions of their own). A first SIGINT/SIGTERM sent
    to pipectl becomes SIGTERM to the ranks (they finish the step, checkpoint and exit 0); a second
    one ends every process of the job (SIGTERM, then SIGKILL `KILL_AFTER_SECONDS` later), a third
    kills them now.
    `say` is told what each signal does, and `signals` (when given) gets each one received, so
    that the caller can tell a job its user stopped from one that failed. `held` is the list of a
    caller's `signals_held` block: a signal held there before the launcher started is acted on as
    soon as the job is supervised. `on_tick` is called
    every `tick_seconds` while the job runs (the CLI tails metrics.jsonl and watches heartbeats
    there); when it returns a reason, the job is ended and `JobEnded` raised. Past `timeout_seconds` the job is ended and a `LaunchError`
    raised. Ranks still alive after their launcher exited are ended too.
    """
    if not command.runnable_here:
        raise LaunchError(f"the {command.engine.value} engine is not run by pipectl; {command.submit_hint}")
    logs = Path(run_dir) / LOGS_DIR
    logs.mkdir(parents=True, exist_ok=True)
    # Where a job resumed is its own record: the previous job's, written maybe a moment ago, must
    # not be taken for it (the readers' time filter allows for clock skew between nodes). It is kept
    # aside: which steps a resume abandoned stays known if this start dies before its own record.
    if (logs / RESUME_FILE).is_file():
        os.replace(logs / RESUME_FILE, logs / PREVIOUS_RESUME_FILE)
    # A live resize asked of an earlier job is not this job's to take (`runtime/elastic/live_resize.py`).
    (Path(run_dir) / LIVE_REQUEST_FILE).unlink(missing_ok=True)
    # The ranks watch this process: gone (kill -9, a lost session), they stop at a checkpoint.
    env = {**os.environ, **command.env, SUPERVISOR_VARIABLE: str(os.getpid())}
    # A signal before the job is supervised (Ctrl-C as the launcher starts) is held, then acted on
    # as soon as it is: never a KeyboardInterrupt that leaves the launcher running on its own.
    with signals_held(held) as early:
        try:
            proc = start_detached(command.argv, cwd=run_dir, env=env, log=logs / ENGINE_LOG,
                                  pass_fds=(lock.fileno(),) if lock is not None else ())  # fmt: skip
        except OSError as exc:
            raise LaunchError(f"cannot start {command.argv[0]}: {exc}") from exc
        if lock is not None:
            lock.record(os.getpid(), proc.pid)
        return _supervise(
            JobProcesses(proc), on_tick, tick_seconds, timeout_seconds, say or (lambda _: None),
            [] if signals is None else signals, early,
        )  # fmt: skip


@contextmanager
def signals_held(held: list[int] | None = None) -> Iterator[list[int]]:
    """A block no Ctrl-C may cut in two (a run directory rewritten for a new layout, then its job
    started): SIGINT, SIGTERM and SIGHUP are recorded in the list yielded (`held`, when given: an
    outer block's, which goes on filling) instead of raising, for the block to act on (pass it to
    `run_engine` as `held`). Off the main thread, where no handler can be set, nothing is held."""
    held = [] if held is None else held
    originals = _handled_by(lambda signum, _frame: held.append(signum))
    try:
        yield held
    finally:
        _restore(originals)


@contextmanager
def signals_interrupt() -> Iterator[list[int]]:
    """A block that undoes what it began when a Ctrl-C interrupts it (a resize withdrawing its stop
    request): SIGTERM and SIGHUP (a `kill`, a closed terminal) interrupt it too, as KeyboardInterrupt,
    instead of ending the process on the spot with the undoing left undone. The list yielded gets the
    signal that interrupted. Blocks inside may hold signals their own way (`signals_held`,
    `run_engine`). Off the main thread nothing changes."""
    seen: list[int] = []

    def interrupt(signum: int, _frame: object) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    originals = _handled_by(interrupt)
    try:
        yield seen
    finally:
        _restore(originals)


def _handled_by(handler: Callable[[int, Any], None]) -> dict[int, Any]:
    """`handler` set for each of `FORWARDED_SIGNALS` that the process does not ignore; the handlers
    it replaced. One ignored stays ignored: `nohup pipectl ...` ignores SIGHUP, and the command is
    to outlive its terminal. Off the main thread, where no handler can be set, nothing."""
    if not _in_main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in FORWARDED_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}


def _restore(originals: dict[int, Any]) -> None:
    for signum, handler in originals.items():
        signal.signal(signum, handler)


def start_detached(
    argv: list[str], *, cwd: str | os.PathLike[str], env: dict[str, str], log: Path, pass_fds: tuple[int, ...] = ()
) -> subprocess.Popen:
    """A job's process (the launcher, or a rank joining a live resize) in a session of its own, so
    that a Ctrl-C at the terminal reaches pipectl alone, which decides what the job is told; no
    stdin; its output appended to `log`, which outlives it."""
    with log.open("ab") as handle:
        return subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True, pass_fds=pass_fds,
        )  # fmt: skip


class JobEnded(LaunchError):
    """pipectl ended the job (`on_tick` gave the reason, e.g. a rank silent for too long)."""


class TimedOut(JobEnded):
    """The job ran past the `--timeout` it was given and was stopped as a stop request is (the
    ranks checkpoint first): what was asked for, not a failure, when every rank stopped cleanly."""


def _supervise(
    processes: JobProcesses,
    on_tick: Callable[[], str | None] | None,
    tick_seconds: float,
    timeout_seconds: float | None,
    say: Callable[[str], None],
    signals_seen: list[int],
    early: list[int],
) -> int:
    proc = processes.launcher
    kill_at = []  # after a second signal: when the processes still alive get SIGKILL

    def forward(signum: int, _frame: object) -> None:
        if signum == signal.SIGHUP:
            _detach_from_terminal()  # what is printed from now on would fail on a closed terminal
        signals_seen.append(signum)
        if len(signals_seen) == 1:
            say("stopping at the end of the step, after a checkpoint (again: end every process of the job)")
            processes.stop_gracefully()
        elif len(signals_seen) == 2:
            say(f"ending every process of the job: SIGTERM, SIGKILL in {KILL_AFTER_SECONDS:.0f} s (again: now)")
            processes.signal(processes.alive(), signal.SIGTERM)
            kill_at.append(time.monotonic() + KILL_AFTER_SECONDS)
        else:
            processes.signal(processes.alive(), signal.SIGKILL)

    previous = _handled_by(forward)
    for signum in early:  # received while the launcher started
        forward(signum, None)
    deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
    try:
        while proc.poll() is None:
            processes.refresh()
            if kill_at and time.monotonic() > kill_at[0]:
                processes.signal(processes.alive(), signal.SIGKILL)
            reason = on_tick() if on_tick is not None else None
            if reason:
                processes.end()
                raise JobEnded(reason)
            if deadline is not None and time.monotonic() > deadline:
                processes.end(grace_seconds=30)  # as a stop request: the ranks checkpoint first
                raise TimedOut(f"it ran past its --timeout of {timeout_seconds:.0f} s")
            try:
                proc.wait(timeout=tick_seconds)
            except subprocess.TimeoutExpired:
                pass
        if on_tick is not None:
            on_tick()
        left = processes.alive()
        if left:
            # Ranks that outlived their launcher would hold their devices: said, and ended. A rank's
            # own helpers (W&B's service and system monitor, which outlive rank 0 by seconds) are
            # ended without a word: the rank that started them has finished with them.
            ranks = processes.workers()
            if ranks:
                say(f"ending {count(len(ranks), 'rank')} the launcher left behind: {', '.join(map(_named_pid, ranks))}")
            processes.end()
        return int(proc.returncode)
    finally:
        if proc.poll() is None:  # an exception (e.g. from on_tick): do not leave ranks behind
            processes.end(grace_seconds=30)
        _restore(previous)


def _named_pid(process: psutil.Process) -> str:
    """'pid 123 (wandb-core)': which process, for the person reading why it was ended."""
    try:
        return f"pid {process.pid} ({process.name()})"
    except psutil.Error:
        return f"pid {process.pid}"


def _detach_from_terminal() -> None:
    """Point stdout and stderr at /dev/null: the terminal is gone, and a write to it would raise
    in the middle of supervising the job."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(null, fd)
    finally:
        os.close(null)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
