"""Liveness of a job's ranks: heartbeats, the rank that went silent, and how long a collective waits.

A rank that stops (SIGSTOP, a frozen node, a driver hang) does not fail: its peers wait for it in
their next collective. Two things bound that wait and name the culprit:

- **The collective timeout.** Every process group of the job (DeepSpeed's pipeline and data
  groups included, `dsinit.init_distributed`) gets `collective_timeout_seconds`, so a rank waiting
  for a silent peer raises after that long and the launcher ends the job. The default suits the
  plan: ten predicted steps, at least two minutes, plus the time to write the rank's checkpoint
  (a rank at a barrier waits while its peers write theirs):

      timeout = max(120 s, 10 x predicted step) + peak bytes of the largest stage / 120 MB/s

  120 MB/s is a slow host's rate for writing a checkpoint (14 bytes of state per parameter: bf16
  weights, fp32 master weights, two Adam moments), so the timeout errs long rather than ending a
  job that is only saving; `benchmarks/checkpoint_cost.py` measures a host's own stall, and
  `launch --collective-timeout` overrides the default.
- **Heartbeats.** A thread of each rank rewrites logs/heartbeat-rank{R}.json every second
  (`RankHeartbeat`: step, phase, when it last progressed). Torch releases the interpreter lock while
  it computes or waits in a collective, so a blocked rank keeps beating; a stopped or frozen
  process does not. `StallWatch` (the launching process) reads the heartbeats, names a rank silent
  for `silent_after_seconds` with its process state where it runs on this host, and asks for the
  whole job to be ended when a rank has been silent past the collective timeout plus a minute (the
  peers' timeout should have ended it by then). torchrun's own "root cause" names the first rank
  that raised, which is the healthy one that timed out; the heartbeats name the one it waited for.

- **The supervisor.** `pipectl launch` (or `resize`) hands its pid to the ranks
  (`PIPECTL_SUPERVISOR_PID`); each rank looks every second, and when that process is gone (killed,
  its machine's session ended) the rank asks to stop: all ranks stop together at the next step
  boundary, after a checkpoint, rather than train on with nobody watching (`watch_supervisor`).

The last heartbeat a rank writes gives its final state: finished or stopped with a checkpoint
(`RankState`). A launcher that exits non-zero although every rank stopped cleanly (torchrun
signalled directly: it reports the signal as an error) is then told apart from a failure
(`stopped_cleanly`).

The heartbeat files themselves (their path, format and readers) are `rundir.heartbeats`; this
module imports no torch either: the launching process runs `StallWatch`.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


from pipectl.artifacts.plan import Candidate
from pipectl.artifacts.run import JobSpec, RankHeartbeat, RankState
from pipectl.rundir.heartbeats import HEARTBEAT_SECONDS, SILENT_AFTER_SECONDS, SUPERVISOR_VARIABLE, stage_and_pid, pid_alive, process_state, read_heartbeats, write_heartbeat

log = logging.getLogger(__name__)
MIN_COLLECTIVE_TIMEOUT_SECONDS = 120.0
STEPS_PER_COLLECTIVE_TIMEOUT = 10
CHECKPOINT_WRITE_BYTES_PER_SECOND = 120e6  # a slow host's checkpoint write: the timeout errs long
END_GRACE_SECONDS = 60.0  # past the collective timeout, pipectl ends the job itself


def default_collective_timeout_seconds(predicted_step_seconds: float, peak_memory_bytes: Sequence[int]) -> float:
    """The module docstring's formula.

    >>> round(default_collective_timeout_seconds(0.05, [2**20]), 1)  # a CPU toy: the floor
    120.0
    >>> round(default_collective_timeout_seconds(83.5, [60 * 2**30]))  # GPT-1T on A100-80GB
    1372
    """
    if not math.isfinite(predicted_step_seconds) or predicted_step_seconds < 0:
        predicted_step_seconds = 0.0
    checkpoint_seconds = max(peak_memory_bytes, default=0) / CHECKPOINT_WRITE_BYTES_PER_SECOND
    return max(MIN_COLLECTIVE_TIMEOUT_SECONDS, STEPS_PER_COLLECTIVE_TIMEOUT * predicted_step_seconds) + checkpoint_seconds


def job_collective_timeout_seconds(job: JobSpec, candidate: Candidate) -> float:
    """The job's own timeout if it set one, else the default for the candidate it runs."""
    if job.collective_timeout_seconds is not None:
        return job.collective_timeout_seconds
    return default_collective_timeout_seconds(candidate.predicted_step_seconds, candidate.peak_memory_bytes)


