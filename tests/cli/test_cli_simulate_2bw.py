"""`pipectl simulate --schedule 2bw` (and a 2bw plan): the steady state without a flush, the weight
versions, the stashed memory; `pipectl launch` refuses such a plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipectl.artifacts.plan import Candidate
from pipectl.cli.main import app
from pipectl.io import write_json_atomic
from pipectl.schedule.ir import ScheduleKind

runner = CliRunner()
TWO_BW = ["simulate", "--schedule", "2bw", "--pipeline-parallel", "4", "--micro-batches", "4",
          "--forward-ms", "1", "--backward-ms", "2"]  # fmt: skip


def invoke(*args: str, code: int = 0):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result


def test_json_reports_the_steady_state_next_to_the_flushed_step_and_the_versions():
    payload = json.loads(invoke(*TWO_BW, "--json").stdout)
    assert payload["step_seconds"] == pytest.approx((4 + 4 - 1) * 3e-3, rel=1e-12)  # the table: one flushed step
    two_bw = payload["two_bw"]
    steady = two_bw["steady_state"]
    assert steady["update_seconds"] == pytest.approx(4 * 3e-3, rel=1e-12)  # m (t_f + t_b)
    assert steady["flushed_step_seconds"] == pytest.approx(7 * 3e-3, rel=1e-12)
    assert steady["first_update_seconds"] == pytest.approx(7 * 3e-3, rel=1e-12)
    assert steady["seconds_for_updates"] == pytest.approx((10 * 4 + 3) * 3e-3, rel=1e-12)
    assert [(v["first_microbatch"], v["last_microbatch"], v["forward_version"], v["backward_version"])
            for v in two_bw["versions"]] == [(1, 4, 0, 0), (5, 8, 0, 0), (9, 12, 1, 1)]  # fmt: skip
    assert two_bw["peak_in_flight"] == [4, 3, 2, 1]
    assert two_bw["memory"] is None  # no plan: no parameter bytes
    assert two_bw["changes_optimizer_semantics"] is True and two_bw["runnable_by_pipectl_runtime"] is False
    assert any("1-stale" in note for note in two_bw["notes"])


def test_table_says_what_2bw_is_and_that_the_runtime_cannot_run_it():
    out = invoke(*TWO_BW).stdout
    assert "2bw  p=4 m=4 v=1  flushed step 21 ms" in out
    assert "steady state (no flush): 0.012 s per update of 4 micro-batches" in out
    assert "with a flush (1f1b):     0.021 s per step" in out
    assert "k 9-12" in out and "W3 = W2 - lr*grad f(W1)" in out
    assert "micro-batches in flight per stage: 4 3 2 1" in out
    flat = " ".join(out.split())
    assert "1-stale" in flat and "cannot run 2BW" in flat and "`pipectl launch` refuses" in flat


def test_print_schedule_adds_the_order_across_updates():
    out = invoke("simulate", "--schedule", "2bw", "--pipeline-parallel", "2", "--micro-batches", "2",
                 "--print-schedule").stdout  # fmt: skip
    assert "0: F0 F1 B0 F2 B1 U1 F3 B2 F4 B3 U2 F5 B4 B5 U3" in out
    assert "1: F0 B0 F1 B1 U1 F2 B2 F3 B3 U2 F4 B4 F5 B5 U3" in out


def test_too_few_micro_batches_per_update_is_explained_not_an_error():
    result = invoke("simulate", "--schedule", "2bw", "--pipeline-parallel", "4", "--micro-batches", "2")
    flat = " ".join(result.stdout.split())
    assert "needs at least p - 1 = 3 micro-batches per update, got m=2" in flat
    assert "cannot run 2BW" in flat and "Traceback" not in result.output
    payload = json.loads(invoke("simulate", "--schedule", "2bw", "--pipeline-parallel", "4", "--micro-batches", "2",
                                "--json").stdout)  # fmt: skip
    assert payload["two_bw"]["steady_state"] is None


def _two_bw_plan(tmp_path: Path, *, runnable: bool = False) -> tuple[Path, Candidate, object]:
    """A 2bw plan of a synthetic 7-layer profile (no torch needed), written next to its profile."""
    from pipectl.artifacts.plan import ModelShape, Plan, PlanRequest
    from pipectl.testing.profiles import synthetic_profile
    from pipectl.planfile import write_plan

    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2], device="cpu")
    profile_path = write_json_atomic(tmp_path / "profile.json", profile)
    candidate = Candidate(
        devices=2, device="cpu", tensor_parallel=1, pipeline_parallel=2, data_parallel=1,
        micro_batch_size=2, micro_batches=4, schedule=ScheduleKind.PIPEDREAM_2BW, recompute=False,
        zero_stage=1, stage_layers=[(0, 3), (3, len(profile.layers))], predicted_step_seconds=1.0,
        samples_per_second=8.0, tflops_per_device=0.0, peak_memory_bytes=[10**6, 2 * 10**6], bubble_fraction=0.2,
        communication_fraction=0.0, cost_per_million_samples=0.0, deepspeed_runnable=runnable,
    )  # fmt: skip
    plan = Plan(model=profile.model, model_shape=ModelShape.of_profile(profile), cluster="local",
                request=PlanRequest(global_batch=8), chosen=candidate)  # fmt: skip
    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, plan, profile_file=profile_path)
    return plan_path, candidate, profile


def test_a_2bw_plan_shows_the_stashed_weight_versions_memory(tmp_path: Path):
    plan_path, candidate, profile = _two_bw_plan(tmp_path)
    payload = json.loads(invoke("simulate", plan_path, "--json").stdout)
    parameters = [sum(layer.parameter_bytes for layer in profile.layers[a:b]) for a, b in candidate.stage_layers]
    saved = [sum(layer.cost(2).saved_activation_bytes for layer in profile.layers[a:b]) for a, b in candidate.stage_layers]
    memory = payload["two_bw"]["memory"]
    assert [entry["weight_bytes"] for entry in memory] == [2 * b for b in parameters]
    assert [entry["in_flight"] for entry in memory] == [2, 1]
    assert [entry["activation_bytes"] for entry in memory] == [2 * saved[0], saved[1]]
    steady = payload["two_bw"]["steady_state"]
    assert 0 < steady["update_seconds"] < steady["flushed_step_seconds"]
    out = invoke("simulate", plan_path).stdout
    assert "2BW memory per stage" in out and "2 weight versions" in out and "plan's peak" in out


@pytest.mark.parametrize("runnable", [False, True])  # True: a plan written by hand keeps the field's default
def test_launch_refuses_a_2bw_plan_with_exit_2_and_says_why(tmp_path: Path, runnable: bool):
    plan_path, _, _ = _two_bw_plan(tmp_path, runnable=runnable)
    for extra in ([], ["--dry-run"]):
        result = invoke("launch", plan_path, "--run-dir", tmp_path / "run", *extra, code=2)
        flat = " ".join(result.output.split())
        assert "PipeDream-2BW" in flat and "cannot run it" in flat and "1-stale" in flat
        assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


def test_a_planned_2bw_candidate_predicts_the_steady_state_simulate_shows(tmp_path: Path):
    # The planner prices 2bw per update in steady state: simulate's figure for the same plan.
    from pipectl.artifacts.plan import Plan
    from pipectl.io import load_model
    from pipectl.testing.profiles import synthetic_profile

    profile = tmp_path / "profile.json"
    write_json_atomic(profile, synthetic_profile(blocks=6, micro_batch_sizes=[1, 2], device="a100-80gb"))
    out = tmp_path / "plan.json"
    invoke("plan", "--profile", profile, "--cluster", "a100-8x8", "--devices", "8", "--global-batch", "32",
           "--pipeline-parallel", "4", "--schedules", "2bw", "--any-engine", "--no-morph", "-o", out)
    chosen = load_model(Plan, out).chosen
    assert chosen.schedule is ScheduleKind.PIPEDREAM_2BW
    payload = json.loads(invoke("simulate", out, "--json").stdout)
    assert payload["two_bw"]["steady_state"]["update_seconds"] == pytest.approx(chosen.predicted_step_seconds,
                                                                               rel=1e-12)
    assert payload["step_seconds"] > chosen.predicted_step_seconds  # the table's flushed step
    text = " ".join(invoke("simulate", out).output.split())
    assert f"the plan predicted {chosen.predicted_step_seconds:.6g} s)" in text
    assert "(plan predicted" not in text  # not beside the flushed step, which it is not
