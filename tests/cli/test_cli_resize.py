"""`pipectl resize`: bad input exits 2 naming the value, dry run, a slurm run rewritten for
submission, and the morph-history/straggler renderables `pipectl status` shows."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from pipectl.artifacts.morph import MorphRecord, MorphTrigger
from pipectl.artifacts.plan import MorphEntry
from pipectl.artifacts.run import CheckpointManifest, Engine, RankTiming, StepMetrics
from pipectl.cli.main import app
from pipectl.report.run_tables import morph_history_table, status_table, straggler_table
from pipectl.rundir.analysis import analyse
from pipectl.launch import LaunchOptions, prepare_launch
from pipectl.launch.prepare import read_run
from pipectl.rundir.morph_history import append_record, with_downtime
from pipectl.rundir.stragglers import find_stragglers
from pipectl.rundir import checkpoints as ckpt
from pipectl.rundir.metrics import MetricsWriter
from builders import gpt_tiny_candidate, plan_of

runner = CliRunner()


candidate = gpt_tiny_candidate


def make_run(tmp_path: Path, engine: Engine = Engine.LOCAL, cluster: str = "local") -> Path:
    plan = plan_of(
        candidate(), cluster=cluster, global_batch=8,
        morph_table=[
            MorphEntry(devices=1, candidate=candidate(1)),
            MorphEntry(devices=2, candidate=candidate()),
            MorphEntry(devices=3, candidate=candidate(), note="uses 2 of 3 devices: 8 cannot be split over 3"),
        ],
    )  # fmt: skip
    run = tmp_path / "runs" / "demo"
    prepare_launch(plan, run, LaunchOptions(engine=engine, steps=10))
    root = ckpt.checkpoints_dir(run)
    staged = root / ckpt.STAGING_DIR / "step00000010_universal"
    staged.mkdir(parents=True)
    (staged / "weights.pt").write_bytes(b"w")
    manifest = CheckpointManifest(tag="step00000010", step=10, files=ckpt.hash_tree(staged), bytes=1)
    ckpt.commit_tag(root, staged, "step00000010", manifest)
    return run


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_no_such_run_exits_2_naming_it(tmp_path):
    result = invoke("resize", tmp_path / "runs" / "ghost", "--devices", "1")
    assert result.exit_code == 2
    assert "ghost" in result.output and "Traceback" not in result.output


def test_non_positive_devices_exit_2(tmp_path):
    run = make_run(tmp_path)
    result = invoke("resize", run, "--devices", "0", "--steps", "20")
    assert result.exit_code == 2 and "got 0" in result.output


def test_beyond_the_cluster_and_not_in_the_table_exits_2(tmp_path):
    run = make_run(tmp_path, cluster="a100-8x8")
    result = invoke("resize", run, "--devices", "65", "--steps", "20")
    assert result.exit_code == 2
    assert "--devices 65 exceeds cluster 'a100-8x8' (64 devices)" in result.output


def test_steps_already_trained_exit_2(tmp_path):
    run = make_run(tmp_path)
    result = invoke("resize", run, "--devices", "1")  # a finished run, no new total
    assert result.exit_code == 2 and "has trained all its 10 steps: nothing is left to train" in result.output
    assert "--steps 20" in result.output
    given = invoke("resize", run, "--devices", "1", "--steps", "10")
    assert given.exit_code == 2 and "--steps 10 is not beyond the 10 steps" in given.output


@pytest.mark.parametrize("flag", ["--submit", "--scancel"])
def test_slurm_flags_on_a_local_run_exit_2(tmp_path, flag):
    run = make_run(tmp_path)
    result = invoke("resize", run, "--devices", "1", flag, "--dry-run")
    assert result.exit_code == 2 and f"{flag} is for a Slurm run" in result.output and "engine local" in result.output


def test_dry_run_shows_the_new_layout_and_changes_nothing(tmp_path):
    run = make_run(tmp_path)
    before = {name: (run / name).read_text() for name in ("plan.json", "job.json", "ds_config.json")}
    result = invoke("resize", run, "--devices", "3", "--steps", "20", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["requested_devices"] == 3 and payload["devices"] == 2
    chosen = payload["candidate"]
    assert chosen["data_parallel"] * chosen["micro_batch_size"] * chosen["micro_batches"] == 8  # B kept
    assert any("uses 2 of 3 devices" in note for note in payload["notes"])
    assert {name: (run / name).read_text() for name in before} == before

    table = invoke("resize", run, "--devices", "1", "--steps", "20", "--dry-run")
    assert table.exit_code == 0 and "t1p1d1 1f1b b2 m4" in table.output and "dry run" in table.output


def test_slurm_run_is_rewritten_for_submission(tmp_path):
    run = make_run(tmp_path, engine=Engine.SLURM)
    result = invoke("resize", run, "--devices", "1", "--steps", "20", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["exit_code"] is None and "sbatch" in payload["submit_hint"]
    assert payload["to_layout"] == "t1p1d1 1f1b b2 m4" and payload["resume_step"] == 10
    files = read_run(run)
    assert files.job.world_size == 1 and files.job.steps == 20
    assert "--nproc_per_node 1" in (run / "job.sbatch").read_text()


def test_live_asked_by_name_of_a_run_not_running_says_it_restarts(tmp_path):
    """--live is the default; given by name for a run with no rank running, the resize says why it
    restarts instead (it used to restart without a word)."""
    run = make_run(tmp_path, engine=Engine.SLURM)
    asked = invoke("resize", run, "--devices", "1", "--steps", "20", "--live")
    assert asked.exit_code == 0, asked.output
    assert "cannot resize live: no rank of the run is running on this machine; restarting instead" in asked.output
    again = invoke("resize", run, "--devices", "2", "--steps", "30")  # the default: no word needed
    assert again.exit_code == 0 and "cannot resize live" not in again.output, again.output


def render(renderable) -> str:
    console = Console(record=True, width=200)
    console.print(renderable)
    return console.export_text()


def test_the_status_shows_morphs_and_stragglers(tmp_path, monkeypatch):
    run = make_run(tmp_path)
    append_record(
        run,
        MorphRecord(
            requested_unix=time.time(), requested_devices=3, from_devices=2, from_layout="t1p2d1 1f1b b2 m4",
            to_devices=2, to_layout="t1p1d2 1f1b b2 m2", global_batch=8, resume_step=10, target_steps=20,
            stopped_running_job=True, stop_seconds=3.25, relaunched_unix=time.time(), plan_source="morph-table",
            notes=["uses 2 of 3 devices"],
        ),  # fmt: skip
    )
    writer = MetricsWriter(run, rank=0)
    for s in range(11, 17):
        ranks = [RankTiming(rank=r, stage=0, forward_seconds=0.1 * (4 if r == 1 else 1), backward_seconds=0.1) for r in range(2)]
        writer.write(
            StepMetrics(step=s, loss=4.0, step_seconds=0.5, samples_per_second=16.0, global_batch=8, world_size=2,
                        layout="t1p1d2 1f1b b2 m2", time_unix=time.time() + s, ranks=ranks)  # fmt: skip
        )
    reads: list[str] = []
    read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self.name) or read_text(self, *a, **k))
    report = analyse(run)
    monkeypatch.undo()
    # One analysis reads each of the run's files once (the metrics feed the morph downtimes and
    # the stragglers too).
    assert reads.count("metrics.jsonl") == 1 and len(reads) == len(set(reads)), reads
    text = render(status_table(report))
    assert "morph history" in text and "t1p1d2 1f1b b2 m2" in text and "3.2 s" in text
    assert "uses 2 of 3 devices" in text
    assert "straggler" in text and "2.50x" in text

    report = find_stragglers([])
    assert "no per-rank heartbeats" in render(straggler_table(report))
    assert "not relaunched" in render(morph_history_table([
        MorphRecord(
            requested_unix=0.0, requested_devices=1, from_devices=2, from_layout="a", to_devices=1, to_layout="b",
            global_batch=8, resume_step=0, target_steps=1, stopped_running_job=False, plan_source="morph-table",
        )  # fmt: skip
    ]))


def test_a_history_of_restarts_fits_100_columns_and_a_failed_relaunch_is_marked():
    """The stop, pause and moved columns appear only when a morph has them, and a relaunch that
    failed before its first step reads as failed, not as a move with a downtime."""
    layouts = ("t1p2d1 1f1b +R b8 m1", "t1p1d1 1f1b +R b8 m1")
    common = dict(requested_devices=1, from_devices=2, from_layout=layouts[0], to_devices=1, to_layout=layouts[1],
                  global_batch=8, resume_step=8, target_steps=10, stopped_running_job=False, plan_source="re-planned")
    failed = MorphRecord(requested_unix=0.0, relaunched_unix=1.0, failed_exit_code=1, **common)
    moved = MorphRecord(requested_unix=10.0, relaunched_unix=11.0, first_step_unix=15.0, downtime_seconds=5.0,
                        trigger=MorphTrigger.ELASTIC, **common)  # fmt: skip
    text = render(morph_history_table([failed, moved]))
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 100, text
    assert "failed" in text.splitlines()[3] and "5.0 s" in text and "elastic" in text
    assert "exited with code 1 before its first step: the run last trained on t1p2d1" in " ".join(text.split())
    header = text.splitlines()[1].split()
    assert "stop" not in header and "pause" not in header and "moved" not in header, header
    # A metrics step after the failed relaunch is the next move's, not the failed one's downtime.
    step = StepMetrics(step=9, loss=4.0, step_seconds=0.5, samples_per_second=16.0, global_batch=8, world_size=1,
                       layout=layouts[1], time_unix=20.0)  # fmt: skip
    assert with_downtime(failed, [step]).downtime_seconds is None
    assert with_downtime(failed.model_copy(update={"failed_exit_code": None}), [step]).downtime_seconds == 20.0
    live = MorphRecord(requested_unix=0.0, path="live", pause_seconds=0.4, bytes_moved=2**20, **common)
    assert {"pause", "moved"} <= set(render(morph_history_table([live])).splitlines()[1].split())
    # A lost replica's takeover: its downtime (from the loss noticed) under its pause (from the last step) is said.
    lost = live.model_copy(update={"trigger": MorphTrigger.FAILURE, "pause_seconds": 1.8, "downtime_seconds": 0.5,
                                   "first_step_unix": 0.5, "bytes_moved": 0})  # fmt: skip
    assert "the downtime counts from when the lost replica was noticed" in " ".join(render(morph_history_table([lost])).split())


@pytest.mark.parametrize(
    "flags, kept",
    [
        (["--schedules", "gpipe", "--no-recompute"], {"schedule": "gpipe", "recompute": False}),
        (["--tensor-parallel", "2"], {"tensor_parallel": 2}),
    ],
)
def test_a_resize_keeps_what_the_plan_was_asked_for(tmp_path, monkeypatch, flags, kept):
    """plan -> launch -> resize to a count the morph table lacks: the re-plan keeps the request's
    constraints, and works from another directory with the original profile gone."""
    monkeypatch.chdir(tmp_path)
    assert invoke("profile", "gpt-tiny", "--derive", "--device", "cpu", "-o", "profile.json").exit_code == 0
    made = invoke("plan", "--profile", "profile.json", "--cluster", "local", "--devices", "2", "--global-batch", "8",
                  *flags, "-o", "plans/plan.json")  # fmt: skip
    assert made.exit_code == 0, made.output
    Path("profile.json").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    launched = invoke("launch", "../plans/plan.json", "--run-dir", "../runs/asked", "--engine", "slurm", "--steps", "4")
    assert launched.exit_code == 0, launched.output
    resized = invoke("resize", "../runs/asked", "--devices", "4", "--steps", "8", "--json")
    assert resized.exit_code == 0, resized.output
    assert json.loads(resized.output)["plan_source"] == "re-planned"
    plan = read_run(tmp_path / "runs" / "asked").plan
    assert plan.chosen.devices == 4
    for name, value in kept.items():
        assert getattr(plan.chosen, name) == value, name
    # The request as the resize answered it: the count it asked for, every other constraint as made.
    made_request = json.loads((tmp_path / "plans" / "plan.json").read_text())["request"]
    assert plan.request.model_dump(mode="json") == {**made_request, "devices": 4}


@pytest.mark.multiprocess
def test_resize_reports_the_step_the_ranks_really_resumed_from(tmp_path):
    """The newest checkpoint verifies but one of its files does not load: the ranks fall back to
    step 2, and resize says so and records step 2, not the newest tag's step 4."""
    from pipectl.launch import run_engine
    from pipectl.rundir.morph_history import read_history

    plan = plan_of(
        candidate(), global_batch=8,
        morph_table=[MorphEntry(devices=1, candidate=candidate(1)), MorphEntry(devices=2, candidate=candidate())],
    )  # fmt: skip
    run = tmp_path / "run"
    prepared = prepare_launch(plan, run, LaunchOptions(steps=4, checkpoint_every=2))
    assert run_engine(prepared.command, prepared.run_dir, timeout_seconds=120, lock=prepared.lock) == 0
    prepared.lock.release()  # the job has ended
    newest = run / "checkpoints" / "step00000004"
    bad = sorted(newest.glob("rank-*.safetensors"))[0]
    bad.write_bytes(bad.read_bytes()[:100])
    manifest = CheckpointManifest.model_validate_json((newest / "manifest.json").read_text())
    relative = bad.relative_to(newest).as_posix()
    (newest / "manifest.json").write_text(manifest.model_copy(update={
        "files": {**manifest.files, relative: ckpt.sha256_file(bad)},
        "file_bytes": {**manifest.file_bytes, relative: bad.stat().st_size},
    }).model_dump_json())  # fmt: skip

    result = invoke("resize", run, "--devices", "1", "--steps", "5", "--timeout", "120")
    assert result.exit_code == 0, result.output + (run / "logs" / "engine.log").read_text()[-2000:]
    output = " ".join((result.output + result.stderr).split())  # the skipped checkpoint: stderr
    assert f"checkpoint step 4 could not be loaded ({bad}: " in output and "); resumed from step 2" in output
    (record,) = read_history(run)
    assert record.resume_step == 2 and any("could not be loaded" in note for note in record.notes)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 3, 4, 5]


