"""The run directory: written completely, never clobbered by accident, read back and summarised."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from pipectl.artifacts.plan import Candidate, Plan
from pipectl.artifacts.run import DataKind, DataSpec, Engine, StepMetrics
from pipectl.errors import UserInputError
from pipectl.launch import LaunchOptions, build_job, check_data, prepare_launch
from pipectl.launch.prepare import prepare_run_dir
from pipectl.launch.prepare import read_run
from pipectl.rundir.status import run_status
from pipectl.rundir.metrics import MetricsWriter
from pipectl.schedule.ir import ScheduleKind
from builders import plan_of, model_shape


CONFIGS = Path(__file__).parents[2] / "configs" / "models"


def other_gpt_tiny(folder: Path, **changed) -> str:
    """gpt-tiny's YAML with `changed` fields, written to `folder`."""
    config = yaml.safe_load((CONFIGS / "gpt-tiny.yaml").read_text())
    config.update(changed, name="gpt-other")
    path = folder / "gpt-other.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def tiny_plan(p=2, d=1, b=2, m=4, layers=9, cuts=((0, 4), (4, 9))) -> Plan:
    candidate = Candidate(
        devices=p * d, device="cpu", tensor_parallel=1, pipeline_parallel=p, data_parallel=d,
        micro_batch_size=b, micro_batches=m, schedule=ScheduleKind.ONE_F_ONE_B, recompute=False,
        zero_stage=1, stage_layers=list(cuts), predicted_step_seconds=0.05, samples_per_second=160.0,
        tflops_per_device=0.0, peak_memory_bytes=[1] * p, bubble_fraction=0.1,
        communication_fraction=0.0, cost_per_million_samples=0.0,
    )  # fmt: skip
    shape = model_shape()
    if layers != shape.layers:  # a model the plan was not made for
        shape = shape.model_copy(update={"layer_parameter_counts": [*shape.layer_parameter_counts, 1][:layers]})
    return plan_of(candidate, shape=shape)


def test_prepare_writes_every_file(tmp_path):
    run = tmp_path / "runs" / "demo"
    prepared = prepare_launch(tiny_plan(), run, LaunchOptions(steps=7, checkpoint_every=3, master_port=29123))
    for name in ("plan.json", "job.json", "ds_config.json", "launch.sh"):
        assert (run / name).is_file(), name
    assert (run / "logs").is_dir() and (run / "checkpoints").is_dir()
    files = read_run(run)
    assert files.job.steps == 7 and files.job.checkpoint_every == 3
    assert files.job.world_size == 2 and files.job.master_port == 29123
    assert files.plan == tiny_plan()
    assert files.ds_config == prepared.ds_config
    assert "--nproc_per_node 2" in (run / "launch.sh").read_text()


def test_dry_run_writes_nothing(tmp_path):
    run = tmp_path / "dry"
    prepare_launch(tiny_plan(), run, LaunchOptions(), write=False)
    assert not run.exists()


def test_deepspeed_engine_writes_a_hostfile_and_the_rank_environment(tmp_path):
    prepare_launch(tiny_plan(), tmp_path / "ds", LaunchOptions(engine=Engine.DEEPSPEED))
    assert (tmp_path / "ds" / "hostfile").read_text() == "localhost slots=2\n"
    assert "OMP_NUM_THREADS=1\n" in (tmp_path / "ds" / ".deepspeed_env").read_text()


def fake_checkpoint(run: Path, step: int) -> Path:
    """A committed checkpoint of one file, as save_checkpoint leaves it."""
    from pipectl.artifacts.run import CheckpointManifest
    from pipectl.rundir import checkpoints as ckpt

    root = ckpt.checkpoints_dir(run)
    staged = root / ckpt.STAGING_DIR / "staged"
    staged.mkdir(parents=True)
    (staged / "weights.pt").write_bytes(b"w" + bytes([step]))
    tag = ckpt.tag_for_step(step)
    manifest = CheckpointManifest(tag=tag, step=step, files=ckpt.hash_tree(staged), bytes=2)
    return ckpt.commit_tag(root, staged, tag, manifest)


