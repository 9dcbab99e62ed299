"""The replicas agent's bookkeeping (`resize/replicas.py`), with stand-ins for its torchruns that
exit with a given code at a given time: what it recovers, when a recovery counts as done, what it
puts back when one fails, and its exit code. The real kill -9 runs are test_replica_recovery.py."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from pipectl.artifacts.morph import MorphRecord, MorphTrigger
from pipectl.resize.replicas import Agent
from pipectl.rundir.morph_history import append_record

REQUESTED = 123.0


class Torchrun:
    """Exits with `code` `after` seconds from its start (or at once when signalled, if `stops`)."""

    def __init__(self, code: int, after: float) -> None:
        self.code, self.at = code, time.monotonic() + after
        self.signals: list[int] = []

    def poll(self):
        return self.code if time.monotonic() >= self.at else None

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)
        self.code, self.at = -signum, time.monotonic()

    def wait(self):
        return self.code


def agent(run: Path, torchruns: dict[int, Torchrun]) -> Agent:
    (run / "logs").mkdir(parents=True, exist_ok=True)
    made = Agent.__new__(Agent)
    made.run_dir, made.replicas, made.per_replica, made.world = run, len(torchruns), 1, len(torchruns)
    made.started_unix, made.codes, made.recovered = time.time(), {}, set()
    made.pending, made.stopping, made.running = None, False, dict(torchruns)
    attempts = []

    def ask_survivors(lost: set[int]) -> None:  # what it leaves behind: files rewritten, the request pending
        attempts.append(sorted(lost))
        (run / "job.json").write_text("rewritten for the survivors")
        made.recovered |= lost
        made.pending = (REQUESTED, {"job.json": b"as launched"})

    made._ask_survivors = ask_survivors
    made.attempts = attempts
    return made


def morph_done(run: Path) -> None:
    append_record(run, MorphRecord(
        trigger=MorphTrigger.FAILURE, requested_unix=REQUESTED, requested_devices=1, from_devices=2, from_layout="a",
        to_devices=1, to_layout="b", global_batch=8, resume_step=2, target_steps=6, stopped_running_job=False,
        plan_source="morph-table", path="live",
    ))  # fmt: skip


def test_a_recovered_replica_does_not_fail_the_job_once_the_survivors_took_over(tmp_path):
    made = agent(tmp_path, {0: Torchrun(0, 0.8), 1: Torchrun(137, 0.05)})
    morph_done(tmp_path)  # rank 0 records the morph after the first step on the new layout
    assert made.wait() == 0
    assert made.attempts == [[1]] and (tmp_path / "job.json").read_text() == "rewritten for the survivors"


def test_a_survivor_failing_before_it_took_over_fails_the_job_and_puts_the_run_back(tmp_path):
    made = agent(tmp_path, {0: Torchrun(1, 0.8), 1: Torchrun(137, 0.05)})
    assert made.wait() == 1
    assert (tmp_path / "job.json").read_bytes() == b"as launched"
    record = json.loads((tmp_path / "logs" / "recovery.json").read_text())
    assert not record["recovered"] and "before the survivors took over" in record["reason"]


def test_a_survivor_failing_after_it_took_over_fails_the_job(tmp_path):
    made = agent(tmp_path, {0: Torchrun(1, 0.8), 1: Torchrun(137, 0.05)})
    morph_done(tmp_path)
    assert made.wait() == 1  # replica 1's loss was recovered, replica 0's failure is the job's
    assert made.attempts == [[1]]  # ... and not taken for a second loss to recover from


def test_torchruns_ended_by_a_stop_are_not_lost_replicas(tmp_path):
    made = agent(tmp_path, {0: Torchrun(0, 60), 1: Torchrun(0, 60)})
    made.signal(signal.SIGTERM)  # pipectl launch ending the job: the agent passes it on
    assert made.wait() == 1 and made.attempts == []
    assert not (tmp_path / "logs" / "recovery.json").exists()
