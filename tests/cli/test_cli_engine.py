"""`--engine` end to end: `pipectl plan --engine torch` names the engine of its choice, bad
combinations are refused with exit 2 and no traceback, a torch plan launches (what that engine
cannot run is refused, naming it), and
`pipectl simulate --schedule zb-h1` times the split backward."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipectl.artifacts.plan import Engine, Plan
from pipectl.cli.main import app
from pipectl.io import load_model, write_json_atomic
from pipectl.testing.profiles import synthetic_profile

runner = CliRunner()


@pytest.fixture(scope="module")
def torch_plan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine")
    profile = folder / "profile.json"
    write_json_atomic(profile, synthetic_profile(blocks=16, micro_batch_sizes=[1, 2, 4]))
    out = folder / "plan.json"
    result = runner.invoke(app, ["plan", "--profile", str(profile), "--cluster", "a100-8x8", "--devices", "8",
                                 "--global-batch", "64", "--engine", "torch", "--no-morph", "-o", str(out)],
                           env={"COLUMNS": "200"})
    return result, out, profile


def test_plan_engine_torch_chooses_and_names_the_engine(torch_plan):
    result, out, _ = torch_plan
    assert result.exit_code == 0, result.output
    written = load_model(Plan, out)
    assert written.request.engine is Engine.TORCH and written.chosen.engine is Engine.TORCH
    assert written.chosen.schedule.value in ("zb-h1", "zbv", "interleaved")
    header = next(line for line in result.output.splitlines() if "samp/s" in line)
    assert "engine" in header.split()
    assert "PyTorch's pipelining runtime" in result.output


def test_launch_runs_a_torch_plan_and_refuses_what_that_engine_cannot_run(tmp_path):
    """A gpt-tiny interleaved plan for engine torch is launchable (the dry run writes its files;
    tests/runtime/test_torch_launch.py trains it); bf16 and a plan with d = 2 are refused, exit 2,
    naming the value, no traceback."""
    from builders import gpt_tiny_torch_candidate, plan_of

    plan = tmp_path / "plan.json"
    write_json_atomic(plan, plan_of(gpt_tiny_torch_candidate("interleaved", 2, v=2)))
    result = runner.invoke(app, ["launch", str(plan), "--run-dir", str(tmp_path / "run"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "-m pipectl.runtime.worker" in result.output
    result = runner.invoke(app, ["launch", str(plan), "--run-dir", str(tmp_path / "bf16"), "--dry-run", "--precision", "bf16"])
    assert result.exit_code == 2 and "the torch engine (PyTorch's pipelining runtime) trains in fp32 only" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "bf16").exists()
    wide = load_model(Plan, plan)
    wide = wide.model_copy(update={"chosen": wide.chosen.model_copy(update={"data_parallel": 2, "devices": 4, "micro_batches": 2})})
    write_json_atomic(plan, wide)
    result = runner.invoke(app, ["launch", str(plan), "--run-dir", str(tmp_path / "d2"), "--dry-run"])
    assert result.exit_code == 2 and "engine torch (PyTorch's pipelining runtime) that it cannot run: t1 d2" in result.output
    assert "Traceback" not in result.output


def test_any_engine_and_another_engine_disagree(torch_plan, tmp_path):
    _, _, profile = torch_plan
    result = runner.invoke(app, ["plan", "--profile", str(profile), "--cluster", "a100-8x8", "--global-batch", "64",
                                 "--engine", "torch", "--any-engine", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "--any-engine and --engine torch disagree" in result.output
    result = runner.invoke(app, ["plan", "--profile", str(profile), "--cluster", "a100-8x8", "--global-batch", "64",
                                 "--engine", "tpu", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_simulate_zb_h1_times_the_split_backward():
    result = runner.invoke(app, ["simulate", "--schedule", "zb-h1", "--pipeline-parallel", "4", "--micro-batches", "8",
                                 "--forward-ms", "1", "--backward-ms", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["schedule"] == "zb-h1"
    assert data["step_seconds"] == pytest.approx(0.027)  # m (f + b) + (p - 1)(f + I - W); 1F1B: 0.033
    terminal = runner.invoke(app, ["simulate", "--schedule", "zb-h1", "--pipeline-parallel", "2",
                                   "--micro-batches", "4", "--terminal"], env={"COLUMNS": "200"})
    assert terminal.exit_code == 0, terminal.output
    assert "I input gradient, W weight gradient" in terminal.output


def test_simulate_zb_h1_with_recompute_is_refused():
    result = runner.invoke(app, ["simulate", "--schedule", "zb-h1", "--pipeline-parallel", "4", "--micro-batches", "8",
                                 "--recompute"])
    assert result.exit_code == 2
    assert "zb-h1 schedule does not recompute" in result.output and "Traceback" not in result.output


def test_simulate_zbv_holds_two_chunks_and_times_the_v():
    result = runner.invoke(app, ["simulate", "--schedule", "zbv", "--pipeline-parallel", "4", "--micro-batches", "8",
                                 "--forward-ms", "1", "--backward-ms", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["schedule"] == "zbv" and data["chunks"] == 2
    # m (T_F + T_B) + (p - 1) T_F / 2 with I = W = 1 ms: 0.0255 s; zb-h1 0.027 s, 1F1B 0.033 s
    assert data["step_seconds"] == pytest.approx(0.0255)


@pytest.mark.parametrize("args, message", [
    (["--micro-batches", "4"], "needs micro-batches m >= 2p - 1 = 7 for p=4, got m=4"),
    (["--micro-batches", "8", "--chunks", "3"], "exactly 2 chunks per rank (a V), got v=3"),
])  # fmt: skip
def test_simulate_zbv_refuses_what_it_cannot_run(args, message):
    result = runner.invoke(app, ["simulate", "--schedule", "zbv", "--pipeline-parallel", "4", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


def test_plan_prices_zbv_and_simulate_reproduces_it(torch_plan, tmp_path):
    """Asked for zb-h1 and zbv, the plan prices both (zbv placed as its V); a zbv plan's predicted
    step is what `pipectl simulate` of the written plan gives."""
    _, _, profile = torch_plan
    out = tmp_path / "zbv.json"
    result = runner.invoke(app, ["plan", "--profile", str(profile), "--cluster", "a100-8x8", "--devices", "8",
                                 "--global-batch", "64", "--engine", "torch", "--schedule", "zbv", "--no-morph",
                                 "-o", str(out)], env={"COLUMNS": "200"})  # fmt: skip
    assert result.exit_code == 0, result.output
    chosen = load_model(Plan, out).chosen
    assert chosen.schedule.value == "zbv" and chosen.chunks == 2 and chosen.engine is Engine.TORCH
    simulated = runner.invoke(app, ["simulate", str(out), "--json"])
    assert simulated.exit_code == 0, simulated.output
    assert json.loads(simulated.output)["step_seconds"] == pytest.approx(chosen.predicted_step_seconds, rel=1e-12)
    both = runner.invoke(app, ["plan", "--profile", str(profile), "--cluster", "a100-8x8", "--devices", "8",
                               "--global-batch", "64", "--engine", "torch", "--schedules", "zb-h1,zbv", "--no-morph",
                               "--top", "40", "-o", str(tmp_path / "both.json")], env={"COLUMNS": "200"})  # fmt: skip
    assert both.exit_code == 0, both.output
    written = load_model(Plan, tmp_path / "both.json")
    assert {c.schedule.value for c in [written.chosen, *written.candidates]} == {"zb-h1", "zbv"}

def test_a_schedule_only_the_torch_engine_runs_is_pointed_to_it(tmp_path):
    """--schedule interleaved on the default engine was refused with a hint to --any-engine only,
    though pipectl launches it with --engine torch."""
    write_json_atomic(tmp_path / "p.json", synthetic_profile(blocks=6, micro_batch_sizes=[1, 2, 4, 8], device="cpu"))
    args = ["plan", "--profile", str(tmp_path / "p.json"), "--cluster", "local", "--devices", "2", "--global-batch", "16",
            "--schedule", "interleaved", "-o", str(tmp_path / "plan.json")]  # fmt: skip
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and "plan with --engine torch (its torch runtime launches it)" in " ".join(refused.output.split())
    assert runner.invoke(app, [*args, "--engine", "torch"]).exit_code == 0


def test_a_16_bit_torch_plan_is_refused_with_a_way_out_that_works(tmp_path):
    """A torch-engine plan from a bf16 (derived) profile: launch refuses it, and the hint's way out,
    a float32 profile planned again, launches. (Its hint used to say `--precision fp32`, which the
    plan's precision check refused in turn.)"""
    from cli_process import pipectl, said

    def plan(dtype: str) -> str:
        done = pipectl("profile", "gpt-tiny", "--derive", "--device", "cpu", "--dtype", dtype, "-o", "profile.json", cwd=tmp_path)
        assert done.returncode == 0, said(done)
        done = pipectl("plan", "--profile", "profile.json", "--cluster", "local", "--global-batch", "16", "--engine",
                       "torch", "--pipeline-parallel", "2", "--no-morph", "-o", "plan.json", cwd=tmp_path, columns=300)
        assert done.returncode == 0, said(done)
        return done.stdout + done.stderr

    # Said when planning already: the plan is for comparison until profiled in float32.
    assert "the torch engine trains in fp32 only: launch refuses this plan of a bfloat16 profile" in plan("bfloat16")
    refused = pipectl("launch", "plan.json", "--run-dir", "runs/a", "--steps", "4", "--dry-run", cwd=tmp_path)
    assert refused.returncode == 2, said(refused)
    assert "torch (PyTorch's pipelining runtime), trains in fp32 only" in refused.stderr
    assert "hint: profile and plan again with --dtype float32" in refused.stderr and "Traceback" not in said(refused)
    assert "fp32 only" not in plan("float32")
    done = pipectl("launch", "plan.json", "--run-dir", "runs/a", "--steps", "4", "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, said(done)