def test_a_slurm_job_seen_only_by_its_heartbeats_is_stopped_cancelled_and_the_new_script_submitted(tmp_path, monkeypatch):
    """From a login node: no process of the job here, only its ranks' heartbeats in the shared run
    directory. The ranks (here a thread writing heartbeats as a worker on node-a17 would) stop at
    the stop file; resize then scancels the recorded job and sbatches the new script. Slurm's
    commands are not on this machine: `sbatch` and `scancel` are stand-ins that log their argv."""
    import os
    import threading

    from pipectl.artifacts.run import RankHeartbeat, RankState
    from pipectl.rundir.heartbeats import write_heartbeat

    run = make_run(tmp_path, engine=Engine.SLURM)
    (run / "slurm_job_id").write_text("4242\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, reply in (("sbatch", "Submitted batch job 4243"), ("scancel", "")):
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / (name + ".log")}\necho "{reply}"\n')
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    started = time.time()
    finished = threading.Event()

    def ranks_on_another_node() -> None:
        state = RankState.RUNNING
        while not finished.is_set():
            if (run / "stop_requested").exists():
                state = RankState.STOPPED
            for rank in (0, 1):
                now = time.time()
                write_heartbeat(run, RankHeartbeat(
                    rank=rank, pid=1000 + rank, host="node-a17", stage=rank, step=7, phase="step", state=state,
                    checkpoint_step=10 if state is RankState.STOPPED else None, started_unix=started,
                    beat_unix=now, progress_unix=now,
                ))  # fmt: skip
            if state is RankState.STOPPED:
                return
            time.sleep(0.1)

    remote = threading.Thread(target=ranks_on_another_node, daemon=True)
    remote.start()
    try:
        result = invoke("resize", run, "--devices", "1", "--steps", "20", "--submit", "--scancel", "--stop-timeout", "30")
    finally:
        finished.set()
        remote.join(timeout=5)
    output = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "stopping the job running on node-a17 at its next step boundary (2 ranks" in output
    assert "cancelled Slurm job 4242" in output and "submitted it as Slurm job 4243" in output
    assert (tmp_path / "scancel.log").read_text().split() == ["4242"]
    assert (tmp_path / "sbatch.log").read_text().split() == [str(run / "job.sbatch")]
    assert "--nproc_per_node 1" in (run / "job.sbatch").read_text()
    assert not (run / "stop_requested").exists()


