"""What `resize --live` refuses before anything changes (no processes: the run is not running)."""

from __future__ import annotations

import pytest

from pipectl.artifacts.plan import MorphEntry
from pipectl.launch import LaunchOptions, prepare_launch
from pipectl.resize.live import LiveUnavailable, check_live
from pipectl.resize.restart import decide_resize
from builders import gpt_tiny_candidate as candidate, gpt_tiny_torch_candidate, plan_of


def test_a_run_with_no_rank_running_here_is_not_moved_live(tmp_path):
    plan = plan_of(candidate(2, 1), global_batch=8, morph_table=[MorphEntry(devices=1, candidate=candidate(1, 1))])
    prepared = prepare_launch(plan, tmp_path / "run", LaunchOptions(steps=4, seed=0))
    before = {p.name: p.read_bytes() for p in prepared.run_dir.iterdir() if p.is_file()}
    with pytest.raises(LiveUnavailable, match="no rank of the run is running on this machine"):
        check_live(decide_resize(prepared.run_dir, 1))
    assert {p.name: p.read_bytes() for p in prepared.run_dir.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("start", ["deepspeed", "torch"])
def test_a_move_to_or_from_the_torch_engine_is_not_live(tmp_path, start):
    """A live resize hands DeepSpeed engine state over; across engines the CLI restarts instead,
    saying why (the checkpoint resumes in either engine: tests/runtime/test_torch_launch.py)."""
    torch_plan = gpt_tiny_torch_candidate("interleaved", 2, v=2)
    chosen, other = (candidate(2, 1), torch_plan) if start == "deepspeed" else (torch_plan, candidate(2, 1))
    plan = plan_of(chosen, global_batch=8, morph_table=[MorphEntry(devices=2, candidate=other)])
    prepared = prepare_launch(plan, tmp_path / "run", LaunchOptions(steps=4, seed=0))
    which = "new" if start == "deepspeed" else "running"
    with pytest.raises(LiveUnavailable, match=f"the {which} layout runs on the torch engine") as raised:
        check_live(decide_resize(prepared.run_dir, 2))
    assert raised.value.running  # the CLI says "cannot resize live: ...; restarting instead"


def _ranks_of(run_dir, seconds: list[float]) -> list:
    """Processes that look like ranks of `run_dir` to `find_run_processes` (their command line
    names the worker module and the run), each ending after its `seconds`."""
    import subprocess
    import sys

    return [
        subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({s})", "-m", "pipectl.runtime.worker",
                          "--run-dir", str(run_dir)])
        for s in seconds
    ]  # fmt: skip


def _shrunk_run(tmp_path, live: bool):
    """A run whose plan has one rank, after a move from two ranks (live or by restart)."""
    import time

    from pipectl.artifacts.morph import MorphRecord
    from pipectl.rundir.morph_history import append_record

    plan = plan_of(candidate(1, 1), global_batch=8, morph_table=[MorphEntry(devices=2, candidate=candidate(1, 2, m=2))])
    prepared = prepare_launch(plan, tmp_path / "run", LaunchOptions(steps=40, seed=0))
    append_record(prepared.run_dir, MorphRecord(
        requested_unix=time.time(), requested_devices=1, from_devices=2, from_layout="t1p1d2 1f1b b2 m2", to_devices=1,
        to_layout="t1p1d1 1f1b b2 m4", global_batch=8, resume_step=3, target_steps=40, stopped_running_job=not live,
        path="live" if live else "restart", plan_source="morph-table",
    ))  # fmt: skip
    return prepared.run_dir


def test_a_resize_right_after_a_live_shrink_waits_for_the_rank_it_left_out(tmp_path):
    """The rank a live shrink leaves out exits on its own after the hand-over; a resize asked
    meanwhile waits for it (and then moves live) instead of calling the run busy, which the CLI
    answered with a restart."""
    run_dir = _shrunk_run(tmp_path, live=True)
    ranks = _ranks_of(run_dir, [60, 2])
    said: list[str] = []
    try:
        check_live(decide_resize(run_dir, 2), said.append)
        assert ranks[1].poll() is not None and ranks[0].poll() is None
        assert said == ["waiting for the ranks the last live resize left out to exit"]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def test_more_ranks_than_the_layout_without_a_live_shrink_are_a_move_under_way(tmp_path):
    run_dir = _shrunk_run(tmp_path, live=False)
    ranks = _ranks_of(run_dir, [60, 60])
    said: list[str] = []
    try:
        with pytest.raises(LiveUnavailable, match="2 ranks running here for a layout of 1"):
            check_live(decide_resize(run_dir, 2), said.append)
        assert said == []
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def test_a_job_that_ends_before_taking_the_request_leaves_nothing_staged_and_says_how_to_go_on(tmp_path):
    """A live resize racing the end of the job: the request was never taken, yet the new layout's
    files stayed staged in RUN/live/next, and the hint said 'resize again' where a finished run
    needs --steps to train on."""
    from pipectl.artifacts.layout import layout_label
    from pipectl.artifacts.run import StepMetrics
    from pipectl.errors import LaunchError
    from pipectl.io import write_json_atomic
    from pipectl.resize.live import _wait_record, live_request
    from pipectl.resize.restart import prepare_relaunch
    from pipectl.rundir.live_requests import STAGED_DIR, request_path
    from pipectl.rundir.metrics import MetricsWriter

    plan = plan_of(candidate(2, 1), global_batch=8, morph_table=[MorphEntry(devices=1, candidate=candidate(1, 1))])
    run = prepare_launch(plan, tmp_path / "run", LaunchOptions(steps=4, seed=0)).run_dir
    writer = MetricsWriter(run, rank=0)
    for step in range(1, 5):  # finished: no rank of it runs any more
        writer.write(StepMetrics(step=step, loss=5.0, step_seconds=0.05, predicted_step_seconds=0.05, samples_per_second=160,
                                 global_batch=8, world_size=2, layout=layout_label(candidate(2, 1))))  # fmt: skip
    decision = decide_resize(run, 1, steps=8)
    request = live_request(decision, prepare_relaunch(decision), requested_unix=1.0)
    (run / STAGED_DIR).mkdir(parents=True)
    write_json_atomic(request_path(run), request)
    with pytest.raises(LaunchError, match=r"the job ended before the live resize completed \(the request was not taken\)") as raised:
        _wait_record(run, request, [], timeout_seconds=5)
    assert raised.value.hint.startswith("the run trained all its 4 steps: to train on, resize with --steps TOTAL")
    assert not request_path(run).exists() and not (run / STAGED_DIR).exists()
