"""Heartbeats, silent ranks and the collective timeout (`runtime/liveness.py`): no training processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pipectl.artifacts.run import JobSpec, RankHeartbeat, RankState
from pipectl.runtime.liveness import END_GRACE_SECONDS, Heartbeat, StallWatch, default_collective_timeout_seconds, job_collective_timeout_seconds, silent_after_seconds
from pipectl.rundir.heartbeats import heartbeat_path, process_state, read_heartbeats, stopped_cleanly, write_heartbeat
from builders import gpt_tiny_candidate


def beat(rank: int, at: float, *, state=RankState.RUNNING, step=3, started=100.0, pid=None, host=None, **fields):
    import socket

    return RankHeartbeat(
        rank=rank, pid=pid or 1000 + rank, host=host if host is not None else socket.gethostname(), stage=rank,
        step=step, phase="training", state=state, started_unix=started, beat_unix=at, progress_unix=at, **fields,
    )  # fmt: skip


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_default_timeout_grows_with_the_step_and_the_checkpoint_and_has_a_floor():
    assert default_collective_timeout_seconds(0.05, [1]) == pytest.approx(120.0, abs=0.01)
    assert default_collective_timeout_seconds(30.0, [0]) == 300.0  # ten steps
    with_checkpoint = default_collective_timeout_seconds(30.0, [12 * 10**9, 6 * 10**9])
    assert with_checkpoint == pytest.approx(300.0 + 100.0)  # the largest stage's bytes at 120 MB/s
    assert default_collective_timeout_seconds(float("nan"), []) == 120.0


def test_a_job_that_sets_its_timeout_keeps_it_and_a_plan_gives_the_default():
    chosen = gpt_tiny_candidate().model_copy(update={"predicted_step_seconds": 40.0})
    job = JobSpec(name="r", model="gpt-tiny", steps=2, world_size=2, ranks_per_node=2, master_port=29500)
    expected = default_collective_timeout_seconds(40.0, chosen.peak_memory_bytes)
    assert job_collective_timeout_seconds(job, chosen) == expected and expected > 400.0
    assert job_collective_timeout_seconds(job.model_copy(update={"collective_timeout_seconds": 9.0}), chosen) == 9.0


def test_a_heartbeat_moves_its_progress_only_when_the_rank_does_and_ends_with_its_state(tmp_path):
    clock = Clock(100.0)
    doing = {"now": (0, 1, "training")}
    heartbeat = Heartbeat(tmp_path, 3, lambda: doing["now"], interval_seconds=3600, clock=clock).start()
    clock.now = 105.0
    heartbeat.beat()  # same step and phase: alive, no progress
    first = read_heartbeats(tmp_path)[3]
    assert (first.beat_unix, first.progress_unix, first.pid, first.state) == (105.0, 100.0, os.getpid(), RankState.RUNNING)
    clock.now, doing["now"] = 107.0, (0, 2, "training")
    heartbeat.beat()
    assert read_heartbeats(tmp_path)[3].progress_unix == 107.0
    clock.now = 110.0
    heartbeat.end(RankState.STOPPED, checkpoint_step=2)
    heartbeat.beat()  # after the end nothing more is written
    last = read_heartbeats(tmp_path)[3]
    assert (last.state, last.checkpoint_step, last.beat_unix) == (RankState.STOPPED, 2, 110.0)
    assert read_heartbeats(tmp_path, since_unix=100.5) == {}  # a heartbeat of an earlier start


def test_the_heartbeat_thread_beats_while_the_main_thread_is_busy(tmp_path):
    heartbeat = Heartbeat(tmp_path, 0, lambda: (None, None, "start-up"), interval_seconds=0.05).start()
    try:
        first = read_heartbeats(tmp_path)[0].beat_unix
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and read_heartbeats(tmp_path)[0].beat_unix == first:
            sum(i * i for i in range(10_000))  # the main thread computes; the thread still gets its turn
        assert read_heartbeats(tmp_path)[0].beat_unix > first
    finally:
        heartbeat.end(RankState.FINISHED)


def test_a_heartbeat_that_cannot_be_written_does_not_end_the_rank(tmp_path):
    logs = tmp_path / "logs"
    logs.write_text("a file where the folder should be")
    heartbeat = Heartbeat(tmp_path, 0, lambda: (None, None, "start-up"), interval_seconds=3600)
    heartbeat.start()  # no exception
    heartbeat.end(RankState.FAILED)


def test_unreadable_heartbeat_files_are_left_out(tmp_path):
    write_heartbeat(tmp_path, beat(0, 101.0))
    heartbeat_path(tmp_path, 1).write_text("{half a")
    heartbeat_path(tmp_path, 2).write_text(json.dumps({"rank": 2}))
    assert list(read_heartbeats(tmp_path)) == [0]


def watch_of(tmp_path, clock: Clock, timeout: float = 20.0, states=None) -> StallWatch:
    states = states if states is not None else {}
    return StallWatch(
        tmp_path, since_unix=100.0, collective_timeout_seconds=timeout, check_every_seconds=0.0, clock=clock,
        state_of=lambda b: states.get(b.rank, "its process is sleeping"),
    )  # fmt: skip


def test_a_silent_rank_is_named_with_what_its_process_was_doing_when_it_went_silent(tmp_path):
    clock = Clock(120.0)
    states = {1: "its process is stopped (SIGSTOP, or a debugger)"}
    watch = watch_of(tmp_path, clock, states=states)
    write_heartbeat(tmp_path, beat(0, 119.5))
    write_heartbeat(tmp_path, beat(1, 112.0, step=7))
    assert silent_after_seconds(20.0) == 10.0
    assert watch.check() is None and watch.lines() == []  # 8 s: not yet
    clock.now = 124.0
    assert watch.check() is None  # silent now, but nothing failed and the timeout has not passed
    assert watch.lines() == [
        "rank 1 (stage 1, pid 1001) stopped responding: no heartbeat for 12 s, the last one in step 7 (training); "
        "its process is stopped (SIGSTOP, or a debugger)"
    ]
    states[1] = "its process has ended"  # killed later by the launcher: the first state is the story
    clock.now = 130.0
    watch.check()
    assert "no heartbeat for 18 s" in watch.lines()[0] and "stopped (SIGSTOP" in watch.lines()[0]


def test_a_rank_that_beats_again_is_no_longer_silent(tmp_path):
    clock = Clock(150.0)
    watch = watch_of(tmp_path, clock)
    write_heartbeat(tmp_path, beat(0, 120.0))
    watch.check()
    assert len(watch.lines()) == 1
    write_heartbeat(tmp_path, beat(0, 149.0))
    watch.check()
    assert watch.lines() == []


def test_the_job_is_ended_when_a_peer_failed_or_the_silence_outlasts_the_timeout(tmp_path):
    clock = Clock(130.0)
    watch = watch_of(tmp_path, clock)
    write_heartbeat(tmp_path, beat(0, 129.0))
    write_heartbeat(tmp_path, beat(1, 110.0))
    assert watch.check() is None
    write_heartbeat(tmp_path, beat(0, 129.5, state=RankState.FAILED))
    assert watch.check() == "rank 0 failed while a rank was silent"

    alone = watch_of(tmp_path / "alone", clock)
    write_heartbeat(tmp_path / "alone", beat(0, 110.0))
    assert alone.check() is None
    clock.now = 110.0 + 20.0 + END_GRACE_SECONDS
    assert "silent for 80 s" in alone.check()


def test_finished_or_failed_ranks_are_not_silent(tmp_path):
    clock = Clock(500.0)
    watch = watch_of(tmp_path, clock)
    write_heartbeat(tmp_path, beat(0, 110.0, state=RankState.FINISHED, checkpoint_step=4))
    write_heartbeat(tmp_path, beat(1, 110.0, state=RankState.FAILED))
    assert watch.check() is None and watch.lines() == []


def test_a_clean_stop_needs_every_rank_stopped_or_finished_at_one_checkpoint():
    stopped = {r: beat(r, 1.0, state=RankState.STOPPED, checkpoint_step=6) for r in (0, 1)}
    assert stopped_cleanly(stopped, 2) == 6
    assert stopped_cleanly({**stopped, 1: beat(1, 1.0, state=RankState.FINISHED, checkpoint_step=6)}, 2) == 6
    assert stopped_cleanly({**stopped, 1: beat(1, 1.0, state=RankState.STOPPED, checkpoint_step=4)}, 2) is None
    assert stopped_cleanly({**stopped, 1: beat(1, 1.0)}, 2) is None  # still running when the launcher ended
    assert stopped_cleanly({0: stopped[0]}, 2) is None  # a rank never wrote one


def test_the_process_state_of_a_stopped_and_of_an_ended_rank():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = time.time()  # the heartbeat starts after its process
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and "stopped" not in process_state(beat(0, 1.0, pid=child.pid, started=started)):
            time.sleep(0.02)
        assert process_state(beat(0, 1.0, pid=child.pid, started=started)).startswith("its process is stopped")
        assert process_state(beat(0, 1.0, pid=child.pid, host="another-host", started=started)) == ""
        # a heartbeat older than the process: the pid was recycled, the rank's process has ended
        assert process_state(beat(0, 1.0, pid=child.pid, started=started - 3600)) == "its process has ended"
    finally:
        child.kill()
        child.wait()
    assert process_state(beat(0, 1.0, pid=child.pid, started=started)) == "its process has ended"
