"""`pipectl launch`: dry run, refusals with exit 2 and no traceback, slurm emission, and one real run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipectl.artifacts.plan import Candidate
from pipectl.artifacts.run import RankFailure
from pipectl.cli.main import app
from pipectl.io import write_json_atomic
from pipectl.report.run_tables import failure_report, out_of_memory_advice
from pipectl.schedule.ir import ScheduleKind
from builders import plan_of, write_plan

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_dry_run_prints_validated_config_and_command_and_writes_nothing(tmp_path):
    plan = write_plan(tmp_path / "plan.json")
    result = invoke("launch", plan, "--run-dir", tmp_path / "run", "--dry-run", "--json", "--steps", "5")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["ds_config"]["train_batch_size"] == 8
    assert payload["ds_config"]["gradient_accumulation_steps"] == 4
    assert "--nproc_per_node 2" in payload["command"]
    assert payload["job"]["steps"] == 5
    assert not (tmp_path / "run").exists()


def test_plan_deepspeed_cannot_run_exits_2_without_traceback(tmp_path):
    plan = write_plan(tmp_path / "plan.json", zero_stage=3)
    result = invoke("launch", plan, "--run-dir", tmp_path / "run")
    assert result.exit_code == 2
    assert "ZeRO stage 3" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


def test_plan_with_broken_batch_arithmetic_exits_2(tmp_path):
    path = write_plan(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    data["request"]["global_batch"] = 12  # b 2 x m 4 x d 1 = 8
    path.write_text(json.dumps(data))
    result = invoke("launch", path, "--run-dir", tmp_path / "run")
    assert result.exit_code == 2 and "12" in result.output and "Traceback" not in result.output


def test_existing_run_is_refused_and_bad_options_name_their_value(tmp_path):
    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    assert invoke("launch", plan, "--run-dir", run, "--engine", "slurm").exit_code == 0
    again = invoke("launch", plan, "--run-dir", run, "--engine", "slurm")
    assert again.exit_code == 2 and "already exists" in again.output
    # A dry run refuses what the launch would, and touches nothing.
    dry = invoke("launch", plan, "--run-dir", run, "--engine", "slurm", "--dry-run")
    assert dry.exit_code == 2 and "already exists" in dry.output
    (tmp_path / "a-file").write_text("x")
    dry = invoke("launch", plan, "--run-dir", tmp_path / "a-file", "--dry-run")
    assert dry.exit_code == 2 and "is a file" in dry.output and (tmp_path / "a-file").read_text() == "x"
    bad_elastic = invoke("launch", plan, "--run-dir", tmp_path / "x", "--engine", "torchrun", "--elastic", "3:1")
    assert bad_elastic.exit_code == 2 and "'3:1'" in bad_elastic.output
    bad_data = invoke("launch", plan, "--run-dir", tmp_path / "y", "--data", "nowhere.bin")
    assert bad_data.exit_code == 2 and "nowhere.bin" in bad_data.output
    missing = invoke("launch", tmp_path / "missing.json", "--run-dir", tmp_path / "z")
    assert missing.exit_code == 2 and "missing.json" in missing.output


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_run_directory_name_too_long_is_refused_and_leaves_no_folder(tmp_path, dry_run):
    """A 300-character name: one line naming its length and the limit, exit 2, and no `runs/`
    left behind (the launch creates the missing folders only once the name is known to fit)."""
    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "runs" / ("r" * 300)
    result = invoke("launch", plan, "--run-dir", run, *(["--dry-run"] if dry_run else []))
    assert result.exit_code == 2, result.output
    assert "300 bytes" in result.output and "255" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("option, value", [("--lr", "0"), ("--keep-checkpoints", "9" * 40), ("--warmup-steps", "9" * 23),
                                           ("--seed", "9" * 23), ("--seed", str(2**63 - 1)), ("--seed", "-1"),
                                           ("--master-addr", "bad!host"), ("--time-limit", "banana")])
def test_an_option_the_job_cannot_hold_is_named_with_its_value(tmp_path, option, value):
    # Values typer's own bounds let through (--lr 0 is at its minimum; integers past 64 bits):
    # the job's schema refuses them, and the refusal names the option, not the job's field.
    plan = write_plan(tmp_path / "plan.json")
    result = invoke("launch", plan, "--run-dir", tmp_path / "run", "--dry-run", option, value)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert option in result.output and value in result.output
    assert not (tmp_path / "run").exists()


def test_recover_in_memory_runs_a_torchrun_per_replica_and_is_refused_where_nothing_survives(tmp_path):
    from builders import gpt_tiny_candidate

    d2 = write_json_atomic(tmp_path / "d2.json", plan_of(gpt_tiny_candidate(1, 2, m=2)))
    result = invoke("launch", d2, "--run-dir", tmp_path / "run", "--recover-in-memory", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["job"]["recover_in_memory"] and "-m pipectl.resize.replicas --run-dir" in payload["command"]
    p2 = write_plan(tmp_path / "p2.json")
    alone = invoke("launch", p2, "--run-dir", tmp_path / "run", "--recover-in-memory", "--dry-run")
    assert alone.exit_code == 2 and "d = 1" in " ".join(alone.output.split()) and "Traceback" not in alone.output
    remote = invoke("launch", d2, "--run-dir", tmp_path / "run", "--recover-in-memory", "--engine", "torchrun", "--dry-run")
    assert remote.exit_code == 2 and "engine local" in " ".join(remote.output.split())


def test_slurm_engine_writes_the_script_and_says_how_to_submit(tmp_path):
    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    result = invoke("launch", plan, "--run-dir", run, "--engine", "slurm")
    assert result.exit_code == 0, result.output
    assert "sbatch" in result.output
    script = (run / "job.sbatch").read_text()
    assert "srun" in script and "--nproc_per_node 2" in script
    assert (run / "job.json").is_file() and (run / "ds_config.json").is_file()


@pytest.mark.multiprocess
def test_real_launch_trains_checkpoints_and_reports_prediction_error(tmp_path):
    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    result = invoke(
        "launch", plan, "--run-dir", run, "--steps", "6", "--checkpoint-every", "3", "--timeout", "240"
    )
    assert result.exit_code == 0, result.output + (run / "logs" / "engine.log").read_text()[-2000:]
    assert "prediction error" in result.output
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert lines[-1]["ranks"] == []  # the step's line holds no per-rank detail: logs/ranks.jsonl does
    details = [json.loads(line) for line in (run / "logs" / "ranks.jsonl").read_text().splitlines()]
    assert [d["step"] for d in details] == [1, 2, 3, 4, 5, 6] and {r["rank"] for r in details[-1]["ranks"]} == {0, 1}
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step")) == [
        "step00000003",
        "step00000006",
    ]
    assert (run / "schedule_rank0.txt").read_text().split() == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]


LAUNCH_TESTS = Path(__file__).resolve().parents[1] / "launch"  # holds pipectl_oom_model.py


@pytest.mark.multiprocess
def test_a_rank_out_of_memory_is_named_with_its_stage_layer_and_advice(tmp_path, monkeypatch):
    """A real out-of-memory: rank 1 holds the layer that asks for 2**60 bytes."""
    from builders import model_shape

    monkeypatch.chdir(LAUNCH_TESTS)  # where `pipectl launch` is run: the factory is imported from there
    model = "pipectl_oom_model:build"
    candidate = Candidate(
        devices=2, device="cpu", tensor_parallel=1, pipeline_parallel=2, data_parallel=1,
        micro_batch_size=2, micro_batches=2, schedule=ScheduleKind.ONE_F_ONE_B, recompute=False,
        zero_stage=1, stage_layers=[(0, 2), (2, 5)], predicted_step_seconds=0.05, samples_per_second=80.0,
        tflops_per_device=0.0, peak_memory_bytes=[3 * 2**20, 5 * 2**20], bubble_fraction=0.1,
        communication_fraction=0.0, cost_per_million_samples=0.0,
    )  # fmt: skip
    plan = write_json_atomic(tmp_path / "plan.json", plan_of(candidate, model=model, shape=model_shape(model)))
    run = tmp_path / "run"
    result = invoke("launch", plan, "--run-dir", run, "--steps", "3", "--data", "synthetic", "--timeout", "120")
    engine_log = (run / "logs" / "engine.log").read_text()
    assert result.exit_code == 1, result.output + engine_log[-2000:]
    output = " ".join(result.output.split())  # rich wraps long lines
    where = "rank 1 (stage 1, layers 2-4) ran out of memory in step 1, layer 3 'exhaust' (forward of micro-batch 0)"
    assert where in output
    assert "can't allocate memory" in output
    assert "the plan predicted 5 MiB peak for stage 1" in output
    assert "--memory-headroom" in output and "--micro-batch-size 1" in output and "--pipeline-parallel 4" in output
    assert "Traceback" not in result.output and "Traceback" in engine_log
    assert "rank 0 (stage 0, layers 0-1) also failed: RuntimeError:" in output  # its peer went away
    record = json.loads((run / "logs" / "failure-rank1.json").read_text())
    assert record["out_of_memory"] and record["layer_name"] == "exhaust" and record["stage"] == 1


def failure(rank: int, **fields) -> RankFailure:
    return RankFailure(rank=rank, exception=fields.pop("exception", "RuntimeError"), **fields)


def test_a_failed_rank_is_reported_by_rank_and_its_exceptions_first_line():
    message, hint = failure_report(
        [
            failure(0, stage=0, stage_layers=(0, 4), step=3, phase="backward of micro-batch 1",
                    exception="builtins.ValueError", message="loss is nan\nsecond line"),
            failure(1, stage=1, step=3, phase="recv activations", message="Connection closed by peer"),
        ]
    )  # fmt: skip
    lines = message.splitlines()
    assert lines[0] == "rank 0 (stage 0, layers 0-3) failed in step 3 (backward of micro-batch 1)"
    assert lines[1].strip() == "ValueError: loss is nan"
    assert lines[2].strip() == "rank 1 (stage 1) also failed: RuntimeError: Connection closed by peer"
    assert hint is None and "memory" not in message
    assert failure_report([]) == ("", None)


def test_out_of_memory_gives_the_plans_figure_and_only_the_changes_that_apply():
    record = failure(
        2, stage=1, stage_layers=(5, 6), step=1, phase="forward of micro-batch 0", layer_index=5, layer_name="head",
        exception="torch.OutOfMemoryError", message="CUDA out of memory. Tried to allocate 2.00 GiB.",
        out_of_memory=True, device="cuda", micro_batch_size=1, recompute=True, pipeline_parallel=4,
        predicted_peak_memory_bytes=70 * 2**30, peak_allocated_bytes=77 * 2**30, layout="t1p4d2 1f1b +R b1 m8",
    )  # fmt: skip
    message, hint = failure_report([record])
    assert message.splitlines()[0] == "rank 2 (stage 1, layer 5) ran out of memory in step 1, layer 5 'head' (forward of micro-batch 0)"
    assert "OutOfMemoryError: CUDA out of memory" in message
    assert "the plan predicted 70 GiB peak for stage 1 (per device, layout t1p4d2 1f1b +R b1 m8); 77 GiB allocated" in message
    assert hint == out_of_memory_advice(record)
    # b = 1 and recomputation already on: neither is offered; headroom and more stages are
    assert "--memory-headroom" in hint and "--pipeline-parallel 8" in hint
    assert "--micro-batch-size" not in hint and "recomput" not in hint


@pytest.mark.multiprocess
def test_wall_time_checkpoints_are_taken_by_both_ranks_together_and_change_no_loss(tmp_path):
    """--checkpoint-every 0.15s on two pipeline ranks: the ranks vote at each step boundary, so every
    checkpoint holds both ranks' files of one step; training is not changed by them."""
    from pipectl.rundir.checkpoints import list_checkpoints, read_events

    plan = write_plan(tmp_path / "plan.json")
    plain, timed = tmp_path / "plain", tmp_path / "timed"
    assert invoke("launch", plan, "--run-dir", plain, "--steps", "12", "--timeout", "120").exit_code == 0
    result = invoke("launch", plan, "--run-dir", timed, "--steps", "12", "--checkpoint-every", "0.15s",
                    "--keep-checkpoints", "50", "--timeout", "120")  # fmt: skip
    assert result.exit_code == 0, result.output
    events = read_events(timed)
    assert len(events) >= 3 and all(e.outcome.value == "committed" for e in events)  # a step takes ~40 ms
    assert all(e.interval_seconds == 0.15 for e in events)
    checkpoints = list_checkpoints(timed, hash_files=True)
    assert [c.step for c in checkpoints] == [e.step for e in events] and all(c.verified for c in checkpoints)
    assert all(len(c.manifest.files) == 2 for c in checkpoints)
    losses = lambda run: [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses(timed) == losses(plain)
    status = invoke("status", timed)
    assert "every 0.15 s, at the end" in " ".join(status.output.split())


@pytest.mark.multiprocess
def test_a_checkpoint_that_verifies_but_does_not_load_is_skipped_and_the_terminal_says_so(tmp_path):
    """Both ranks resume from step 2 when a file of step 4 is truncated behind a recomputed hash."""
    from pipectl.artifacts.run import CheckpointManifest
    from pipectl.rundir.checkpoints import sha256_file, verify_checkpoint

    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    first = invoke("launch", plan, "--run-dir", run, "--steps", "4", "--checkpoint-every", "2", "--timeout", "120")
    assert first.exit_code == 0, first.output
    newest = run / "checkpoints" / "step00000004"
    bad = sorted(newest.glob("rank-*.safetensors"))[-1]
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    manifest = CheckpointManifest.model_validate_json((newest / "manifest.json").read_text())
    relative = bad.relative_to(newest).as_posix()
    (newest / "manifest.json").write_text(manifest.model_copy(update={
        "files": {**manifest.files, relative: sha256_file(bad)},
        "file_bytes": {**manifest.file_bytes, relative: bad.stat().st_size},
    }).model_dump_json())  # fmt: skip
    assert verify_checkpoint(newest).verified

    result = invoke("launch", plan, "--run-dir", run, "--steps", "5", "--resume", "--timeout", "120")
    assert result.exit_code == 0, result.output + (run / "logs" / "engine.log").read_text()[-2000:]
    output = " ".join((result.output + result.stderr).split())  # the skipped checkpoint: stderr
    assert f"checkpoint step 4 could not be loaded ({bad}: " in output
    assert "); resumed from step 2" in output and "Traceback" not in output
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 3, 4, 5]  # both ranks retrained 3 and 4 from step 2
    resumed = json.loads((run / "logs" / "resume.json").read_text())
    assert resumed["step"] == 2 and resumed["tag"] == "step00000002"