def test_resume_never_starts_over_silently(tmp_path):
    from pipectl.errors import CheckpointError

    run = tmp_path / "r"
    prepare_launch(tiny_plan(), run, LaunchOptions(steps=5))
    with pytest.raises(UserInputError, match="has no checkpoint, so it would start over from step 0") as info:
        prepare_launch(tiny_plan(), run, LaunchOptions(steps=5, resume=True))
    assert "--force" in info.value.hint
    bad = fake_checkpoint(run, 2)
    (bad / "weights.pt").write_bytes(b"changed")
    (fake_checkpoint(run, 4) / "manifest.json").write_text("{")  # a torn manifest
    with pytest.raises(CheckpointError, match=r"no checkpoint of .* can be loaded: .*step00000002.*sha256 mismatch") as info:
        prepare_launch(tiny_plan(), run, LaunchOptions(steps=5, resume=True))
    assert "step00000004" in info.value.message and info.value.exit_code == 2
    fake_checkpoint(run, 6)
    prepare_launch(tiny_plan(), run, LaunchOptions(steps=9, resume=True))  # a good one: resumes


def test_existing_run_is_not_clobbered_without_resume_or_force(tmp_path):
    run = tmp_path / "r"
    prepare_launch(tiny_plan(), run, LaunchOptions(steps=5))
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UserInputError, match="already exists") as info:
        prepare_launch(tiny_plan(), run, LaunchOptions(steps=5))
    # No checkpoint yet: --resume would be refused, so the hint does not offer it.
    assert info.value.hint.startswith("it has no checkpoint to resume from: start over with --force"), info.value.hint
    fake_checkpoint(run, 4)
    with pytest.raises(UserInputError, match="already exists") as info:
        prepare_launch(tiny_plan(), run, LaunchOptions(steps=5))
    assert info.value.hint.startswith("continue it with --resume, start over with --force"), info.value.hint
    prepare_launch(tiny_plan(), run, LaunchOptions(steps=9, resume=True))
    assert (run / "metrics.jsonl").is_file() and read_run(run).job.steps == 9
    forced = prepare_launch(tiny_plan(), run, LaunchOptions(steps=5, force=True))
    assert not (run / "metrics.jsonl").exists()
    assert forced.forced_away == f"{run} (0 steps trained, 1 checkpoint, the newest at step 4)"  # launch says it


def test_a_resume_keeps_its_checkpoint_interval_whatever_total_it_trains_to(tmp_path):
    """A run of 300 steps checkpointing every 100, stopped at 39 and resumed to 41: the stored
    interval outlasts the new total; the resume is not refused for a value this command did not
    give (its end is checkpointed anyway). A new run with that interval still is."""
    from typer.testing import CliRunner

    from pipectl.cli.main import app
    from pipectl.io import write_json_atomic

    plan = write_json_atomic(tmp_path / "plan.json", tiny_plan())
    run = tmp_path / "r"
    prepare_launch(tiny_plan(), run, LaunchOptions(steps=300, checkpoint_every="100"))
    fake_checkpoint(run, 39)
    launch = lambda *args: CliRunner().invoke(app, ["launch", str(plan), "--dry-run", *args])  # noqa: E731
    resumed = launch("--run-dir", str(run), "--resume", "--steps", "41")  # job.json's interval, this total
    assert resumed.exit_code == 0, resumed.output
    new = launch("--run-dir", str(tmp_path / "new"), "--steps", "41", "--checkpoint-every", "100")
    assert new.exit_code == 2 and "--checkpoint-every 100 exceeds --steps 41" in new.output, new.output


def test_foreign_folder_and_bad_flags_are_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UserInputError, match="not a pipectl run"):
        prepare_run_dir(tmp_path)
    with pytest.raises(UserInputError, match="contradict"):
        prepare_run_dir(tmp_path / "x", resume=True, force=True)
    with pytest.raises(UserInputError, match="no such run"):
        prepare_run_dir(tmp_path / "missing", resume=True)


@pytest.mark.parametrize("force", [False, True])
def test_a_launch_refused_for_its_run_directory_leaves_the_folder_as_it_was(tmp_path, force):
    """`pipectl launch plan.json --run-dir mydata` where mydata is a user's folder: refused, and no
    job.lock is left among the user's files; nor is a folder made for a refused --resume."""
    (tmp_path / "mydata").mkdir()
    (tmp_path / "mydata" / "notes.txt").write_text("mine")
    with pytest.raises(UserInputError, match="not a pipectl run"):
        prepare_launch(tiny_plan(), tmp_path / "mydata", LaunchOptions(steps=5, force=force))
    assert sorted(p.name for p in (tmp_path / "mydata").iterdir()) == ["notes.txt"]
    with pytest.raises(UserInputError, match="no such run"):
        prepare_launch(tiny_plan(), tmp_path / "missing", LaunchOptions(steps=5, resume=True))
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("job", ['{"job": "nightly"}', "not json", None])
def test_force_deletes_only_a_run_not_any_folder_holding_a_job_json(tmp_path, job):
    """`--force` on a folder whose job.json is not a run's (another tool's, a profile copied there)
    used to delete the folder whole, the user's other files with it."""
    folder = tmp_path / "proj"
    (folder / "data").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    if job is None:  # a pipectl file of another kind under the name
        (folder / "job.json").write_text(tiny_plan().model_dump_json())
    else:
        (folder / "job.json").write_text(job)
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(UserInputError, match="--force deletes a pipectl run, and .*proj is not one: its job.json is"):
        prepare_launch(tiny_plan(), folder, LaunchOptions(steps=5, force=True))
    assert sorted(p.name for p in folder.iterdir()) == before  # no job.lock either
    assert (folder / "notes.txt").read_text() == "mine"


