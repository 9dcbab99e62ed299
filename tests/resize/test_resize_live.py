"""A live resize (issue 21): the running job changes layout at a step boundary without a restart,
and its losses are the uninterrupted run's at every step.

One gpt-tiny job (real ranks: torchrun, gloo) started on 2 ranks p=2 is moved live three times:
to 2 ranks d=2 (the plan's morph table says so for 2 devices), to 1 rank (rank 1 hands its state
over and leaves), and back to 2 ranks d=2 (a new rank joins and receives its share). It is then
stopped through the stop file. A one-rank run of the same job is the reference: every step's loss
must match it within 1e-4 relative (fp32), and rank 0 must have kept its process throughout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from pipectl.artifacts.plan import MorphEntry
from pipectl.launch import LaunchOptions, prepare_launch, run_engine
from pipectl.rundir.processes import find_run_processes
from pipectl.launch.prepare import read_run
from pipectl.resize.live import live_resize
from pipectl.resize.restart import decide_resize
from pipectl.resize.stop import request_stop
from pipectl.rundir.checkpoints import STOP_FILE
from pipectl.rundir.morph_history import read_history
from pipectl.artifacts.run import RankState
from pipectl.rundir.heartbeats import read_heartbeats
from pipectl.rundir.metrics import read_metrics
from builders import gpt_tiny_candidate as candidate, plan_of

pytestmark = pytest.mark.multiprocess

STEPS = 100_000  # the job trains until the test stops it
RUN_TIMEOUT_SECONDS = 240
RELATIVE_TOLERANCE = 1e-4
P1, P2, D2 = candidate(1, 1, m=4), candidate(2, 1, m=4), candidate(1, 2, m=2)


class BackgroundJob:
    """A launched job whose launcher runs in a thread, as `pipectl launch` would in a terminal."""

    def __init__(self, plan, run_dir: Path) -> None:
        prepared = prepare_launch(plan, run_dir, LaunchOptions(steps=STEPS, seed=0, warmup_steps=15))
        self.run_dir = prepared.run_dir
        self.exit_codes: list[int] = []
        self.thread = threading.Thread(
            target=lambda: self.exit_codes.append(
                run_engine(prepared.command, prepared.run_dir, timeout_seconds=RUN_TIMEOUT_SECONDS)
            )
        )
        self.thread.start()

    def wait_for_step(self, step: int) -> None:
        deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
        while not (metrics := read_metrics(self.run_dir)) or metrics[-1].step < step:
            assert self.thread.is_alive(), (self.run_dir / "logs" / "engine.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def stop(self) -> None:
        request_stop(self.run_dir, STOP_FILE)
        self.thread.join(RUN_TIMEOUT_SECONDS)
        assert self.exit_codes == [0], (self.run_dir / "logs" / "engine.log").read_text()[-3000:]


def test_a_running_job_moves_live_and_trains_on_as_if_never_moved(tmp_path, monkeypatch):
    job = BackgroundJob(plan_of(P2, global_batch=8, morph_table=[MorphEntry(devices=1, candidate=P1), MorphEntry(devices=2, candidate=D2)]), tmp_path / "live")  # fmt: skip
    job.wait_for_step(3)
    rank0_pid = read_heartbeats(job.run_dir)[0].pid
    moves = [(2, "t1p1d2 1f1b b2 m2"), (1, "t1p1d1 1f1b b2 m4"), (2, "t1p1d2 1f1b b2 m2")]
    monkeypatch.chdir(tmp_path)  # the run named as a user in this folder names it (the joining rank starts in it)
    for devices, layout in moves:
        result = live_resize(decide_resize(Path("live"), devices), requested_unix=time.time())
        assert result.record.to_layout == layout and result.record.path == "live"
        # Rank 0 moved the new layout's files in after its first step, before the record.
        assert read_run(job.run_dir).plan.chosen.devices == devices and read_run(job.run_dir).job.world_size == devices
        assert not (job.run_dir / "live" / "next").exists()
        # The next move follows at once: after the shrink, `live_resize` waits for the rank it left out.
        job.wait_for_step(result.record.resume_step + 3)
    last = read_history(job.run_dir)[-1].resume_step
    job.wait_for_step(last + 10)
    assert read_heartbeats(job.run_dir)[0].pid == rank0_pid  # never restarted
    job.stop()

    metrics = read_metrics(job.run_dir)
    steps = [m.step for m in metrics]
    assert steps == list(range(1, len(steps) + 1))  # none skipped, none repeated
    history = read_history(job.run_dir)
    assert [(r.path, r.to_layout) for r in history] == [("live", layout) for _, layout in moves]
    for record in history:
        assert record.bytes_moved > 0 and record.pause_seconds is not None and not record.stopped_running_job
        layouts = {m.step: m.layout for m in metrics}
        assert layouts[record.resume_step] == record.from_layout and layouts[record.resume_step + 1] == record.to_layout

    reference = BackgroundJob(plan_of(P1, global_batch=8), tmp_path / "reference")
    reference.wait_for_step(steps[-1])
    reference.stop()
    expected = {m.step: m.loss for m in read_metrics(reference.run_dir)}
    for m in metrics:
        assert m.loss == pytest.approx(expected[m.step], rel=RELATIVE_TOLERANCE), m.step


def test_ctrl_c_during_a_live_resize_says_the_job_trains_on_and_stops_the_joining_rank(tmp_path):
    """Ctrl-C of `pipectl resize` while its joining rank warms up: one line says nothing was asked
    of the job, exit 130, the joining rank is gone, the run's files are as they were."""
    job = BackgroundJob(plan_of(P1, global_batch=8, morph_table=[MorphEntry(devices=1, candidate=P1), MorphEntry(devices=2, candidate=D2)]), tmp_path / "cancelled")  # fmt: skip
    job.wait_for_step(3)
    before = (job.run_dir / "job.json").read_bytes()
    resize = subprocess.Popen([sys.executable, "-m", "pipectl", "resize", str(job.run_dir), "--devices", "2"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
    while not (joiners := [p for p in find_run_processes(job.run_dir) if "--join" in p.argv]):
        assert resize.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    resize.send_signal(signal.SIGINT)
    _, err = resize.communicate(timeout=60)
    assert resize.returncode == 130, err
    assert err.strip().startswith("resize cancelled (Ctrl-C): nothing was asked of the job") and "Traceback" not in err
    assert not [p for p in find_run_processes(job.run_dir) if "--join" in p.argv]
    assert (job.run_dir / "job.json").read_bytes() == before
    job.wait_for_step(read_metrics(job.run_dir)[-1].step + 2)
    job.stop()


def test_a_live_resize_killed_before_it_asks_leaves_the_run_as_it_was_and_no_orphan(tmp_path):
    """kill -9 of `pipectl resize --live` while its joining rank warms up: the run's files still
    describe the running layout (status and --resume read them), the joining rank leaves at once
    instead of waiting out the hand-over no one asked for, and the job trains on."""
    job = BackgroundJob(plan_of(P1, global_batch=8, morph_table=[MorphEntry(devices=1, candidate=P1), MorphEntry(devices=2, candidate=D2)]), tmp_path / "killed")  # fmt: skip
    job.wait_for_step(3)
    names = ("job.json", "plan.json", "ds_config.json", "launch.sh")
    before = {name: (job.run_dir / name).read_bytes() for name in names}
    resize = subprocess.Popen([sys.executable, "-m", "pipectl", "resize", str(job.run_dir), "--devices", "2"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
    while not (joiners := [p for p in find_run_processes(job.run_dir) if "--join" in p.argv]):
        assert resize.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    (joiner,) = joiners
    os.kill(resize.pid, signal.SIGKILL)
    resize.wait()
    try:
        psutil.Process(joiner.pid).wait(timeout=120)  # its warm-up, then it sees the resize gone
    except psutil.NoSuchProcess:
        pass
    assert {name: (job.run_dir / name).read_bytes() for name in names} == before
    assert read_run(job.run_dir).job.world_size == 1
    step = read_metrics(job.run_dir)[-1].step
    job.wait_for_step(step + 3)
    job.stop()
    assert read_heartbeats(job.run_dir)[1].state is RankState.LEFT  # it left; it did not fail
    assert not list((job.run_dir / "logs").glob("failure-rank*.json"))


def test_ctrl_c_after_a_live_resize_exits_130_and_says_to_continue_from_the_runs_own_plan(tmp_path):
    """A job launched from plan.json, moved live to 1 rank, then stopped with Ctrl-C: `launch`
    exits 130 (not 0, the exit of a finished run) and the command it gives to continue names the
    run's plan, which keeps the new layout; plan.json would move the job back to 2 ranks."""
    from pipectl.io import write_json_atomic

    write_json_atomic(tmp_path / "plan.json", plan_of(P2, global_batch=8, morph_table=[MorphEntry(devices=1, candidate=P1), MorphEntry(devices=2, candidate=P2)]))  # fmt: skip
    from cli_process import PIPECTL, pipectl, said

    launch = subprocess.Popen([*PIPECTL, "launch", "plan.json", "--run-dir", "runs/l", "--steps", str(STEPS)], cwd=tmp_path,
                              env={**os.environ, "COLUMNS": "300"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)  # fmt: skip
    run = tmp_path / "runs" / "l"
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
        while len(read_metrics(run)) < 3:
            assert launch.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        moved = pipectl("resize", "runs/l", "--devices", 1, "--live", cwd=tmp_path, timeout=RUN_TIMEOUT_SECONDS)
        assert moved.returncode == 0, said(moved)
        launch.send_signal(signal.SIGINT)
        output, _ = launch.communicate(timeout=RUN_TIMEOUT_SECONDS)
    finally:
        launch.kill()
    said = " ".join(output.split())
    assert launch.returncode == 130, said
    assert "continue with: pipectl launch runs/l/plan.json --run-dir runs/l --resume" in said, said
    step = read_metrics(run)[-1].step
    resumed = pipectl("launch", "runs/l/plan.json", "--run-dir", "runs/l", "--resume", "--steps", step + 2, cwd=tmp_path,
                      timeout=RUN_TIMEOUT_SECONDS)  # fmt: skip
    assert resumed.returncode == 0, said(resumed)
    assert {m.layout for m in read_metrics(run) if m.step > step} == {"t1p1d1 1f1b b2 m4"}
