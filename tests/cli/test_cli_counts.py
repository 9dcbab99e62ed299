"""Counts in what the commands print agree with their nouns: '1 rank', '1 step', '1 device'."""

from __future__ import annotations

from typer.testing import CliRunner

from pipectl.artifacts.plan import ModelShape
from pipectl.cli.main import app
from pipectl.launch import LaunchOptions, prepare_launch
from pipectl.io import write_json_atomic
from pipectl.testing.profiles import synthetic_profile
from pipectl.planfile import write_plan
from builders import gpt_tiny_candidate, plan_of

runner = CliRunner()


def test_status_of_a_one_rank_run_of_one_step(tmp_path):
    run = tmp_path / "run"
    prepare_launch(plan_of(gpt_tiny_candidate(p=1, m=4)), run, LaunchOptions(steps=1))
    result = runner.invoke(app, ["status", str(run)])
    assert result.exit_code == 0, result.output
    assert "local, 1 rank" in result.output and "1 ranks" not in result.output
    assert "0 / 1 step " in result.output


def test_simulate_names_one_device_in_the_singular(tmp_path):
    profile = synthetic_profile(blocks=6, micro_batch_sizes=[1, 2])  # 9 layers, as gpt-tiny
    plan = plan_of(gpt_tiny_candidate(p=2), model=profile.model, shape=ModelShape.of_profile(profile))
    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, plan, profile_file=write_json_atomic(tmp_path / "p.json", profile))
    result = runner.invoke(app, ["simulate", str(plan_path), "--devices", "1"])
    assert result.exit_code == 2
    assert "no entry for 1 device" in result.output and "1 devices" not in result.output
