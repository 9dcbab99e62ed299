"""Resizing a run without training: the decision, the rewritten plan/job/config, the record, the
stop of a running job (stand-in processes), and the hooks for elastic restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipectl.artifacts.plan import Candidate, MorphEntry, Plan
from pipectl.artifacts.run import CheckpointManifest, Engine, NodeGroup, RankTiming, StepMetrics
from pipectl.errors import LaunchError, UserInputError
from pipectl.io import write_json_atomic
from pipectl.launch import LaunchOptions, prepare_launch
from pipectl.launch.prepare import read_run
from pipectl.rundir.morph_history import read_records
from pipectl.resize.restart import (
    decide_resize,
    layout_label,
    prepare_relaunch,
    resize_run,
)
from pipectl.rundir.processes import find_run_processes, run_dir_argument
from pipectl.resize.stop import stop_run
from pipectl.rundir import checkpoints as ckpt
from pipectl.rundir.metrics import MetricsWriter

from builders import gpt_tiny_candidate, plan_of


candidate = gpt_tiny_candidate


def table_plan(chosen: Candidate) -> Plan:
    """B = 8: 1 -> p1 m8, 2 -> p2 m4, 3 -> the 2-device plan (8 cannot be split over 3), 4 -> p2 d2 m2."""
    table = {1: candidate(1, m=4, b=2), 2: candidate(2), 3: candidate(2), 4: candidate(2, 2, m=2)}
    entries = [
        MorphEntry(devices=n, candidate=c, note="" if c.devices == n else "uses 2 of 3 devices: 8 % 3 != 0")
        for n, c in table.items()
    ]
    return plan_of(chosen, global_batch=8, morph_table=entries)


def make_run(tmp_path: Path, chosen: Candidate | None = None, steps: int = 10, checkpoint_step: int | None = 10, lr=3e-4) -> Path:
    run = tmp_path / "runs" / "demo"
    prepare_launch(table_plan(chosen or candidate()), run, LaunchOptions(steps=steps, learning_rate=lr))
    if checkpoint_step is not None:
        fake_checkpoint(run, checkpoint_step)
        writer = MetricsWriter(run, rank=0)
        for s in range(1, checkpoint_step + 1):
            writer.write(
                StepMetrics(
                    step=s, loss=5.0 - 0.1 * s, step_seconds=0.1, samples_per_second=80.0, global_batch=8,
                    world_size=2, layout="t1p2d1 1f1b b2 m4", time_unix=time.time(),
                )  # fmt: skip
            )
    return run


def fake_checkpoint(run: Path, step: int) -> None:
    root = ckpt.checkpoints_dir(run)
    staged = root / ckpt.STAGING_DIR / f"{ckpt.tag_for_step(step)}_universal"
    (staged / "zero").mkdir(parents=True)
    (staged / "zero" / "weights.pt").write_bytes(b"w" + bytes([step]))
    manifest = CheckpointManifest(tag=ckpt.tag_for_step(step), step=step, files=ckpt.hash_tree(staged), bytes=2)
    ckpt.commit_tag(root, staged, ckpt.tag_for_step(step), manifest)


# --------------------------------------------------------------------------- decision


def test_decision_takes_the_table_entry_and_keeps_the_batch(tmp_path):
    run = make_run(tmp_path)
    decision = decide_resize(run, 1, steps=20)
    assert decision.candidate.devices == 1 and decision.choice.source == "morph-table"
    assert decision.previous.devices == 2 and decision.target_steps == 20
    assert decision.candidate.global_batch == decision.global_batch == 8


def test_bad_requests_name_the_value(tmp_path):
    run = make_run(tmp_path)
    with pytest.raises(UserInputError, match="got 0"):
        decide_resize(run, 0, steps=20)
    with pytest.raises(UserInputError, match="no run directory at .*nope"):
        decide_resize(tmp_path / "nope", 1)
    with pytest.raises(UserInputError, match="has trained all its 10 steps"):
        decide_resize(run, 1)  # the job's own total, already reached
    with pytest.raises(UserInputError, match="no entry for 7 devices"):
        decide_resize(run, 7, steps=20, replan=None)


def test_a_run_split_over_node_groups_is_not_regrouped_by_resize(tmp_path):
    run = make_run(tmp_path)
    job = read_run(run).job
    groups = [NodeGroup(node_type=name, device=kind, nodes=1, first_replica=0, replicas=1)
              for name, kind in (("fast-nodes", "cpu"), ("slow-nodes", "cpu-slowed-2x"))]  # fmt: skip
    split = job.model_copy(update={"engine": Engine.SLURM, "nodes": 2, "ranks_per_node": 1, "node_groups": groups})
    write_json_atomic(run / "job.json", split)
    with pytest.raises(UserInputError, match="split over device kinds on 2 groups of nodes") as caught:
        decide_resize(run, 1, steps=20)
    assert "--resume" in caught.value.hint


def test_default_total_is_the_jobs_own(tmp_path):
    run = make_run(tmp_path, steps=30)
    assert decide_resize(run, 1).target_steps == 30


# --------------------------------------------------------------------------- rewrite


def test_relaunch_files_for_fewer_devices(tmp_path):
    run = make_run(tmp_path, lr=3e-4)
    prepared = prepare_relaunch(decide_resize(run, 1, steps=20))
    assert prepared.plan.chosen == candidate(1, m=4)
    assert prepared.plan.morph_table == read_run(run).plan.morph_table  # kept
    assert prepared.job.world_size == 1 and prepared.job.ranks_per_node == 1 and prepared.job.steps == 20
    config = prepared.ds_config
    assert config["train_batch_size"] == 8 and config["gradient_accumulation_steps"] == 4
    assert config["pipeline"]["stages"] == 1 and config["pipeline"]["partition"] == [0, 9]
    assert config["optimizer"]["params"]["lr"] == 3e-4  # the run's learning rate, not the default
    assert "--nproc_per_node 1" in prepared.command.shell_line()


def test_micro_batches_per_replica_follow_the_data_parallel_degree(tmp_path):
    run = make_run(tmp_path)
    config = prepare_relaunch(decide_resize(run, 4, steps=20)).ds_config
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (2, 2)
    assert config["train_batch_size"] == 8


def test_resize_without_relaunch_rewrites_the_run_and_records_it(tmp_path):
    run = make_run(tmp_path)
    (run / ckpt.STOP_FILE).write_text("left over")  # would stop the new job at once
    result = resize_run(run, 3, steps=20, relaunch=False)
    files = read_run(run)
    assert files.plan.chosen.devices == 2 and files.job.world_size == 2  # 8 cannot be split over 3
    assert any("uses 2 of 3 devices" in note for note in result.notes)
    assert not (run / ckpt.STOP_FILE).exists()
    (record,) = read_records(run)
    assert record.requested_devices == 3 and record.to_devices == 2 and record.resume_step == 10
    assert record.from_layout == layout_label(candidate()) and not record.stopped_running_job
    assert record.relaunched_unix is None and result.exit_code is None
    assert "uses 2 of 3 devices" in " ".join(record.notes)


def test_a_run_without_checkpoint_starts_from_step_zero_and_says_so(tmp_path):
    run = make_run(tmp_path, checkpoint_step=None)
    result = resize_run(run, 1, relaunch=False)
    assert result.record.resume_step == 0
    assert any("no verified checkpoint" in note for note in result.notes)


def test_a_run_that_trained_but_never_checkpointed_is_not_started_over_by_a_resize(tmp_path):
    """As `launch --resume` refuses it: the steps it trained would be thrown away without a word."""
    run = make_run(tmp_path, checkpoint_step=None)
    writer = MetricsWriter(run, rank=0)
    for s in range(1, 6):
        writer.write(StepMetrics(step=s, loss=4.0, step_seconds=0.3, samples_per_second=26.0, global_batch=8,
                                 world_size=2, layout="t1p2d1 1f1b b2 m4", time_unix=time.time()))  # fmt: skip
    with pytest.raises(UserInputError, match="it trained 5 steps but wrote no checkpoint, so the new layout would start over"):
        resize_run(run, 1, relaunch=False)
    assert read_records(run) == [] and read_run(run).job.world_size == 2  # nothing rewritten
    # The command says so before it prints the layout it would move to.
    from typer.testing import CliRunner

    from pipectl.cli.main import app

    refused = CliRunner().invoke(app, ["resize", str(run), "--devices", "1"])
    assert refused.exit_code == 2 and refused.output.lstrip().startswith("error: cannot resize"), refused.output


def test_stragglers_are_left_out_on_request(tmp_path):
    run = make_run(tmp_path, chosen=candidate(2, 2, m=2), checkpoint_step=None)
    writer = MetricsWriter(run, rank=0)
    for s in range(1, 9):  # rank 3 (stage 1, replica 1) computes 3x as long as rank 1
        ranks = [
            RankTiming(rank=r, stage=r % 2, forward_seconds=0.1 * (3 if r == 3 else 1), backward_seconds=0.0)
            for r in range(4)
        ]
        writer.write(
            StepMetrics(step=s, loss=4.0, step_seconds=0.3, samples_per_second=26.0, global_batch=8, world_size=4,
                        layout="t1p2d2 1f1b b2 m2", time_unix=time.time(), ranks=ranks)  # fmt: skip
        )
    decision = decide_resize(run, 4, steps=20, exclude_stragglers=True)
    assert decision.excluded_ranks == [3] and decision.usable_devices == 3
    assert decision.candidate.devices == 2  # the entry for 3: B = 8 cannot use 3
    assert any("rank 3 (stage 1)" in note for note in decision.notes)
    kept = decide_resize(run, 4, steps=20)
    assert kept.excluded_ranks == [] and kept.candidate.devices == 4


# --------------------------------------------------------------------------- running jobs

STAND_IN = """
import os, sys, time, pathlib
stop = pathlib.Path(sys.argv[-1]) / "stop_requested"
ignore = os.environ.get("IGNORE_STOP") == "1"
import signal
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
deadline = time.time() + 20
while time.time() < deadline:
    if stop.exists() and not ignore:
        time.sleep(0.2)   # "finish the step and checkpoint"
        sys.exit(0)
    time.sleep(0.05)