def test_force_starts_over_a_run_whose_job_json_another_version_wrote(tmp_path):
    """A run's job.json that this version cannot validate is still a run's: --force is the way to
    start over (it used to be refused as 'not a pipectl run')."""
    run = tmp_path / "run"
    prepare_launch(tiny_plan(), run, LaunchOptions(steps=5))
    job = json.loads((run / "job.json").read_text())
    (run / "job.json").write_text(json.dumps({**job, "steps": "many", "written_by": "a future version"}))
    forced = prepare_launch(tiny_plan(), run, LaunchOptions(steps=5, force=True))
    assert forced.forced_away is not None and json.loads((run / "job.json").read_text())["steps"] == 5


@pytest.mark.parametrize("write", [False, True])
def test_a_run_directory_that_cannot_be_created_is_refused_by_a_dry_run_too(tmp_path, write):
    """--run-dir mine.yaml/sub: a dry run said all was well, and the launch failed."""
    (tmp_path / "mine.yaml").write_text("name: mine\n")
    with pytest.raises(UserInputError, match=r"cannot create run directory .*mine.yaml/sub: .*mine.yaml is not a folder"):
        prepare_launch(tiny_plan(), tmp_path / "mine.yaml" / "sub", LaunchOptions(steps=5), write=write)
    assert (tmp_path / "mine.yaml").read_text() == "name: mine\n"


def test_model_must_have_the_plans_layer_count(tmp_path):
    with pytest.raises(UserInputError, match="has 9 layers but the plan cuts 10"):
        prepare_launch(tiny_plan(layers=10, cuts=((0, 4), (4, 10))), tmp_path / "r", LaunchOptions())


@pytest.mark.parametrize(
    "changed, message",
    [
        ({"hidden": 128}, r"hidden 128, the plan was made for 64"),
        ({"seq_len": 64}, r"seq len 64, the plan was made for 32"),
    ],
)
def test_model_must_be_the_one_the_plan_was_made_for(tmp_path, changed, message):
    config = yaml.safe_load((CONFIGS / "gpt-tiny.yaml").read_text())
    config.update(changed, name="gpt-other")
    path = tmp_path / "gpt-other.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(UserInputError, match=message):
        prepare_launch(tiny_plan(), tmp_path / "r", LaunchOptions(model=str(path)), write=False)
    assert not (tmp_path / "r").exists()


def test_job_options_are_checked(tmp_path):
    with pytest.raises(UserInputError, match="exceeds --steps"):
        build_job(tiny_plan(), "r", LaunchOptions(steps=3, checkpoint_every=5))
    with pytest.raises(UserInputError, match="data file not found"):
        check_data(tiny_plan(), DataSpec(kind=DataKind.FILE, path=str(tmp_path / "no.bin")), "gpt-tiny")
    with pytest.raises(UserInputError, match="evenly over 3 nodes"):
        build_job(tiny_plan(), "r", LaunchOptions(engine=Engine.TORCHRUN, nodes=3))


def test_read_run_names_what_is_missing(tmp_path):
    with pytest.raises(UserInputError, match="no run directory"):
        read_run(tmp_path / "nope")
    with pytest.raises(UserInputError, match="no job.json"):
        read_run(tmp_path)


def test_status_summarises_metrics_and_layout_changes(tmp_path):
    run = tmp_path / "r"
    prepare_launch(tiny_plan(), run, LaunchOptions(steps=6))
    writer = MetricsWriter(run, rank=0)
    steps = [(0.5, "A"), (0.1, "A"), (0.05, "A"), (0.9, "B"), (0.04, "B"), (0.1, "B")]
    for step, (seconds, layout) in enumerate(steps, start=1):
        writer.write(
            StepMetrics(step=step, loss=5.0 - step, step_seconds=seconds, predicted_step_seconds=0.05,
                        samples_per_second=8 / seconds, global_batch=8, world_size=2, layout=layout)
        )  # fmt: skip
    status = run_status(run)
    assert status.steps_done == 6 and status.trained
    assert status.last_loss == pytest.approx(-1.0)
    assert status.layouts == ["A", "B"]
    # The current layout's steps, its first (warm-up) step excluded: B's 0.04 and 0.1 s.
    assert status.prediction.steps == 2
    assert status.prediction.max_abs_error == pytest.approx(0.5)  # |0.1 - 0.05| / 0.1
    payload = json.loads(json.dumps(status.to_dict()))
    assert payload["steps_done"] == 6 and payload["checkpoints"] == []