def test_a_checkpoint_missing_a_ranks_file_fails_verify_and_resume_falls_back(tmp_path):
    """Rank 1's file of step 4 removed with its manifest entry: every listed file still hashes
    clean, but the manifest no longer covers the 2-rank layout it records. `status --verify`
    says so (exit 2) and a resume starts from step 2 on both ranks. (Every resume used to fail.)"""
    from pipectl.artifacts.run import CheckpointManifest

    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    first = invoke("launch", plan, "--run-dir", run, "--steps", "4", "--checkpoint-every", "2", "--timeout", "120")
    assert first.exit_code == 0, first.output
    newest = run / "checkpoints" / "step00000004"
    (newest / "rank-00001.safetensors").unlink()
    manifest = CheckpointManifest.model_validate_json((newest / "manifest.json").read_text())
    left = {k: v for k, v in manifest.files.items() if not k.endswith("rank-00001.safetensors")}
    (newest / "manifest.json").write_text(manifest.model_copy(update={
        "files": left, "file_bytes": {k: v for k, v in manifest.file_bytes.items() if k in left},
    }).model_dump_json())  # fmt: skip

    verified = invoke("status", run, "--verify")
    assert verified.exit_code == 2, verified.output
    assert "lists no file of rank 1 of the 2-rank layout it records" in " ".join(verified.output.split())
    result = invoke("launch", plan, "--run-dir", run, "--steps", "5", "--resume", "--timeout", "120")
    assert result.exit_code == 0, result.output + (run / "logs" / "engine.log").read_text()[-2000:]
    resumed = json.loads((run / "logs" / "resume.json").read_text())
    assert resumed["step"] == 2 and resumed["tag"] == "step00000002"


