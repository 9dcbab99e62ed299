"""`--engine` end to end: `pipectl plan --engine torch` names the engine of its choice, bad
combinations and launching a torch plan are refused with exit 2 and no traceback, and
`pipectl simulate --schedule zb-h1` times the split backward."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipectl.artifacts.plan import Engine, Plan
from pipectl.cli.main import app
from pipectl.io import load_model, write_json_atomic
from pipectl.plan.synthetic import synthetic_profile

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
    assert written.chosen.schedule.value in ("zb-h1", "interleaved")
    header = next(line for line in result.output.splitlines() if "samp/s" in line)
    assert "engine" in header.split()
    assert "PyTorch's pipelining runtime" in result.output


def test_launching_a_torch_plan_is_refused(torch_plan, tmp_path):
    _, out, _ = torch_plan
    result = runner.invoke(app, ["launch", str(out), "--run-dir", str(tmp_path / "run"), "--dry-run"])
    assert result.exit_code == 2
    assert "not yet a launch engine" in result.output and "examples/torch_pipeline.py" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


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