def test_a_running_job_asked_for_the_layout_it_has_is_left_alone(tmp_path, monkeypatch):
    """`resize --devices 2` of a job training on the morph table's layout for 2: nothing to move,
    said in one line, exit 0; nothing stopped, written or recorded (it used to 'move' live to the
    same layout, pausing the job)."""
    import os

    from pipectl.artifacts.run import RankHeartbeat
    from pipectl.io import write_json_atomic
    from pipectl.rundir.heartbeats import heartbeat_path
    from pipectl.rundir.morph_history import read_records

    run = make_run(tmp_path)
    now = time.time()
    for rank in (0, 1):  # both ranks training, as their heartbeats say
        write_json_atomic(heartbeat_path(run, rank), RankHeartbeat(rank=rank, pid=os.getpid(), started_unix=now,
                                                                   progress_unix=now, beat_unix=now))  # fmt: skip
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    monkeypatch.chdir(tmp_path)
    result = invoke("resize", "runs/demo", "--devices", "2", "--steps", "20")
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "runs/demo already runs t1p2d1 1f1b b2 m4 on 2 devices: nothing to move" in said
    assert "launch --resume --steps 20" in said  # how its total of steps changes
    # Asked for 3: the table's entry for 3 is this layout on 2; the note of why, as the dry run gives it.
    said = " ".join(invoke("resize", "runs/demo", "--devices", "3", "--steps", "20").output.split())
    assert "--steps 20) note: uses 2 of 3 devices: 8 cannot be split over 3" in said, said
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before and read_records(run) == []


