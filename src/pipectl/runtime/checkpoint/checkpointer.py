"""Continuous checkpointing that keeps up with training: a pause for a copy, the rest in the background.

At a checkpoint step every rank (collectively, at the step boundary):

1. waits for its previous save's file to be written (the host buffers are reused). A save asked
   for with `defer=True` (every checkpoint but the last) waits at most `DEFER_AFTER_SECONDS`; if
   any rank's write is still running then, the checkpoint is taken at the first step boundary
   after it ends (`deferred`), so a disk slower than the checkpoints are asked for costs
   checkpoints, not training time;
2. copies its state into reused host buffers (`snapshot.HostSnapshot`): the only pause. On a
   GPU the copies are only enqueued, on a side stream, and run beside the next step's forward and
   backward; that step's optimizer update waits for them (`executor.wait_for_snapshot`);
3. learns from rank 0 whether the checkpoint fits on disk (one gather, one broadcast: rank 0 adds
   the ranks' sizes, removes old checkpoints if that makes room, but never the newest good one,
   and skips the save when it still cannot fit: training goes on, and `status` says so);
4. hands the snapshot to a background thread, and trains on.

The thread writes the rank's file into `.staging/WRITER/TAG/`, fsyncs and hashes it, and reports
(`TAG.reports/rank-NNNNN.json`: its sha256 and size, or why it failed). Rank 0's thread then waits
for every rank's report (no longer once a rank of this host has ended without one) and commits:
the manifest, listing every file with its hash, is the staged folder's last file; the folder is
renamed into place, then `latest` moves; old checkpoints beyond `keep` are removed. A checkpoint
is committed whole or not at all: a rank killed mid-write leaves a staging folder that nothing
loads and the next job removes; a job that dies after every rank reported but before the rename
leaves one the next job commits (`recover_staged`).

Each outcome is one line of `logs/checkpoints.jsonl` (`CheckpointEvent`): committed, failed (a
rank's write or the commit failed), or skipped (no room). `finish` waits for the last save and
tells every rank whether it committed, so a run whose final checkpoint failed exits non-zero.

    saver = Checkpointer(run_dir, keep=3, layout=layout)
    saver.save(engine, step=100, data_position={"step": 100})    # pauses ~ a host copy
    saver.finish()                                               # at the end: waits, checks
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from pipectl.artifacts.layout import Layout
from pipectl.artifacts.run import CheckpointEvent, CheckpointOutcome
from pipectl.errors import CheckpointError
from pipectl.io import write_json_atomic
from pipectl.rundir.checkpoints import STAGING_DIR, remove_dead_writers, checkpoints_dir, commit_tag, has_checkpoint, list_checkpoints, manifest_from_reports, prune_checkpoints, read_reports, recover_staged, report_path, reports_dir, record_event, tag_for_step
from pipectl.rundir.heartbeats import HEARTBEAT_SECONDS, vanished_line, vanished_ranks
from pipectl.runtime.checkpoint.ranks import all_gather_from_ranks, broadcast_from_rank0, rank_and_world, save_failure_message
from pipectl.runtime.checkpoint.schedule import CheckpointSchedule
from pipectl.runtime.checkpoint.snapshot import HostSnapshot, Snapshot
from pipectl.artifacts.run import rank_file_name
from pipectl.runtime.checkpoint.shards import write_rank_file

log = logging.getLogger(__name__)


# Left free beside a checkpoint (logs, metrics lines, the manifest and its commit): a quarter of
# the checkpoint, at least 1 MiB and at most 256 MiB. A fixed 256 MiB skipped every checkpoint of a
# small model on a small disk that had room for several.
FREE_SPACE_RESERVE_BYTES = 256 << 20
MIN_FREE_SPACE_RESERVE_BYTES = 1 << 20


def free_space_reserve(needed_bytes: int) -> int:
    """Bytes to keep free beside a checkpoint of `needed_bytes`.

    >>> free_space_reserve(4 << 20) >> 20, free_space_reserve(100 << 30) >> 20
    (1, 256)
    """
    return min(FREE_SPACE_RESERVE_BYTES, max(MIN_FREE_SPACE_RESERVE_BYTES, needed_bytes // 4))


REPORT_POLL_SECONDS = 0.05

# How long a due checkpoint waits for the previous one's write before it is deferred. CheckFreq
# (Mohan et al., FAST '21) pipelines the snapshot and the write and picks the interval so the write
# ends before the next snapshot; here the interval is the user's, so when the disk cannot keep up
# the snapshot moves instead of training stopping. On one H200 a 0.51 B GPT checkpointed every
# 4 steps on a 1 GB/s disk paused 4.6 s at a stall (benchmarks/results/gpu-h200.json).
DEFER_AFTER_SECONDS = 0.2
DEFAULT_COMMIT_TIMEOUT_SECONDS = 1800.0  # torch's own collective default: how long rank 0 waits for reports


@dataclass
class _Save:
    step: int
    staged: Path
    stall_seconds: float
    started: float
    data_position: dict[str, int]
    interval_seconds: float | None = None
    due_step: int | None = None  # the step it was due at, when it was deferred
    thread: threading.Thread | None = None  # the background writer of this save
    event: CheckpointEvent | None = None  # rank 0: set by the thread when it has decided
    # This rank's file is written (or failed): the host buffers may take the next snapshot while
    # rank 0 still commits this one.
    written: threading.Event = field(default_factory=threading.Event)
    previous: threading.Thread | None = None  # the save before: finished before this one commits
    judged: bool = False  # rank 0: its failure was weighed against the checkpoints (`unrecoverable`)


class Checkpointer:
    """One rank's checkpointing for one job. Create it on every rank after the process group."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        keep: int,
        layout: Layout | None = None,
        commit_timeout_seconds: float = DEFAULT_COMMIT_TIMEOUT_SECONDS,
        schedule: CheckpointSchedule | None = None,
        train_without_checkpoints: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        # Without it a job whose first checkpoint finds no room stops there (`save`).
        self.train_without_checkpoints = train_without_checkpoints
        self.schedule = schedule or CheckpointSchedule()
        self.root = checkpoints_dir(run_dir)
        self.keep = keep
        self.layout = layout
        self.commit_timeout_seconds = commit_timeout_seconds
        self.rank, self.world_size = rank_and_world()
        self.host = HostSnapshot()
        self._inflight: _Save | None = None
        self._last: _Save | None = None
        self._skipped: str | None = None  # why the latest save was skipped, until the next one
        self.deferred: int | None = None  # the step a checkpoint was due at, while a write held it back
        self.abandoned = False  # a replica was lost: a save in flight will never have every report
        self.lost: str | None = None  # rank 0: a save failed with no checkpoint to fall back on (`unrecoverable`)
        writer = None
        if self.rank == 0:
            recover_staged(run_dir)  # saves a job that died had written whole but not committed
            remove_dead_writers(self.root / STAGING_DIR)  # the rest of what dead jobs left
            writer = self.root / STAGING_DIR / f"w{os.getpid()}-{secrets.token_hex(4)}"
            writer.mkdir(parents=True)
        # Rank 0's clean-up comes before any rank's write: the broadcast orders them.
        self.writer = Path(broadcast_from_rank0(str(writer)))

    # ----------------------------------------------------------------- the training loop's side

    def prepare(self, engine: Any) -> None:
        """Allocate and touch the host buffers at start-up instead of in the first checkpoint's
        pause. (Measured for 440 MiB on CPU: the first pause was 0.20 s without this and 0.17 s
        with it, the later ones 0.04 s; the first checkpoint step's extra wall time 1.17 s without
        and 0.62 s with, one run each, with step jitter of +-0.3 s.)"""
        self.host.capture(engine, 0, {})

    def ready(self, engine: Any) -> None:
        """After a session's first optimizer step: the buffers of the optimizer state that step
        created (`HostSnapshot.covers`), before any checkpoint pause needs them."""
        if not self.host.covers(engine):
            self.host.capture(engine, 0, {})

    def save(self, engine: Any, step: int, data_position: dict[str, int], *, defer: bool = False) -> float | None:
        """Checkpoint `engine` after `step` optimizer steps; returns the seconds training paused.
        Every rank, at a step boundary. With `defer`, None when a rank's previous write is still
        running (`deferred` then holds the step it was due at): call again at the next boundary."""
        started = time.perf_counter()
        if defer and self._writing(wait=self.deferred is None):
            if self.deferred is None:
                self.deferred = step
                log.warning(
                    f"checkpoint due at step {step} waits for checkpoint step {self._inflight.step} to be written; "
                    "training goes on, and it is taken at the first step boundary after (checkpoint less often "
                    "to keep the schedule)"
                )
            return None
        due_step, self.deferred = self.deferred, None
        previous = self._inflight
        if previous is not None:
            previous.written.wait()
            self._last, self._inflight = previous, None
        # A GPU rank's copies run on a side stream through the next step's forward and backward;
        # the engine's next optimizer step waits for them (`executor.wait_for_snapshot`), the
        # writer too. An engine without that gate copies in the pause.
        overlap = hasattr(engine, "snapshot_copied")
        snapshot = self.host.capture(engine, step, data_position, overlap=overlap)
        if snapshot.copied is not None:
            engine.snapshot_copied = snapshot.copied
        skipped, intact = self._room_for(step, snapshot.bytes)
        stall = time.perf_counter() - started
        self.schedule.saved(stall)
        if skipped is not None and not intact and not self.train_without_checkpoints:
            # Nothing to resume from, and no room to make it: every further step would be lost
            # with the job. Stopped now, on every rank alike (the verdict was broadcast).
            raise CheckpointError(
                f"{skipped}: stopped after step {step}, since no step trained from here could be resumed",
                hint="free space (or give the run a larger disk) and launch again with --force; "
                "--train-without-checkpoints trains on regardless",
            )
        skipped = None if skipped is None else f"{skipped}; training goes on"
        self._skipped = skipped
        if skipped is not None:
            log.warning(skipped)
            if self.rank == 0:
                self._record(CheckpointEvent(step=step, outcome=CheckpointOutcome.SKIPPED, message=skipped,
                                             stall_seconds=stall, time_unix=time.time()))  # fmt: skip
            return stall
        staged = self.writer / tag_for_step(step)
        save = _Save(step, staged, stall, started, dict(data_position), self.schedule.interval_seconds(), due_step)
        save.previous = previous.thread if previous is not None else None
        save.thread = threading.Thread(
            target=self._write, args=(save, snapshot), name=f"checkpoint-{step}", daemon=True
        )
        save.thread.start()
        self._inflight = save
        return stall

    def unrecoverable(self) -> str | None:
        """Rank 0, at a step boundary: why the run should stop now, when a save has failed and the
        run has no checkpoint to fall back on (every step trained from here would be lost with the
        job, as when the first checkpoint finds no room: `save`); None otherwise, and always with
        `train_without_checkpoints`. The caller stops every rank through the boundary's vote."""
        if self.rank != 0 or self.train_without_checkpoints or self.lost is not None:
            return None
        for save in (self._last, self._inflight):
            event = save.event if save is not None and not save.judged else None
            if event is None or event.outcome is not CheckpointOutcome.FAILED:
                continue
            save.judged = True  # the checkpoints are listed once per failed save, not at every step
            if not has_checkpoint(self.run_dir):
                self.lost = event.message
                return self.lost
        return None

    def finish(self) -> CheckpointEvent | None:
        """Wait for the save in flight; every rank learns whether the last save committed. Raises
        `CheckpointError` on every rank when it did not, unless the run trains without checkpoints
        (then it is said, and the job ends as trained). Collective."""
        self._join()
        last = self._last
        verdict = self._skipped
        if verdict is None and self.rank == 0 and last is not None:
            if last.event is None:
                verdict = f"checkpoint step {last.step}: its writer ended without a verdict (see the log)"
            elif last.event.outcome is not CheckpointOutcome.COMMITTED:
                verdict = last.event.message
        if verdict is not None and self.lost is not None and last is not None:
            verdict = f"stopped after step {last.step}, since no step trained from here could be resumed: {self.lost}"
        verdict = broadcast_from_rank0(verdict)
        if self.rank == 0:  # nothing of this job's saves is left to write
            shutil.rmtree(self.writer, ignore_errors=True)
        if verdict is not None and self.train_without_checkpoints:
            log.warning("%s; the run trained without checkpoints, as asked", verdict)
        elif verdict is not None:
            raise CheckpointError(verdict, hint=_SAVE_HINT)
        return last.event if last is not None else None

    def abandon(self) -> None:
        """The layout is gone (a replica was lost): a save in flight stops waiting for reports that
        will not come, its staged files are removed, and it is not recorded as a failed checkpoint."""
        self.abandoned = True

    def _join(self) -> None:
        if self._inflight is not None:
            self._inflight.thread.join()  # which joined the saves before it
            self._last, self._inflight = self._inflight, None

    def _writing(self, wait: bool) -> bool:
        """Whether any rank's previous save is still writing its file (after waiting up to
        `DEFER_AFTER_SECONDS` for it, with `wait`); the same answer on every rank. Collective."""
        busy = self._inflight is not None and not self._inflight.written.wait(DEFER_AFTER_SECONDS if wait else 0.0)
        return any(all_gather_from_ranks(busy))

    # ----------------------------------------------------------------- disk space (collective)

    def _room_for(self, step: int, rank_bytes: int) -> tuple[str | None, bool]:
        """(None, _) when the checkpoint fits (after removing old ones if needed), else (why it is
        skipped, whether an earlier checkpoint is intact), the same on every rank."""
        import torch.distributed as dist

        sizes = [rank_bytes]
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            sizes = [0] * self.world_size
            dist.all_gather_object(sizes, rank_bytes)
        verdict: tuple[str | None, bool] = (None, True)
        if self.rank == 0:
            verdict = make_room(self.run_dir, sum(sizes), step)
        return broadcast_from_rank0(verdict)

    # ----------------------------------------------------------------- the background thread

    def _write(self, save: _Save, snapshot: Snapshot) -> None:
        _yield_to_training()
        report: dict[str, Any] = {"rank": self.rank, "world_size": self.world_size, "step": save.step}
        try:
            if self.rank == 0:  # what the manifest takes from rank 0
                report.update(
                    layout=TypeAdapter(Layout).dump_python(self.layout, mode="json") if self.layout else None,
                    data_position=save.data_position,
                    stall_seconds=save.stall_seconds,
                )
            save.staged.mkdir(parents=True, exist_ok=True)
            name = rank_file_name(self.rank)
            snapshot.wait()  # a GPU rank's copies, still on their side stream
            written = write_rank_file(save.staged / name, snapshot.tensors, snapshot.header)
            report.update(file=name, sha256=written.sha256, bytes=written.size)
        except Exception as exc:  # a full disk, a size limit, a folder made read-only: said plainly
            log.debug("writing the rank file failed", exc_info=True)
            report["error"] = f"rank {self.rank}: " + save_failure_message(exc, self.run_dir, save.step)
            log.error(report["error"])
        finally:
            save.written.set()
        try:
            write_json_atomic(report_path(save.staged, self.rank), report)
        except Exception:  # rank 0 will time out waiting for it and say which rank never reported
            log.exception("could not write the checkpoint report")
        if save.previous is not None:  # commits (and `latest`) move in step order
            save.previous.join()
        if self.rank == 0:
            try:
                save.event = self._commit(save)
            except Exception as exc:  # never a silent thread death: the run must not think it saved
                log.exception(f"checkpoint step {save.step} failed")
                save.event = CheckpointEvent(step=save.step, outcome=CheckpointOutcome.FAILED,
                                             message=f"checkpoint step {save.step} failed: {exc}",
                                             stall_seconds=save.stall_seconds, time_unix=time.time())  # fmt: skip
            if not self.abandoned:
                self._record(save.event)

    def _commit(self, save: _Save) -> CheckpointEvent:
        """Rank 0: wait for every report, then commit, or remove the staged files and say why."""
        step, staged = save.step, save.staged
        reports = reports_dir(staged)
        deadline = time.monotonic() + self.commit_timeout_seconds
        found = read_reports(staged)
        message = ""
        look_for_vanished = time.monotonic() + HEARTBEAT_SECONDS
        while len(found) < self.world_size:
            if self.abandoned:
                message = f"checkpoint step {step}: abandoned, its layout was lost"
                break
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(found))
                message = f"checkpoint step {step}: ranks {missing} never reported their files"
                break
            if time.monotonic() > look_for_vanished:
                # A rank of this host killed before it reported never will: end the wait now, not
                # at the timeout (its launcher gives the ranks left 30 s to act on a SIGTERM, then
                # kills them; this rank would still be waiting here).
                look_for_vanished = time.monotonic() + HEARTBEAT_SECONDS
                gone = [beat for beat in vanished_ranks(self.run_dir) if beat.rank not in found and beat.rank < self.world_size]
                if gone:
                    message = f"checkpoint step {step} was not committed: " + "; ".join(map(vanished_line, gone))
                    break
            time.sleep(REPORT_POLL_SECONDS)
            found = read_reports(staged)
        errors = [report["error"] for report in found.values() if "error" in report]
        if errors:
            message = ranks_alike(errors)
        manifest = None
        if not message:
            try:
                manifest = manifest_from_reports(
                    tag_for_step(step), found, time_unix=time.time(), save_seconds=time.perf_counter() - save.started
                )
                commit_tag(self.root, staged, tag_for_step(step), manifest)
                shutil.rmtree(reports, ignore_errors=True)
                prune_checkpoints(self.run_dir, self.keep)
            except Exception as exc:
                log.exception(f"committing checkpoint step {step} failed")
                message = f"committing checkpoint step {step} failed: " + save_failure_message(exc, self.run_dir, step)
        write_seconds = time.perf_counter() - save.started - save.stall_seconds
        if message:
            shutil.rmtree(staged, ignore_errors=True)
            shutil.rmtree(reports, ignore_errors=True)
            log.error(message)
            return CheckpointEvent(step=step, outcome=CheckpointOutcome.FAILED, message=message,
                                   stall_seconds=save.stall_seconds, write_seconds=write_seconds,
                                   time_unix=time.time())  # fmt: skip
        return CheckpointEvent(step=step, outcome=CheckpointOutcome.COMMITTED, stall_seconds=save.stall_seconds,
                               write_seconds=write_seconds, bytes=manifest.bytes, interval_seconds=save.interval_seconds,
                               due_step=save.due_step, time_unix=time.time())  # fmt: skip

    def _record(self, event: CheckpointEvent) -> None:
        try:
            record_event(self.run_dir, event)
        except OSError:
            log.exception("could not record the checkpoint's outcome")