def test_a_live_run_is_refused_naming_the_pid_of_the_process_holding_its_lock(tmp_path):
    """Another process holds the run's lock: a second launch, --resume and --force exit 2 naming
    its pid and touch nothing; once that process is killed the kernel releases the lock."""
    import subprocess
    import sys

    from pipectl.rundir.lock import lock_run_dir

    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    assert invoke("launch", plan, "--run-dir", run, "--engine", "slurm").exit_code == 0  # writes the run only
    before = sorted(p.name for p in run.iterdir())
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pipectl.rundir.lock import lock_run_dir; "
         f"lock = lock_run_dir({str(run)!r}); print('locked', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        for extra in ([], ["--resume"], ["--force"]):
            result = invoke("launch", plan, "--run-dir", run, "--steps", "2", *extra)
            output = " ".join(result.output.split())
            assert result.exit_code == 2, (extra, result.output)
            assert f"is in use by a running job (pid {holder.pid})" in output and "Traceback" not in output
        assert sorted(p.name for p in run.iterdir()) == before  # --force deleted nothing
    finally:
        holder.kill()
        holder.wait(timeout=10)
    with lock_run_dir(run):  # released when its holder died, without any clean-up
        pass


@pytest.mark.multiprocess
def test_a_checkpoint_that_cannot_be_written_is_reported_without_a_traceback(tmp_path):
    """The resumed job runs under a file-size limit (`ulimit -f`, set by a shell wrapper, as an
    administrator or a full disk would impose it): its checkpoint's files cannot be written.
    The terminal says so and names the checkpoint that is intact; the failed save leaves nothing."""
    import os
    import subprocess
    import sys

    from pipectl.rundir.checkpoints import find_latest_verified, staging_leftovers
    from pipectl.runtime.checkpoint.ranks import unloadable_problem

    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    first = invoke("launch", plan, "--run-dir", run, "--steps", "2", "--timeout", "120")
    assert first.exit_code == 0, first.output
    limit_kib = 48  # above every log and metrics file of this run, below a checkpoint's optimizer state
    command = [
        "bash", "-c", f'ulimit -f {limit_kib} && exec "$@"', "limited",
        sys.executable, "-m", "pipectl.cli.main",
        "launch", str(plan), "--run-dir", str(run), "--steps", "4", "--resume", "--timeout", "120",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"), "COLUMNS": "300"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode not in (0, 2), output
    assert f"file size limit reached (ulimit -f: files up to {limit_kib * 1024:,} bytes) while writing checkpoint step 4" in output
    assert "checkpoint step 2 is intact" in output and "Traceback" not in output
    assert staging_leftovers(run) == []
    info, warnings = find_latest_verified(run, load_check=unloadable_problem)
    assert info.step == 2 and warnings == []


def _limited_launch(plan: Path, run: Path, limit_kib: int, *args: str):
    """`pipectl launch` under a file-size limit (`ulimit -f`, set by a shell wrapper)."""
    import os
    import subprocess
    import sys

    command = [
        "bash", "-c", f'ulimit -f {limit_kib} && exec "$@"', "limited",
        sys.executable, "-m", "pipectl.cli.main", "launch", str(plan), "--run-dir", str(run), *args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"), "COLUMNS": "300"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
    return done, " ".join((done.stdout + done.stderr).split())


@pytest.mark.multiprocess
def test_a_first_checkpoint_that_fails_stops_the_run_unless_it_trains_without_checkpoints(tmp_path):
    """No checkpoint to fall back on and the first one cannot be written (a file-size limit): the
    run stops at the next step boundary, not after training every step that could never be
    resumed. With --train-without-checkpoints it trains to the end and exits 0, saying so."""
    from pipectl.rundir.checkpoints import staging_leftovers
    from pipectl.rundir.metrics import read_metrics

    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    done, output = _limited_launch(plan, run, 48, "--steps", "40", "--checkpoint-every", "2", "--timeout", "120")
    assert done.returncode not in (0, 2), output
    assert "file size limit reached" in output and "stopped after step" in output, output
    assert "since no step trained from here could be resumed" in output and "Traceback" not in output
    # Both ranks stop for the one save that failed: the reason once, whole, naming the ranks together.
    said = " ".join(output.split())
    assert "also failed" not in said and ", as did rank " in said and "ranks 0, 1: file size limit reached" in said, said
    assert "launch again with --force (or with --train-without-checkpoints)" in said, said
    assert len(read_metrics(run)) < 10, output  # stopped within a few steps of the failure, not at 40
    assert staging_leftovers(run) == []

    anyway = tmp_path / "anyway"
    done, output = _limited_launch(plan, anyway, 48, "--steps", "6", "--checkpoint-every", "2", "--timeout", "120",
                                   "--train-without-checkpoints")  # fmt: skip
    assert done.returncode == 0, output
    assert len(read_metrics(anyway)) == 6 and "file size limit reached" in output, output
    said = " ".join(output.split())
    assert "nothing to resume from" in said and "--resume" not in said, said  # not 'continue with: ... --resume'


def _commit_checkpoint(run: Path, step: int) -> None:
    """A checkpoint of `step` committed in `run` as the ranks commit one (its manifest, one file)."""
    from pipectl.artifacts.run import CheckpointManifest
    from pipectl.rundir import checkpoints as ckpt

    tag = f"step{step:08d}"
    staged = run / "checkpoints" / ckpt.STAGING_DIR / "w1-00" / f"{tag}_universal"
    staged.mkdir(parents=True)
    (staged / "weights.pt").write_bytes(b"w")
    ckpt.commit_tag(run / "checkpoints", staged, tag,
                    CheckpointManifest(tag=tag, step=step, files=ckpt.hash_tree(staged), bytes=1))  # fmt: skip


def test_resume_keeps_what_was_not_passed_and_refuses_another_global_batch(tmp_path):
    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    assert invoke("launch", plan, "--run-dir", run, "--engine", "slurm", "--steps", "12",
                  "--checkpoint-every", "4", "--seed", "7").exit_code == 0  # fmt: skip
    _commit_checkpoint(run, 4)

    result = invoke("launch", plan, "--run-dir", run, "--resume", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    job = json.loads(result.output)["job"]
    assert (job["engine"], job["steps"], job["checkpoint_every"], job["seed"]) == ("slurm", 12, 4, 7)
    passed = json.loads(invoke("launch", plan, "--run-dir", run, "--resume", "--dry-run", "--json", "--steps", "16").output)
    assert (passed["job"]["steps"], passed["job"]["checkpoint_every"]) == (16, 4)
    # A new total must lie beyond what the run has trained (its checkpoint at step 4).
    fewer = invoke("launch", plan, "--run-dir", run, "--resume", "--dry-run", "--steps", "4")
    assert fewer.exit_code == 2 and "--steps 4 is not beyond the 4 steps" in fewer.output
    assert json.loads((run / "job.json").read_text())["steps"] == 12
    # A failure rate only `auto` reads, given beside the run's own interval, would change nothing.
    mtbf = invoke("launch", plan, "--run-dir", run, "--resume", "--dry-run", "--mtbf-hours", "5")
    assert mtbf.exit_code == 2 and "Traceback" not in mtbf.output, mtbf.output
    assert "chooses the interval of --checkpoint-every auto, but the interval is the run's --checkpoint-every 4" in mtbf.output
    auto = invoke("launch", plan, "--run-dir", run, "--resume", "--dry-run", "--json", "--mtbf-hours", "5",
                  "--checkpoint-every", "auto")  # fmt: skip
    assert auto.exit_code == 0, auto.output
    # A run of auto with its failure rate, resumed with another interval: the rate it no longer reads goes
    # (stored, --print-config would print it beside the interval, and that file given back was refused).
    rated = tmp_path / "rated"
    assert invoke("launch", plan, "--run-dir", rated, "--engine", "slurm", "--steps", "12", "--checkpoint-every", "auto",
                  "--mtbf-hours", "5").exit_code == 0  # fmt: skip
    _commit_checkpoint(rated, 4)
    fixed = invoke("launch", plan, "--run-dir", rated, "--resume", "--dry-run", "--json", "--checkpoint-every", "2")
    assert fixed.exit_code == 0 and json.loads(fixed.output)["job"]["mtbf_hours"] is None, fixed.output
    printed = invoke("launch", plan, "--run-dir", rated, "--resume", "--print-config", "--checkpoint-every", "2")
    assert printed.exit_code == 0 and "mtbf_hours = 5" not in printed.output, printed.output

    bigger = write_plan(tmp_path / "bigger.json", m=8)  # B 16 instead of 8
    result = invoke("launch", bigger, "--run-dir", run, "--resume", "--engine", "slurm")
    assert result.exit_code == 2 and "the plan's global batch is 16, the run at" in " ".join(result.output.split())
    assert "trains with 8" in result.output and "Traceback" not in result.output
    result = invoke("launch", bigger, "--run-dir", run, "--resume", "--change-global-batch")
    assert result.exit_code == 0, result.output
    assert json.loads((run / "job.json").read_text())["global_batch_changes"] == ["B 8 -> 16 after step 4"]


def test_a_stored_overlay_that_sets_an_options_key_still_resumes(tmp_path):
    """A run launched before overlays were refused keys a launch option sets (gradient_clipping:
    0.3 was accepted) resumes with its overlay; a new overlay setting one is refused."""
    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    assert invoke("launch", plan, "--run-dir", run, "--engine", "slurm", "--steps", "12").exit_code == 0
    job = json.loads((run / "job.json").read_text())
    job["ds_config_overlay"] = {"gradient_clipping": 0.3}
    job["options"].setdefault("deepspeed", {})["overlay"] = {"gradient_clipping": 0.3}
    (run / "job.json").write_text(json.dumps(job))
    _commit_checkpoint(run, 4)
    resumed = invoke("launch", plan, "--run-dir", run, "--resume", "--dry-run", "--json")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.output)["ds_config"]["gradient_clipping"] == 0.3
    (tmp_path / "lr.json").write_text('{"optimizer": {"params": {"lr": 0.5}}}')
    (tmp_path / "betas.json").write_text('{"optimizer": {"params": {"betas": [0.9, 0.95]}}}')
    betas = invoke("launch", plan, "--run-dir", tmp_path / "new", "--dry-run", "--json", "--ds-config-overlay",
                   tmp_path / "betas.json")  # fmt: skip
    assert json.loads(betas.output)["job"]["training"]["betas"] == [0.9, 0.95]  # what it trains with
    refused = invoke("launch", plan, "--run-dir", run, "--resume", "--dry-run", "--ds-config-overlay", tmp_path / "lr.json")
    assert refused.exit_code == 2 and "sets optimizer.params.lr, which launch's --lr sets" in refused.output, refused.output


def test_a_run_whose_options_an_earlier_version_stored_empty_still_resumes(tmp_path):
    """`--model ""` and `--partition ""` were taken as unset and stored as '' in job.json's options;
    a user's file with an empty value is refused, a run's own file reads it as unset."""
    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    assert invoke("launch", plan, "--run-dir", run, "--engine", "slurm", "--steps", "12").exit_code == 0
    job = json.loads((run / "job.json").read_text())
    job["options"].setdefault("model", {})["reference"] = ""
    job["options"].setdefault("slurm", {})["partition"] = ""
    (run / "job.json").write_text(json.dumps(job))
    _commit_checkpoint(run, 4)
    resumed = invoke("launch", plan, "--run-dir", run, "--resume", "--dry-run")
    assert resumed.exit_code == 0, resumed.output
    assert invoke("status", run).exit_code == 0


def test_resume_refuses_a_plan_of_another_model_before_touching_the_run(tmp_path):
    """The run's checkpoint holds another model's tensors: refused before any rank starts, the
    run's files as they were (the ranks used to fail loading it, after job.json had been rewritten)."""
    from pipectl.artifacts.plan import ModelShape
    from pipectl.catalog import get_device
    from pipectl.models.registry import load_model_config
    from pipectl.profile.derive import derive_profile

    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    assert invoke("launch", plan, "--run-dir", run, "--engine", "slurm", "--steps", "12").exit_code == 0
    _commit_checkpoint(run, 4)
    wide = (REPO / "configs" / "models" / "gpt-tiny.yaml").read_text().replace("hidden: 64", "hidden: 128")
    (tmp_path / "wide.yaml").write_text(wide.replace("name: gpt-tiny", "name: gpt-wide"))
    config = load_model_config(str(tmp_path / "wide.yaml"))
    other = json.loads(plan.read_text())
    other.update(model="gpt-wide", model_reference=str(tmp_path / "wide.yaml"),
                 model_shape=ModelShape.of_profile(derive_profile(config, get_device("cpu"), [2])).model_dump(mode="json"))
    (tmp_path / "other.json").write_text(json.dumps(other))
    before = (run / "job.json").read_text()

    result = invoke("launch", tmp_path / "other.json", "--run-dir", run, "--resume")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "the plan is for model 'gpt-wide', the run at" in " ".join(result.output.split())
    assert "trains 'gpt-tiny'" in result.output
    assert (run / "job.json").read_text() == before


def test_resuming_a_finished_run_without_a_new_total_is_refused_before_any_rank_starts(tmp_path):
    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    assert invoke("launch", plan, "--run-dir", run, "--engine", "slurm", "--steps", "4").exit_code == 0
    _commit_checkpoint(run, 4)
    result = invoke("launch", plan, "--run-dir", run, "--resume")
    assert result.exit_code == 2 and "has trained all its 4 steps: nothing is left to train" in result.output
    assert "--steps 8" in result.output and "Traceback" not in result.output


def _start_launch(plan: Path, run: Path, *args: str):
    """`pipectl launch` as its own process (a user's terminal), output captured."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"), "COLUMNS": "300"}
    command = [sys.executable, "-m", "pipectl.cli.main", "launch", str(plan), "--run-dir", str(run), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait_for_steps(run: Path, steps: int, launcher, seconds: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    metrics = run / "metrics.jsonl"
    while time.monotonic() < deadline and launcher.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {steps} within {seconds} s: {launcher.poll()}")


def _train_then(tmp_path: Path, act) -> tuple[Path, Path, object]:
    """A long local job of 2 ranks that trains 3 steps, then `act(launcher)` (a signal to the
    launching pipectl); returns (plan, run, launcher), the launcher ended either way."""
    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    launcher = _start_launch(plan, run, "--steps", "100000", "--timeout", "240")
    try:
        _wait_for_steps(run, 3, launcher)
        act(launcher)
    finally:
        launcher.kill()
    return plan, run, launcher


def _processes_of(run: Path) -> list:
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        if str(run) in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found


@pytest.mark.multiprocess
def test_a_stopped_rank_ends_the_job_in_bounded_time_and_is_named(tmp_path):
    """SIGSTOP of rank 1: rank 0 times out in its next collective (--collective-timeout 10), pipectl
    names rank 1 from the heartbeats (not the rank that timed out) and ends every process."""
    import os
    import signal
    import time

    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    launcher = _start_launch(plan, run, "--steps", "100000", "--collective-timeout", "10", "--timeout", "240")
    try:
        _wait_for_steps(run, 3, launcher)
        time.sleep(1.5)  # a heartbeat (every second) since the engine was built: it knows its stage
        rank1 = json.loads((run / "logs" / "heartbeat-rank1.json").read_text())["pid"]
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        output, _ = launcher.communicate(timeout=120)
        ended_after = time.monotonic() - stopped
    finally:
        launcher.kill()
    output = " ".join(output.split())
    assert launcher.returncode == 1, output
    assert ended_after < 60, ended_after  # timeout 10 s + a check; the default was 10 minutes
    assert f"rank 1 (stage 1, pid {rank1}) stopped responding: no heartbeat for" in output
    assert "its process is stopped (SIGSTOP, or a debugger); the other ranks waited for it" in output
    assert "Timed out waiting 10000ms" in output  # rank 0's own record, after the named cause
    assert output.index("rank 1 (stage 1") < output.index("rank 0 (stage 0")
    assert "ended without a word" not in output  # pipectl ended the stopped rank itself: no second, wrong account
    assert "Traceback" not in output
    assert _processes_of(run) == []


@pytest.mark.multiprocess
def test_a_local_job_listens_on_loopback_only(tmp_path):
    """Every socket a 2-rank local job listens on (torchrun's rendezvous and stores, the ranks'
    own) is bound to 127.0.0.1: a store asks for no password, so none may be reachable from the
    network. (torchrun's stores used to listen on every interface.)"""
    import psutil

    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    launcher = _start_launch(plan, run, "--steps", "40", "--timeout", "240")
    listening: dict[tuple[str, int], str] = {}
    try:
        _wait_for_steps(run, 2, launcher)
        root = psutil.Process(launcher.pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                sockets = process.net_connections(kind="inet")
                name = " ".join(process.cmdline()[1:3])
            except psutil.NoSuchProcess:
                continue
            for sock in sockets:
                if sock.status == psutil.CONN_LISTEN:
                    listening[(name, sock.laddr.port)] = sock.laddr.ip
        output, _ = launcher.communicate(timeout=180)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output
    assert any("pipectl.runtime.engines.loopback" in name for name, _ in listening), listening  # torchrun's stores seen
    assert all(ip == "127.0.0.1" for ip in listening.values()), listening


@pytest.mark.multiprocess
def test_a_closed_terminal_stops_the_job_at_a_checkpoint_and_leaves_nothing_running(tmp_path):
    """SIGHUP (the terminal closed) is handled as SIGTERM: the ranks stop at the end of a step
    after a checkpoint, no process of the job is left, and the run resumes. (The ranks used to
    train on, re-parented and unsupervised.)"""
    import signal

    plan, run, launcher = _train_then(tmp_path, lambda job: (job.send_signal(signal.SIGHUP), job.communicate(timeout=120)))
    assert launcher.returncode == 128 + signal.SIGHUP  # stopped short of its steps: not the exit of a finished run
    assert _processes_of(run) == []
    checkpoint = json.loads((run / "logs" / "heartbeat-rank0.json").read_text())["checkpoint_step"]
    assert checkpoint >= 3
    resumed = invoke("launch", plan, "--run-dir", run, "--resume", "--steps", checkpoint + 2)
    assert resumed.exit_code == 0, resumed.output
    assert f"resumed from step {checkpoint}" in resumed.output


@pytest.mark.multiprocess
def test_a_job_a_resize_stops_says_so_in_its_launch_terminal_not_to_resume_it(tmp_path):
    """`resize --restart` from another terminal writes the stop file and relaunches the job itself:
    the first terminal says the resize stopped it and where to follow it, not the raw file name
    and a `--resume` that the running relaunch would refuse."""
    from pipectl.rundir.checkpoints import STOP_FILE

    said: list[str] = []

    def stop_as_a_resize_does(job):
        (tmp_path / "run" / STOP_FILE).write_text("")
        said.append(job.communicate(timeout=120)[0])

    _, run, launcher = _train_then(tmp_path, stop_as_a_resize_does)
    assert launcher.returncode == 0, said
    step = json.loads((run / "logs" / "heartbeat-rank0.json").read_text())["checkpoint_step"]
    assert f"stopped at step {step}, checkpoint written: pipectl resize" in said[0]  # not the file's name
    assert f"stopped at step {step} for pipectl resize, which starts the job again" in said[0]
    assert f"pipectl status {run} --follow" in said[0] and "--resume" not in said[0]
@pytest.mark.multiprocess
def test_a_killed_pipectl_leaves_no_job_training_unsupervised(tmp_path):
    """kill -9 of `pipectl launch`: its ranks see their supervisor gone, stop together at the end of
    a step after a checkpoint, and torchrun exits with them; the run resumes. (They used to train
    on, re-parented, and a --resume was refused while they held the run.)"""
    import signal
    import time

    plan, run, launcher = _train_then(tmp_path, lambda job: (job.send_signal(signal.SIGKILL), job.wait(timeout=10)))
    deadline = time.monotonic() + 90
    while _processes_of(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _processes_of(run)
    for process in left:
        process.kill()
    assert left == []
    beats = [json.loads(p.read_text()) for p in sorted((run / "logs").glob("heartbeat-rank*.json"))]
    assert {b["state"] for b in beats} == {"stopped"} and beats[0]["checkpoint_step"] >= 3, beats
    status = " ".join(invoke("status", run).output.split())
    step = beats[0]["checkpoint_step"]
    assert f"stopped at step {step}, checkpoint written: the launching pipectl (pid {launcher.pid}) ended" in status, status
    resumed = invoke("launch", plan, "--run-dir", run, "--resume", "--steps", beats[0]["checkpoint_step"] + 2)
    assert resumed.exit_code == 0, resumed.output


def _ctrl_c_while_starting(plan: Path, run: Path, *args: str) -> tuple[int, str]:
    """`pipectl launch` interrupted once it has started its ranks (engine.log written to), long
    before their first step: its exit code and output on one line."""
    import signal
    import time

    log = run / "logs" / "engine.log"
    written = log.stat().st_size if log.is_file() else -1
    launcher = _start_launch(plan, run, *args, "--timeout", "240")
    try:
        deadline = time.monotonic() + 60
        while (log.stat().st_size if log.is_file() else -1) == written and time.monotonic() < deadline:
            time.sleep(0.02)  # the launcher has started; its ranks are far from their first step
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    return launcher.returncode, " ".join(output.split())


@pytest.mark.multiprocess
def test_ctrl_c_while_the_ranks_start_is_a_stop_not_a_failure(tmp_path):
    """Ctrl-C before the first step (the ranks still importing, their handlers not yet set): the
    launcher reports them ended by SIGTERM as failed; pipectl says the job was stopped, nothing
    trained, how to start again, and exits 130, without the launcher's failure dump."""
    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    code, said = _ctrl_c_while_starting(plan, run, "--steps", "100000")
    assert code == 130, said
    assert f"stopped before the first step (SIGINT): nothing trained; start it again with: pipectl launch {plan} " \
           f"--run-dir {run} --force" in said, said  # fmt: skip
    assert "Root Cause" not in said and "error:" not in said and not (run / "metrics.jsonl").is_file(), said
    assert _processes_of(run) == []

    # The same while a resume starts: the run's earlier steps were not trained by this launch.
    trained = _start_launch(plan, run, "--steps", "2", "--force", "--timeout", "240")
    assert trained.wait(timeout=240) == 0, trained.communicate()[0]
    code, said = _ctrl_c_while_starting(plan, run, "--resume", "--steps", "100000")
    assert code == 130, said
    assert f"stopped before its first step (SIGINT): the run stays at its checkpoint; continue with: pipectl launch " \
           f"{plan} --run-dir {run} --resume" in said, said  # fmt: skip
    assert "Root Cause" not in said and "error:" not in said, said
    assert _processes_of(run) == []


@pytest.mark.multiprocess
def test_sigterm_to_torchrun_after_a_clean_checkpoint_exits_0(tmp_path):
    """torchrun exits 1 when it is signalled even though its ranks stop cleanly; pipectl says what
    happened and exits 0, and the run resumes from the checkpoint the ranks wrote."""
    import psutil

    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    launcher = _start_launch(plan, run, "--steps", "100000", "--timeout", "240")
    try:
        _wait_for_steps(run, 3, launcher)
        torchrun = [p for p in psutil.Process(launcher.pid).children() if "pipectl.runtime.engines.loopback" in " ".join(p.cmdline())]
        assert len(torchrun) == 1
        torchrun[0].terminate()
        output, _ = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    output = " ".join(output.split())
    assert launcher.returncode == 0, output
    step = json.loads((run / "logs" / "heartbeat-rank0.json").read_text())["checkpoint_step"]
    assert f"the launcher exited with code 1 (it was signalled), but every rank stopped cleanly after writing checkpoint step {step}" in output
    assert (run / "checkpoints" / f"step{step:08d}").is_dir()
    assert "Traceback" not in output and _processes_of(run) == []


@pytest.mark.multiprocess
def test_a_learning_rate_schedule_runs_is_monitored_and_survives_a_resume(tmp_path):
    """warmup-decay over 6 steps, DeepSpeed's CSV and TensorBoard monitors from an overlay file
    (TensorBoard offline: its event file read back); then the last checkpoint is lost and the run
    resumes from step 3: the scheduler resumes at its step (a fresh one would warm up from 0 again),
    so steps 4-6 repeat their losses exactly."""
    import csv
    import shutil

    plan = write_plan(tmp_path / "plan.json")
    run = tmp_path / "run"
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(
        f"csv_monitor:\n  enabled: true\n  output_path: {tmp_path / 'monitor'}\n  job_name: demo\n"
        f"tensorboard:\n  enabled: true\n  output_path: {tmp_path / 'tensorboard'}\n  job_name: demo\n"
    )
    first = invoke(
        "launch", plan, "--run-dir", run, "--steps", "6", "--checkpoint-every", "3", "--lr-schedule", "warmup-decay",
        "--warmup-steps", "2", "--weight-decay", "0.01", "--ds-config-overlay", overlay, "--timeout", "240",
    )  # fmt: skip
    assert first.exit_code == 0, first.output + (run / "logs" / "engine.log").read_text()[-2000:]
    with (tmp_path / "monitor" / "demo" / "Train_Samples_lr.csv").open() as handle:
        lrs = [float(row["lr"]) for row in csv.DictReader(handle)]
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 7.5e-4, 5e-4, 2.5e-4])  # linear warm-up, then linear decay
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard" / "demo")).Reload()
    logged = [event.value for event in events.Scalars("Train/Samples/train_loss")]
    measured = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == pytest.approx(measured, rel=1e-6)
    job = json.loads((run / "job.json").read_text())
    assert job["training"]["lr_schedule"] == "warmup-decay" and job["ds_config_overlay"]["csv_monitor"]["enabled"]

    shutil.rmtree(run / "checkpoints" / "step00000006")
    resumed = invoke("launch", plan, "--run-dir", run, "--resume", "--timeout", "240")
    assert resumed.exit_code == 0, resumed.output + (run / "logs" / "engine.log").read_text()[-2000:]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6, 4, 5, 6]
    for before, after in zip(lines[3:6], lines[6:]):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-6, abs=0), after["step"]
    config = json.loads((run / "ds_config.json").read_text())
    assert config["scheduler"]["type"] == "WarmupDecayLR" and config["optimizer"]["params"]["weight_decay"] == 0.01


def _vanished_rank(run: Path, rank: int, phase: str) -> int:
    """A heartbeat of `rank` still 'running' whose process has ended (killed): its pid."""
    import subprocess
    import sys
    import time

    from pipectl.artifacts.run import RankHeartbeat
    from pipectl.rundir.heartbeats import heartbeat_path

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    now = time.time()
    beat = RankHeartbeat(rank=rank, pid=gone.pid, host=__import__("socket").gethostname(), stage=rank, step=5,
                         phase=phase, started_unix=now, beat_unix=now, progress_unix=now)  # fmt: skip
    heartbeat_path(run, rank).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(heartbeat_path(run, rank), beat)
    return gone.pid


@pytest.mark.parametrize("message, first", [("Connection reset by peer", True), ("loss is nan", False)])
def test_a_rank_killed_without_a_record_is_named_before_the_peer_it_cut_off(tmp_path, message, first):
    """A leaving rank killed in a live shrink: rank 0's record says only "Connection reset by peer";
    the terminal names the killed rank first. When rank 0's own error is the cause, it stays first."""
    import time

    from pipectl.cli.launch import job_failure
    from pipectl.rundir.failures import write_failure

    run = tmp_path / "run"
    started = time.time()
    pid = _vanished_rank(run, 1, "live resize: handing the state over")
    write_failure(run, failure(0, stage=0, step=5, phase="live resize: handing the state over",
                               exception="builtins.RuntimeError", message=message, time_unix=time.time()))  # fmt: skip
    lines = job_failure(run, started, "stopped after 4 of 10 steps", go_on="resume").message.splitlines()
    killed = f"rank 1 (stage 1, pid {pid}) ended without a word in step 5 (live resize: handing the state over): it was killed, or its process crashed"
    if first:
        assert lines[0] == killed and lines[1].startswith("then rank 0 (stage 0) failed")
    else:
        assert lines[0].startswith("rank 0 (stage 0) failed") and f"  {killed}" in lines


def test_a_rank_killed_while_training_is_named_in_the_step_after_the_last_recorded(tmp_path):
    """kill -9 of a rank on a fast job: its last heartbeat (once a second) says step 5, but this
    launch recorded steps up to 8, so it died in step 9; steps an earlier launch recorded (up to
    12, before a resume from an older checkpoint) do not count."""
    import time

    from pipectl.artifacts.run import StepMetrics
    from pipectl.cli.launch import job_failure
    from pipectl.rundir.failures import write_failure
    from pipectl.rundir.heartbeats import TRAINING_PHASE

    run = tmp_path / "run"
    started = time.time()
    pid = _vanished_rank(run, 1, TRAINING_PHASE)
    rows = [(step, started - 60) for step in range(1, 13)] + [(step, started + 1) for step in range(5, 9)]
    (run / "metrics.jsonl").write_text("".join(
        StepMetrics(step=step, loss=1.0, step_seconds=0.1, samples_per_second=1.0, global_batch=8, world_size=2,
                    time_unix=at).model_dump_json() + "\n" for step, at in rows))  # fmt: skip
    write_failure(run, failure(0, stage=0, step=9, exception="builtins.RuntimeError", message="Connection reset by peer",
                               time_unix=time.time()))  # fmt: skip
    message = job_failure(run, started, "the job exited with code 1 after 8 of 20 steps", go_on="resume").message
    assert f"rank 1 (stage 1, pid {pid}) ended without a word in step 9 (training)" in message


def test_ranks_a_stop_ended_during_start_up_are_not_called_killed(tmp_path):
    """Ctrl-C while the ranks start: they end before their handlers, with no record; the terminal
    does not blame them."""
    import time

    from pipectl.cli.launch import job_failure

    run = tmp_path / "run"
    started = time.time()
    _vanished_rank(run, 0, "start-up")
    message = job_failure(run, started, "the job exited with code 1 after 0 of 10 steps", go_on="resume").message
    assert message == "the job exited with code 1 after 0 of 10 steps"


@pytest.mark.multiprocess
def test_a_job_past_its_timeout_is_stopped_at_a_checkpoint_and_said_so_not_failed(tmp_path):
    """--timeout stops the job as a stop request does (the ranks checkpoint first): that is what
    was asked for, so no 'error:' and no pointer to a traceback, but the step it stopped at, the
    command that continues it, and 124 (as timeout(1)): it did not finish."""
    from cli_process import pipectl

    write_plan(tmp_path / "plan.json", p=1)
    done = pipectl("launch", "plan.json", "--run-dir", "runs/t", "--steps", "100000", "--timeout", "20", cwd=tmp_path)
    said = " ".join(done.stdout.split())
    assert done.returncode == 124, done.stdout + done.stderr
    assert "error:" not in done.stderr and "traceback" not in done.stderr.lower(), done.stderr
    assert "of 100000: it ran past its --timeout of 20 s; checkpoint written; continue with: pipectl launch plan.json " \
           "--run-dir runs/t --resume" in said, said
    stopped = int(re.search(r"stopped at step (\d+) of 100000", said).group(1))
    assert stopped > 0 and (tmp_path / "runs" / "t" / "checkpoints" / f"step{stopped:08d}").is_dir()