def silent_after_seconds(collective_timeout_seconds: float) -> float:
    """How long without a heartbeat makes a rank silent: 30 s, or half a shorter collective
    timeout (but at least five heartbeats), so the silent rank is known before its peers time out.

    >>> silent_after_seconds(600), silent_after_seconds(20), silent_after_seconds(4)
    (30.0, 10.0, 5.0)
    """
    return min(SILENT_AFTER_SECONDS, max(5 * HEARTBEAT_SECONDS, collective_timeout_seconds / 2))


class Heartbeat:
    """The thread that keeps logs/heartbeat-rank{R}.json current for one rank.

    `describe()` returns (stage, step, phase) of the main thread (the rank's `RankContext`); the
    beat records when that last changed. `end` writes the final state and stops the thread.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        rank: int,
        describe: Callable[[], tuple[int | None, int | None, str]],
        *,
        interval_seconds: float = HEARTBEAT_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.describe = describe
        self.interval_seconds = interval_seconds
        self.clock = clock
        self.started_unix = clock()
        self._last: tuple[int | None, int | None, str] | None = None
        self._progress_unix = self.started_unix
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one writer at a time: the thread or `end`
        self._ended = False
        self._reason = ""  # the final beat's stop reason (`end`)
        self._failed_writes = 0
        self._thread = threading.Thread(target=self._run, name=f"pipectl-heartbeat-rank{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self.beat()
        self._thread.start()
        return self

    def beat(self, state: RankState = RankState.RUNNING, checkpoint_step: int | None = None) -> None:
        with self._lock:
            if self._ended:
                return
            now = self.clock()
            stage, step, phase = self.describe()
            if (stage, step, phase) != self._last:
                self._last, self._progress_unix = (stage, step, phase), now
            record = RankHeartbeat(
                rank=self.rank,
                pid=os.getpid(),
                host=socket.gethostname(),
                stage=stage,
                step=step,
                phase=phase,
                state=state,
                checkpoint_step=checkpoint_step,
                stop_reason=self._reason,
                started_unix=self.started_unix,
                beat_unix=now,
                progress_unix=self._progress_unix,
            )
            try:
                write_heartbeat(self.run_dir, record)
            except OSError as exc:  # a full disk must not end the rank; its checkpoints say so
                self._failed_writes += 1
                if self._failed_writes == 1:
                    log.warning("cannot write the heartbeat of rank %d: %s", self.rank, exc)
            self._ended = state is not RankState.RUNNING

    def end(self, state: RankState, checkpoint_step: int | None = None, reason: str = "") -> None:
        """The final beat: finished, stopped (with the checkpoint written last, and why) or failed."""
        self._stop.set()
        self._reason = reason
        self.beat(state, checkpoint_step)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            self.beat()


@dataclass(frozen=True)
class SilentRank:
    """A rank whose heartbeat stopped while the job ran."""

    heartbeat: RankHeartbeat
    silent_seconds: float
    process: str  # what the OS says of its process, "" when it runs on another host

    def describe(self) -> str:
        """'rank 1 (stage 1, pid 4242) stopped responding: no heartbeat for 41 s, the last one in step 7
        (step); its process is stopped (SIGSTOP, or a debugger)'. The step is the last beat's: a
        beat a second, so a rank may have trained a few steps more before it went silent."""
        beat = self.heartbeat
        where = stage_and_pid(beat)
        host = f" on {beat.host}" if beat.host and beat.host != socket.gethostname() else ""
        seen = ""
        if beat.step is not None or beat.phase:
            seen = ", the last one" + (f" in step {beat.step}" if beat.step is not None else "")
            seen += f" ({beat.phase})" if beat.phase else ""
        process = f"; {self.process}" if self.process else ""
        return f"rank {beat.rank} ({where}{host}) stopped responding: no heartbeat for {self.silent_seconds:.0f} s{seen}{process}"


class StallWatch:
    """Reads the job's heartbeats while it runs (from the launching process) and keeps the ranks
    that went silent, each with how long and what its process is doing."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        since_unix: float,
        collective_timeout_seconds: float,
        check_every_seconds: float = 2.0,
        clock: Callable[[], float] = time.time,
        state_of: Callable[[RankHeartbeat], str] = process_state,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.since_unix = since_unix
        self.collective_timeout_seconds = collective_timeout_seconds
        self.silent_after = silent_after_seconds(collective_timeout_seconds)
        self.check_every_seconds = check_every_seconds
        self.clock = clock
        self.state_of = state_of
        self.heartbeats: dict[int, RankHeartbeat] = {}
        self.silent: dict[int, SilentRank] = {}
        self._checked = -math.inf

    def check(self) -> str | None:
        """Read the heartbeats (at most every `check_every_seconds`) and return a reason to end the
        job, else None: a rank silent past the collective timeout plus a minute, or a silent rank
        while another has failed (its peers timed out waiting for it; torchrun would give the
        silent one 30 s to act on a SIGTERM it cannot act on when it is stopped)."""
        now = self.clock()
        if now - self._checked < self.check_every_seconds:
            return None
        self._checked = now
        self.heartbeats = read_heartbeats(self.run_dir, since_unix=self.since_unix)
        for rank, beat in self.heartbeats.items():
            silence = now - beat.beat_unix
            if beat.state is not RankState.RUNNING or silence < self.silent_after:
                self.silent.pop(rank, None)  # ended, or it beat again (a long pause, not a stop)
            elif rank in self.silent:  # what its process was doing when it went silent stays
                self.silent[rank] = SilentRank(beat, silence, self.silent[rank].process)
            else:
                self.silent[rank] = SilentRank(beat, silence, self.state_of(beat))
        if not self.silent:
            return None
        limit = self.collective_timeout_seconds + END_GRACE_SECONDS
        if max(s.silent_seconds for s in self.silent.values()) >= limit:
            return f"a rank was silent for {limit:.0f} s (the collective timeout and a minute)"
        failed = sorted(r for r, b in self.heartbeats.items() if b.state is RankState.FAILED)
        if failed:
            return f"rank {failed[0]} failed while a rank was silent"
        return None

    def lines(self) -> list[str]:
        """One line per silent rank, the longest silent first."""
        ranked = sorted(self.silent.values(), key=lambda s: (-s.silent_seconds, s.heartbeat.rank))
        return [s.describe() for s in ranked]


def watch_supervisor(stop: Callable[[str], None], interval_seconds: float = 1.0) -> threading.Thread | None:
    """Call `stop(reason)` once the process named by `PIPECTL_SUPERVISOR_PID` has ended (a thread
    looking every `interval_seconds`); None when no supervisor is named (a launch by hand)."""
    text = os.environ.get(SUPERVISOR_VARIABLE, "")
    if not text.isdigit():
        return None
    pid = int(text)

    def watch() -> None:
        while pid_alive(pid):
            time.sleep(interval_seconds)
        reason = f"the launching pipectl (pid {pid}) ended"
        log.warning("%s: stopping at the end of the step, after a checkpoint", reason)
        stop(reason)

    thread = threading.Thread(target=watch, name="supervisor-watch", daemon=True)
    thread.start()
    return thread