WRITER_NICENESS = 10


def _yield_to_training() -> None:
    """Lower this thread's CPU priority (Linux schedules threads one by one): where the writer and
    the training loop compete for a core, training goes first and the write takes longer."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
    except (OSError, AttributeError):  # not permitted, or not Linux: the write simply competes
        pass


_SAVE_HINT = "free space or fix the folder's permissions, then continue with pipectl launch --resume"


def make_room(run_dir: str | os.PathLike[str], needed_bytes: int, step: int) -> tuple[str | None, bool]:
    """Rank 0, before a save: (None, _) when `needed_bytes` fit beside a reserve
    (`free_space_reserve`), removing the oldest committed checkpoints if that makes room (never
    the newest verified one); else (why not, whether an earlier checkpoint is intact)."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    reserve = free_space_reserve(needed_bytes)

    def free() -> int:
        return shutil.disk_usage(root).free

    if free() >= needed_bytes + reserve:
        return None, True
    good = [info for info in list_checkpoints(run_dir) if info.verified]
    for info in good[:-1]:  # oldest first; the newest good one stays
        shutil.rmtree(info.path, ignore_errors=True)
        log.warning(f"removed checkpoint step {info.step} to make room for checkpoint step {step}")
        if free() >= needed_bytes + reserve:
            return None, True
    intact = f"checkpoint step {good[-1].step} is intact" if good else "the run has no earlier checkpoint"
    return (
        f"checkpoint step {step} skipped: it needs {_size(needed_bytes)} and {root} has {_size(free())} free "
        f"(keeping {_size(reserve)} spare); {intact}",
        bool(good),
    )


def _size(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def ranks_alike(errors: list[str]) -> str:
    """Per-rank errors ('rank 0: X') joined, the ranks that failed alike named once: a full disk or
    a file-size limit fails every rank with one reason, which the terminal should read once.

    >>> ranks_alike(["rank 0: disk full", "rank 1: disk full", "rank 2: killed"])
    'ranks 0, 1: disk full; rank 2: killed'
    """
    by_reason: dict[str, list[str]] = {}
    for error in errors:
        who, _, reason = error.partition(": ")
        by_reason.setdefault(reason, []).append(who.removeprefix("rank "))
    return "; ".join(
        f"rank {ranks[0]}: {reason}" if len(ranks) == 1 else f"ranks {', '.join(ranks)}: {reason}"
        for reason, ranks in by_reason.items()
    )
