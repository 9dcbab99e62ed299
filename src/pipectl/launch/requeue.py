"""The last step of a Slurm job's batch script: requeue the job, or let it end.

`job.sbatch` (`launch.engines.slurm_script`) runs the ranks under srun, then

    python -m pipectl.launch.requeue --run-dir RUN --exit-code "$status"

which reads the run as the ranks left it and prints one word for the script: `finished` (every
step trained and checkpointed), `requeue` (the script runs `scontrol requeue`: the job waits in
the queue again and its ranks resume from the newest checkpoint that loads), or `stop`. What it
decided, and why, is one line of RUN/logs/requeues.jsonl (`RequeueRecord`) and one line of the
job's output (slurm-%j.out); `pipectl status` reports it.

A job stopped before its time limit, or one that failed, is requeued as long as it gets
somewhere: after `requeue_limit` requeues in a row whose ranks never got past the same checkpoint
(a job failing at the same step every time, a node that breaks every start), it stops
requeueing and says so, instead of burning the allocation in a loop. A job that keeps reaching
newer checkpoints may requeue without end: that is a long run over many time-limited starts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pipectl.artifacts.cluster import SlurmSpec
from pipectl.artifacts.run import JOB_FILE, LOGS_DIR, REQUEUE_FILE, RequeueOutcome, RequeueRecord
from pipectl.errors import PipectlError
from pipectl.launch.options import check_stored_options
from pipectl.rundir.checkpoints import RESIZE_STOP
from pipectl.rundir.status import run_status
from pipectl.words import count


def without_progress(history: Sequence[RequeueRecord], checkpoint_step: int) -> int:
    """Requeues in a row, at the end of `history`, that left the newest checkpoint at
    `checkpoint_step`: the starts that got nowhere.

    >>> r = lambda step: RequeueRecord(time_unix=0, exit_code=1, steps_done=0, checkpoint_step=step, ended="", outcome="requeued")
    >>> without_progress([r(2), r(4), r(4)], 4), without_progress([r(2), r(4)], 6)
    (2, 0)
    """
    stalled = 0
    for record in reversed(history):
        if record.outcome is not RequeueOutcome.REQUEUED or record.checkpoint_step != checkpoint_step:
            break
        stalled += 1
    return stalled


def decide(run_dir: str | os.PathLike[str], exit_code: int, limit: int, *, now: float | None = None) -> RequeueRecord:
    """What this start of the job came to, and whether to requeue it (not yet recorded)."""
    status = run_status(run_dir)
    if status.job.options:  # checked as the requeued start will take them back
        check_stored_options(status.job.options, status.path / JOB_FILE)
    checkpoint = status.checkpointed_step
    done = status.steps_done
    record = dict(
        slurm_job_id=os.environ.get("SLURM_JOB_ID", ""),
        restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        time_unix=time.time() if now is None else now,
        exit_code=exit_code,
        steps_done=done,
        checkpoint_step=checkpoint,
    )
    if status.finished:
        ended = f"trained all {status.job.steps} steps"
        return RequeueRecord(**record, ended=ended, outcome=RequeueOutcome.FINISHED)
    stopped = status.stopped
    if stopped is not None and stopped[1] == RESIZE_STOP:  # `pipectl resize` starts it again, as another job
        ended = f"stopped after step {done} with checkpoint step {stopped[0]} for pipectl resize"
        return RequeueRecord(**record, ended=ended, outcome=RequeueOutcome.STOPPED,
                             reason="pipectl resize starts the run again in its new layout")
    if stopped is not None:
        why = stopped[1] if stopped[1] and stopped[1] != "another rank" else "the time limit's signal or a pre-emption"
        ended = f"stopped after step {done} with checkpoint step {stopped[0]} ({why})"
    else:
        newest = f"newest checkpoint step {checkpoint}" if checkpoint else "no checkpoint yet"
        ended = f"failed (srun exit {exit_code}) after step {done}; {newest}"
    stalled = without_progress(status.requeues, checkpoint)
    if limit == 0:
        reason = "requeue_limit is 0: the job does not requeue itself"
    elif stalled >= limit:
        reason = (
            f"requeued {count(stalled, 'time')} in a row without getting past checkpoint step {checkpoint}: not again; "
            f"fix the cause (logs/ has each rank's record), then sbatch {Path(run_dir) / 'job.sbatch'}"
        )
    else:
        return RequeueRecord(**record, ended=ended, outcome=RequeueOutcome.REQUEUED)
    return RequeueRecord(**record, ended=ended, outcome=RequeueOutcome.STOPPED, reason=reason)


def record(run_dir: str | os.PathLike[str], entry: RequeueRecord) -> None:
    """Append `entry` to logs/requeues.jsonl (one line, flushed)."""
    logs = Path(run_dir) / LOGS_DIR
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / REQUEUE_FILE).open("a") as handle:
        handle.write(entry.model_dump_json() + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def requeue_line(entry: RequeueRecord) -> str:
    """The record in words, for the job's output and `pipectl status`."""
    if entry.outcome is RequeueOutcome.FINISHED:
        return f"pipectl: the job {entry.ended}"
    if entry.outcome is RequeueOutcome.REQUEUED:
        where = f"checkpoint step {entry.checkpoint_step}" if entry.checkpoint_step else "step 0 (no checkpoint yet)"
        return f"pipectl: the job {entry.ended}; requeued: it resumes from {where}"
    return f"pipectl: the job {entry.ended}; not requeued: {entry.reason}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipectl.launch.requeue", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--exit-code", required=True, type=int)
    parser.add_argument("--limit", type=int, default=SlurmSpec.DEFAULT_REQUEUE_LIMIT, help="slurm.requeue_limit")
    args = parser.parse_args(argv)
    try:
        entry = decide(args.run_dir, args.exit_code, args.limit)
        record(args.run_dir, entry)
    except (PipectlError, OSError) as exc:  # the run unreadable: nothing to resume from, do not loop
        print(f"pipectl: cannot decide whether to requeue: {exc}", file=sys.stderr, flush=True)
        print("stop")
        return 0
    print(requeue_line(entry), file=sys.stderr, flush=True)
    print({RequeueOutcome.FINISHED: "finished", RequeueOutcome.REQUEUED: "requeue"}.get(entry.outcome, "stop"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