def test_the_plans_profile_goes_into_the_run_and_a_missing_one_is_refused(tmp_path):
    from pipectl.io import load_model, write_json_atomic
    from pipectl.testing.profiles import synthetic_profile
    from pipectl.planfile import write_plan

    write_json_atomic(tmp_path / "profile.json", synthetic_profile(blocks=2))
    plan = write_plan(tmp_path / "plans" / "plan.json", tiny_plan(), profile_file=tmp_path / "profile.json")
    run = tmp_path / "runs" / "demo"
    prepare_launch(plan, run, LaunchOptions(steps=4), plan_dir=tmp_path / "plans")
    assert (run / plan.profile.file).read_bytes() == (tmp_path / "plans" / plan.profile.file).read_bytes()
    assert load_model(Plan, run / "plan.json").profile == plan.profile
    (tmp_path / "plans" / plan.profile.file).unlink()
    # plan.json copied alone: the profile it was made from, still the same bytes, stands in for the copy.
    copied = prepare_launch(plan, tmp_path / "runs" / "copied", LaunchOptions(steps=4), plan_dir=tmp_path / "plans")
    assert (copied.run_dir / plan.profile.file).read_bytes() == (tmp_path / "profile.json").read_bytes()
    (tmp_path / "profile.json").write_text("{}")  # changed since: no stand-in
    with pytest.raises(UserInputError, match=f"profile .*{plan.profile.file} is missing"):
        prepare_launch(plan, tmp_path / "runs" / "other", LaunchOptions(steps=4), plan_dir=tmp_path / "plans")
    assert not (tmp_path / "runs" / "other").exists()


def test_ranks_left_running_without_their_launcher_keep_the_run_locked(tmp_path):
    """The lock dies with the processes that hold it (pipectl and its launcher); a rank of the run
    that outlived both still trains and writes there, so a new job is refused, naming it."""
    import subprocess
    import sys

    from pipectl.rundir.lock import lock_run_dir

    run = tmp_path / "run"
    run.mkdir()
    # what `ps` shows of a rank of this run: its argv names the worker module and the run directory
    orphan = subprocess.Popen(
        [sys.executable, "-c", "import time; print(flush=True); time.sleep(60)"]
        + ["-m", "pipectl.runtime.worker", "--run-dir", str(run)],
        stdout=subprocess.PIPE,
    )
    try:
        # Popen returns once the child is forked; its argv is the one below only after exec, so
        # wait for the line it prints (a scan before that sees pytest's argv under load)
        orphan.stdout.readline()
        with pytest.raises(UserInputError, match=rf"ranks of an earlier job still run \(pids {orphan.pid}\)") as caught:
            lock_run_dir(run)
        assert f"kill -TERM {orphan.pid}" in caught.value.hint
    finally:
        orphan.kill()
        orphan.wait()
    with lock_run_dir(run):  # and free again once it is gone
        pass


def test_a_lock_held_before_its_holder_wrote_its_pid_is_refused_without_a_pid(tmp_path):
    """Two launches at once: the second may find the lock taken but no pid written yet."""
    import fcntl
    import os

    from pipectl.artifacts.run import LOCK_FILE
    from pipectl.rundir.lock import lock_run_dir

    run = tmp_path / "run"
    run.mkdir()
    fd = os.open(run / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, nothing recorded
        with pytest.raises(UserInputError, match=r"is in use by a running job \(pid unknown\)"):
            lock_run_dir(run)
    finally:
        os.close(fd)


def test_a_lock_held_by_another_process_never_names_the_pids_of_a_job_that_ended(tmp_path):
    """job.lock still records an ended job's pids while some other process holds the lock: the
    refusal names no dead pid (a hint to kill it would say 'No such process')."""
    import fcntl
    import subprocess
    import sys

    from pipectl.rundir.lock import lock_run_dir

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(ended.stdout)
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.lock").write_text(f"{dead} {dead}\n")
    holder = os.open(run / "job.lock", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: held against lock_run_dir here too
    try:
        with pytest.raises(UserInputError) as refused:
            lock_run_dir(run)
    finally:
        os.close(holder)
    assert "pid unknown" in refused.value.message and str(dead) not in refused.value.message + refused.value.hint