def test_launching_into_a_finished_run_says_how_to_train_on(tmp_path):
    """The hint for an existing run that trained all its steps: a larger total (a plain --resume is
    refused there), not just '--resume'."""
    run = make_run(tmp_path)
    writer = MetricsWriter(run, rank=0)
    for s in range(1, 11):
        writer.write(StepMetrics(step=s, loss=4.0, step_seconds=0.3, samples_per_second=26.0, global_batch=8,
                                 world_size=2, layout="t1p2d1 1f1b b2 m4", time_unix=time.time()))  # fmt: skip
    result = invoke("launch", run / "plan.json", "--run-dir", run)
    assert result.exit_code == 2
    assert "it trained all its 10 steps: train on with --resume --steps N (a larger total)" in " ".join(result.output.split())


def test_a_command_in_a_hint_quotes_a_path_with_a_space(tmp_path):
    """What a hint gives to paste into a shell pastes: `'runs/my run'`, not `runs/my run`."""
    from shlex import quote

    plan = plan_of(candidate(), global_batch=8)
    prepared = prepare_launch(plan, tmp_path / "my run", LaunchOptions(steps=2))
    prepared.lock.release()  # the run as a launch that ended leaves it
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    result = invoke("launch", tmp_path / "plan.json", "--run-dir", tmp_path / "my run")
    assert result.exit_code == 2
    assert f"`pipectl status {quote(str(prepared.run_dir))}`" in " ".join(result.output.split()), result.output