"""


def start_stand_in(run: Path, launcher: bool = False, **env) -> subprocess.Popen:
    """A process whose command line looks like a rank of `run` (or its torchrun launcher) and that
    honours the stop file (unless IGNORE_STOP=1)."""
    module = ["-m", "torch.distributed.run"] if launcher else []
    argv = [sys.executable, "-c", STAND_IN, *module, "-m", "pipectl.runtime.worker", "--run-dir", str(run)]
    proc = subprocess.Popen(argv, env={**os.environ, **env})
    for _ in range(100):
        if any(p.pid == proc.pid for p in find_run_processes(run)):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("stand-in process did not show up")


def test_run_dir_argument_parsing():
    assert run_dir_argument(("python", "-m", "pipectl.runtime.worker", "--run-dir", "runs/a")) == "runs/a"
    assert run_dir_argument(("torchrun", "-m", "pipectl.runtime.worker", "--run-dir=/x/y")) == "/x/y"
    assert run_dir_argument(("python", "train.py", "--run-dir", "runs/a")) is None


def test_a_running_job_is_found_and_stopped_through_the_stop_file(tmp_path):
    run = make_run(tmp_path)
    other = make_run(tmp_path / "other")
    proc = start_stand_in(run)
    try:
        assert find_run_processes(other) == []
        (found,) = find_run_processes(run)
        assert found.pid == proc.pid and found.is_worker
        outcome = stop_run(run, [found], stop_file=ckpt.STOP_FILE, signal_after_seconds=10, timeout_seconds=10)
        assert not outcome.signalled and outcome.seconds < 5
        assert proc.wait(timeout=5) == 0
    finally:
        proc.kill()


def test_a_rank_ignoring_the_stop_file_gets_sigterm(tmp_path):
    run = make_run(tmp_path)
    proc = start_stand_in(run, IGNORE_STOP="1")
    try:
        outcome = stop_run(run, find_run_processes(run), stop_file=ckpt.STOP_FILE, signal_after_seconds=0.3, timeout_seconds=10)
        assert outcome.signalled
    finally:
        proc.kill()


def test_a_job_that_does_not_stop_is_reported_not_killed(tmp_path):
    run = make_run(tmp_path)
    proc = start_stand_in(run, IGNORE_STOP="1")
    try:
        processes = find_run_processes(run)
        with pytest.raises(LaunchError, match=f"did not stop within 1 s \\(pids {proc.pid} still alive\\)"):
            stop_run(run, [p for p in processes], stop_file=ckpt.STOP_FILE, signal_after_seconds=60, timeout_seconds=1)
        assert proc.poll() is None  # still running: nothing was killed
    finally:
        proc.kill()


def test_ranks_are_waited_for_not_a_launcher_that_outlives_them(tmp_path):
    run = make_run(tmp_path)
    launcher = start_stand_in(run, launcher=True, IGNORE_STOP="1")
    rank = start_stand_in(run)
    try:
        processes = find_run_processes(run)
        assert sorted(p.is_worker for p in processes) == [False, True]
        outcome = stop_run(run, processes, stop_file=ckpt.STOP_FILE, signal_after_seconds=10, timeout_seconds=10)
        # The rank is gone once its command line is (an exiting process empties it before it turns
        # zombie), which can be a moment before its parent can collect it: wait, briefly.
        assert rank.wait(timeout=5) == 0 and launcher.poll() is None and outcome.seconds < 5
        # An elastic launcher could restart ranks: then it is waited for as well (here: in vain).
        with pytest.raises(LaunchError, match=str(launcher.pid)):
            stop_run(run, processes, stop_file=ckpt.STOP_FILE, timeout_seconds=0.5, include_launchers=True)
    finally:
        launcher.kill()
        rank.kill()


def test_a_launcher_without_ranks_yet_is_waited_for(tmp_path):
    run = make_run(tmp_path)
    launcher = start_stand_in(run, launcher=True)
    try:
        outcome = stop_run(run, find_run_processes(run), stop_file=ckpt.STOP_FILE, timeout_seconds=10)
        # It exited, after the stand-in's pause: stop_run counts it gone once its command line is
        # empty, a moment before this parent can collect it, so wait briefly rather than poll.
        assert launcher.wait(timeout=5) == 0 and outcome.seconds >= 0.2
    finally:
        launcher.kill()


def test_resize_stops_a_running_job_before_rewriting(tmp_path):
    run = make_run(tmp_path)
    proc = start_stand_in(run)
    try:
        result = resize_run(run, 1, steps=20, relaunch=False, stop_timeout_seconds=10)
        assert proc.wait(timeout=5) == 0
        assert result.record.stopped_running_job and result.record.stop_seconds is not None
        assert read_run(run).job.world_size == 1
        assert not (run / ckpt.STOP_FILE).exists()
    finally:
        proc.kill()


def test_a_bad_request_leaves_a_running_job_alone(tmp_path):
    run = make_run(tmp_path)
    proc = start_stand_in(run)
    try:
        with pytest.raises(UserInputError):
            resize_run(run, 0, steps=20, relaunch=False)
        assert not (run / ckpt.STOP_FILE).exists() and proc.poll() is None
    finally:
        proc.kill()


def test_a_resize_whose_job_does_not_stop_leaves_no_stop_request_behind(tmp_path):
    run = make_run(tmp_path)
    proc = start_stand_in(run, IGNORE_STOP="1")
    try:
        with pytest.raises(LaunchError, match="did not stop within 1 s"):
            resize_run(run, 1, steps=20, relaunch=False, stop_timeout_seconds=1, signal_after_seconds=60)
        assert not (run / ckpt.STOP_FILE).exists() and proc.poll() is None
        assert read_run(run).job.world_size == 2  # nothing rewritten
    finally:
        proc.kill()


STARTING_LAUNCH = """
import os, subprocess, sys, time
from pipectl.rundir.lock import lock_run_dir
run = sys.argv[1]
lock = lock_run_dir(run)  # what `launch --resume` holds from its pre-flight on
time.sleep(1.5)  # the pre-flight: no rank yet
rank = subprocess.Popen([sys.executable, "-c", os.environ["STAND_IN"], "-m", "pipectl.runtime.worker", "--run-dir", run])
sys.exit(rank.wait())
"""


def test_a_job_still_starting_is_stopped_at_its_first_step_boundary_then_resized(tmp_path):
    """`launch --resume` a moment before `resize`: the launch holds the run and has no rank yet.
    The resize says so, asks for the stop at once, waits for the ranks and stops them, instead of
    waiting silently on the lock and giving up with a hint to resize."""
    run = make_run(tmp_path)
    launch = subprocess.Popen([sys.executable, "-c", STARTING_LAUNCH, str(run)], env={**os.environ, "STAND_IN": STAND_IN})
    try:
        for _ in range(100):
            if str(launch.pid) in (run / "job.lock").read_text().split():
                break  # it holds the run
            time.sleep(0.05)
        said = []
        result = resize_run(run, 1, steps=20, relaunch=False, stop_timeout_seconds=20, on_phase=said.append)
        assert launch.wait(timeout=10) == 0  # its rank stopped through the stop file
        assert said[0] == f"a job is starting in {run} (pid {launch.pid}): stopping it at its first step boundary"
        assert any(line.startswith("stopping the running job") for line in said), said
        assert result.record.stopped_running_job and read_run(run).job.world_size == 1
        assert not (run / ckpt.STOP_FILE).exists()
    finally:
        launch.kill()


def test_a_launch_refused_by_a_resize_holding_the_run_says_so(tmp_path):
    from pipectl.rundir.lock import lock_run_dir

    run = make_run(tmp_path)
    with lock_run_dir(run, role="resize"):
        with pytest.raises(UserInputError, match=f"run directory {run} is being resized \\(pipectl resize, pid {os.getpid()}\\)"):
            lock_run_dir(run)


# --------------------------------------------------------------------------- Ctrl-C during a restart


def test_a_ctrl_c_while_the_run_is_rewritten_is_held_and_starts_no_job(tmp_path, monkeypatch):
    """The run is rewritten whole, then not started: the signal is the resize's result, not a
    KeyboardInterrupt that leaves a half-written run and a record of a relaunch that never was."""
    from pipectl.resize import restart

    run = make_run(tmp_path)
    real_write = restart.write_relaunch

    def write_then_ctrl_c(path, prepared):
        os.kill(os.getpid(), signal.SIGINT)  # delivered at once, in the middle of the rewrite
        real_write(path, prepared)

    monkeypatch.setattr(restart, "write_relaunch", write_then_ctrl_c)
    monkeypatch.setattr(restart, "run_engine", lambda *a, **k: pytest.fail("a job was started after Ctrl-C"))
    result = resize_run(run, 1, steps=20)
    assert result.signals == [signal.SIGINT] and result.exit_code is None
    assert read_run(run).job.world_size == 1  # the new layout, written whole
    (record,) = read_records(run)
    assert record.to_devices == 1 and record.relaunched_unix is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is itself again


def test_a_ctrl_c_while_the_job_stops_withdraws_the_stop_request(tmp_path, monkeypatch):
    """Ctrl-C while DeepSpeed's parser checks the new layout (the old job finishing its step): the
    request must not stop the job, or a later resume of it, at some step boundary to come."""
    from pipectl.resize import restart

    run = make_run(tmp_path)
    proc = start_stand_in(run, IGNORE_STOP="1")

    def ctrl_c(_decision):
        assert (run / ckpt.STOP_FILE).exists()
        raise KeyboardInterrupt

    monkeypatch.setattr(restart, "prepare_relaunch", ctrl_c)
    try:
        with pytest.raises(restart.RestartInterrupted) as interrupted:
            resize_run(run, 1, steps=20, relaunch=False, stop_timeout_seconds=10)
        assert interrupted.value.asked and not interrupted.value.stopped
        assert not (run / ckpt.STOP_FILE).exists() and proc.poll() is None
        assert read_records(run) == [] and read_run(run).job.world_size == 2  # nothing rewritten
    finally:
        proc.kill()


@pytest.mark.parametrize("running", [True, False])
def test_the_resize_command_says_what_a_ctrl_c_left(tmp_path, monkeypatch, running):
    from typer.testing import CliRunner

    from pipectl.cli.main import app
    from pipectl.resize import restart

    run = make_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(restart, "prepare_relaunch", lambda _decision: (_ for _ in ()).throw(KeyboardInterrupt()))
    proc = start_stand_in(run, IGNORE_STOP="1") if running else None
    try:
        said = CliRunner().invoke(app, ["resize", "runs/demo", "--devices", "1", "--steps", "20"])
    finally:
        if proc is not None:
            proc.kill()
    assert said.exit_code == 130, said.output
    left = ("the stop request was withdrawn; the job trains on unless its ranks had taken it already "
            "(pipectl status runs/demo shows whether it runs)") if running else "nothing was changed"  # fmt: skip
    assert f"resize cancelled (Ctrl-C): {left}" in " ".join(said.output.split()), said.output


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_kill_or_a_closed_terminal_while_the_job_stops_withdraws_the_stop_request(tmp_path, monkeypatch, signum):
    """A `kill` or a closed terminal while the job stops: handled as a Ctrl-C, not the end of pipectl on
    the spot (which left the stop request, so the job stopped at its checkpoint and nothing restarted it)."""
    from typer.testing import CliRunner

    from pipectl.cli.main import app
    from pipectl.resize import restart

    run = make_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(restart, "prepare_relaunch", lambda _decision: os.kill(os.getpid(), signum))
    proc = start_stand_in(run, IGNORE_STOP="1")
    try:
        said = CliRunner().invoke(app, ["resize", "runs/demo", "--devices", "1", "--steps", "20"])
        assert said.exit_code == 128 + signum, said.output
        assert f"resize cancelled ({signal.Signals(signum).name}): the stop request was withdrawn" in said.output
        assert not (run / ckpt.STOP_FILE).exists() and proc.poll() is None  # the job trains on
        assert read_records(run) == [] and read_run(run).job.world_size == 2
        assert signal.getsignal(signum) is signal.SIG_DFL
    finally:
        proc.kill()


def test_a_ctrl_c_held_while_a_run_not_started_here_is_rewritten_is_its_result(tmp_path, monkeypatch):
    """relaunch=False (and a Slurm run, submitted or not): the held signal is still the result, so the
    command says the run stopped instead of reporting a resize that went on (or a submitted job)."""
    from pipectl.resize import restart

    run = make_run(tmp_path)
    real_write = restart.write_relaunch

    def write_then_ctrl_c(path, prepared):
        os.kill(os.getpid(), signal.SIGINT)
        real_write(path, prepared)

    monkeypatch.setattr(restart, "write_relaunch", write_then_ctrl_c)
    monkeypatch.setattr(restart, "submit_slurm", lambda _path: pytest.fail("submitted after Ctrl-C"))
    result = resize_run(run, 1, steps=20, relaunch=False)
    assert result.signals == [signal.SIGINT] and result.submitted_job is None
    assert read_run(run).job.world_size == 1


def test_a_ctrl_c_after_the_job_stopped_says_so_and_leaves_no_stop_request(tmp_path, monkeypatch):
    """Ctrl-C while the stopped job's Slurm allocation is cancelled: the job has stopped (not 'trains on'),
    and the stop request is gone (it would stop the `launch --resume` that follows at its first step)."""
    from pipectl.resize import restart

    run = make_run(tmp_path)
    proc = start_stand_in(run)
    monkeypatch.setattr(restart, "cancel_slurm_job", lambda _path: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        with pytest.raises(restart.RestartInterrupted) as interrupted:
            resize_run(run, 1, steps=20, relaunch=False, stop_timeout_seconds=10, cancel_slurm=True)
        assert interrupted.value.asked and interrupted.value.stopped
        assert proc.wait(timeout=5) == 0 and not (run / ckpt.STOP_FILE).exists()
    finally:
        proc.kill()
