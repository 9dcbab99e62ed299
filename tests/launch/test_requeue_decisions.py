"""What a Slurm job's last step decides from why its ranks stopped (`launch.requeue.decide`): a
stop pipectl resize asked for ends the job (resize submits the new layout as another job), a
time-limit stop requeues it, each said in its own words."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipectl.artifacts.run import RankHeartbeat, RankState, RequeueOutcome
from pipectl.launch.requeue import decide
from pipectl.rundir.checkpoints import RESIZE_STOP, STOP_FILE
from pipectl.rundir.heartbeats import write_heartbeat
from pipectl.runtime.checkpoint.ranks import stop_file_reason
from cli.test_cli_status import make_run


def _stopped(run: Path, reason: str) -> None:
    now = time.time()
    for rank in (0, 1):
        write_heartbeat(run, RankHeartbeat(
            rank=rank, pid=999_999, host="here", stage=rank, step=4, phase="step", state=RankState.STOPPED,
            checkpoint_step=4, started_unix=now - 5, beat_unix=now, progress_unix=now, stop_reason=reason,
        ))  # fmt: skip


def test_a_stop_for_a_resize_ends_the_job_and_a_time_limits_requeues_it(tmp_path):
    """A running Slurm job stopped by `pipectl resize` (without --scancel) took the stop for its
    time limit and requeued itself beside the resized job: two jobs on one run."""
    run = make_run(tmp_path)
    _stopped(run, RESIZE_STOP)
    resized = decide(run, 0, limit=3)
    assert resized.outcome is RequeueOutcome.STOPPED and "for pipectl resize" in resized.ended
    _stopped(run, "time limit in 120 s (Slurm USR1)")
    timed_out = decide(run, 0, limit=3)
    assert timed_out.outcome is RequeueOutcome.REQUEUED and "(time limit in 120 s (Slurm USR1))" in timed_out.ended


@pytest.mark.parametrize("text, reason", [
    ("pipectl resize asked it to stop: requested at 1.000 by pid 7\n", RESIZE_STOP),
    ("requested at 1.000 by pid 7\n", RESIZE_STOP),  # as an earlier version's resize wrote it
    ("", RESIZE_STOP),
    ("time limit in 120 s (Slurm USR1)\n", "time limit in 120 s (Slurm USR1)"),
])
def test_the_stop_file_says_who_asked(tmp_path, text, reason):
    (tmp_path / STOP_FILE).write_text(text)
    assert stop_file_reason(tmp_path / STOP_FILE) == reason


def test_the_requeue_row_counts_only_requeues_that_happened():
    """'finished after being requeued 0 times', 'requeued 3 times, then not again: requeued 3 times
    in a row ...': said as what happened, once."""
    import tempfile

    from pipectl.artifacts.run import RequeueRecord
    from pipectl.launch.requeue import record
    from pipectl.report.run_tables import requeue_text
    from pipectl.rundir.status import run_status

    def entry(outcome, reason=""):
        return RequeueRecord(time_unix=0, exit_code=1, steps_done=0, checkpoint_step=0, ended="failed",
                             outcome=outcome, reason=reason)

    with tempfile.TemporaryDirectory() as folder:
        run = make_run(Path(folder))
        record(run, entry(RequeueOutcome.FINISHED))
        assert requeue_text(run_status(run)).plain == "finished"
    with tempfile.TemporaryDirectory() as folder:
        run = make_run(Path(folder))
        for _ in range(3):
            record(run, entry(RequeueOutcome.REQUEUED))
        record(run, entry(RequeueOutcome.STOPPED, "requeued 3 times in a row without getting past checkpoint step 0: not again"))
        assert requeue_text(run_status(run)).plain == (
            "not requeued again: requeued 3 times in a row without getting past checkpoint step 0: not again")
