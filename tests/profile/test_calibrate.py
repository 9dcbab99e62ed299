"""Calibration from runs (`pipectl calibrate`): runs whose measured phases come from a known "true"
profile give back that profile's step times on every run, with its engine terms; bad inputs are
named. No processes: the runs are written as a run directory holds them."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from pipectl.artifacts.layout import layout_label
from pipectl.artifacts.plan import PlanRequest
from pipectl.artifacts.profile import EngineComputeRatio, RuntimeCosts
from pipectl.artifacts.run import JobSpec, RankTiming, StepMetrics
from pipectl.cli.main import app
from pipectl.cluster import load_cluster
from pipectl.errors import UserInputError
from pipectl.io import write_json_atomic
from pipectl.plan.phases import simulated_phases
from pipectl.plan.search import plan as make_plan
from pipectl.testing.profiles import synthetic_profile
from pipectl.planfile import write_plan
from pipectl.profile.calibrate import calibrate
from pipectl.rundir.metrics import MetricsWriter

PLANNED = RuntimeCosts(
    engine="test engine", forward_overhead_seconds=0.001, backward_overhead_seconds=0.002, step_fixed_seconds=0.004,
    step_seconds_per_parameter=1e-8, busy_handoff_seconds=0.002, alone_compute_slowdown=1.0,
    concurrent_compute_slowdown=1.2,
    compute_ratios=[EngineComputeRatio(micro_batch_size=b, forward_ratio=1.5, backward_ratio=1.25) for b in (1, 2, 4)],
)  # fmt: skip
# What the machine "really" does: slower shared cores, a dearer optimizer, a slower hand-off.
TRUE = PLANNED.model_copy(update={
    "alone_compute_slowdown": 1.3, "concurrent_compute_slowdown": 1.9, "step_fixed_seconds": 0.009,
    "step_seconds_per_parameter": 3e-8, "busy_handoff_seconds": 0.005,
})  # fmt: skip


def profile_with(runtime: RuntimeCosts):
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2, 4], device="cpu", dtype="float32")
    return profile.model_copy(update={"runtime": runtime})


def write_run(folder, pipeline: int, micro_batch_size: int, *, truth=TRUE, steps: int = 3, phases: bool = True,
              optimizer_apart: bool = True, step_truth=None):
    """A run planned from the PLANNED profile whose ranks measured what TRUE simulates (without
    `optimizer_apart`, as ranks recorded it before the optimizer step was timed on its own;
    `step_truth`: the step time another profile simulates, phases and step disagreeing)."""
    folder.mkdir(parents=True)
    planned = profile_with(PLANNED)
    write_json_atomic(folder / "profile-source.json", planned)
    request = PlanRequest(global_batch=8, pipeline_parallel=pipeline, data_parallel=1, tensor_parallel=1,
                          micro_batch_size=micro_batch_size)  # fmt: skip
    cluster = load_cluster("local")
    plan = write_plan(folder / "plan.json", make_plan(planned, cluster, request), profile_file=folder / "profile-source.json")
    chosen = plan.chosen
    job = JobSpec(name=folder.name, model="gpt-tiny", steps=steps, world_size=chosen.devices, ranks_per_node=chosen.devices,
                  master_port=29500)  # fmt: skip
    write_json_atomic(folder / "job.json", job)
    stages, step = simulated_phases(chosen, profile_with(truth), cluster)
    if step_truth is not None:
        step = simulated_phases(chosen, profile_with(step_truth), cluster)[1]
    writer = MetricsWriter(folder, rank=0)
    for s in range(1, steps + 1):
        ranks = [
            RankTiming(rank=r, stage=r, forward_seconds=f, backward_seconds=b,
                       **({"p2p_seconds": w, "end_of_step_seconds": e + o} if phases else {}),
                       **({"optimizer_seconds": o} if phases and optimizer_apart else {}))
            for r, (f, b, w, e, o, _) in enumerate(stages)
        ]  # fmt: skip
        writer.write(StepMetrics(step=s, loss=1.0, step_seconds=step, samples_per_second=8 / step, global_batch=8,
                                 world_size=chosen.devices, layout=layout_label(chosen), time_unix=time.time(), ranks=ranks))  # fmt: skip
    return folder


def test_runs_measured_from_a_true_profile_give_back_its_step_times(tmp_path):
    runs = [write_run(tmp_path / "one", 1, 2), write_run(tmp_path / "two", 2, 4)]
    profile, report = calibrate(runs)
    for fit in report.runs:
        assert fit.error_before > 0.05, fit  # the planned terms were off
        assert fit.error_after < 0.01, fit
    runtime = profile.runtime
    assert runtime.alone_compute_slowdown == pytest.approx(TRUE.alone_compute_slowdown, rel=0.01)
    assert runtime.concurrent_compute_slowdown == pytest.approx(TRUE.concurrent_compute_slowdown, rel=0.01)
    # Fixed and per-parameter end of step trade off across the few parameter counts two runs show:
    # their sum at the whole model's count is what the runs pin down.
    held = sum(layer.parameter_count for layer in profile.layers)
    end = runtime.step_fixed_seconds + runtime.step_seconds_per_parameter * held
    assert end == pytest.approx(TRUE.step_fixed_seconds + TRUE.step_seconds_per_parameter * held, rel=0.05)
    assert runtime.busy_handoff_seconds == pytest.approx(TRUE.busy_handoff_seconds, rel=0.1)
    assert "calibrated from 2 runs" in profile.notes[-1]
    # A layout not calibrated on is predicted as TRUE predicts it.
    third = write_run(tmp_path / "three", 2, 2)
    from pipectl.io import load_model
    from pipectl.artifacts.plan import Plan

    candidate = load_model(Plan, third / "plan.json").chosen
    _, predicted = simulated_phases(candidate, profile, load_cluster("local"))
    _, truth = simulated_phases(candidate, profile_with(TRUE), load_cluster("local"))
    assert predicted == pytest.approx(truth, rel=0.02)
    # Runs recorded before the optimizer step was timed apart calibrate alike: the fit reads the end of step whole.
    older = [write_run(tmp_path / "one-older", 1, 2, optimizer_apart=False),
             write_run(tmp_path / "two-older", 2, 4, optimizer_apart=False)]  # fmt: skip
    assert calibrate(older)[0].runtime == profile.runtime


def test_the_cli_writes_the_profile_and_bad_inputs_are_named(tmp_path):
    runs = [write_run(tmp_path / "one", 1, 2), write_run(tmp_path / "two", 2, 4)]
    result = CliRunner().invoke(app, ["calibrate", *map(str, runs), "-o", str(tmp_path / "cal.json")], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert (tmp_path / "cal.json").is_file() and "engine terms fitted" in result.output
    old = write_run(tmp_path / "old", 1, 2, phases=False)
    with pytest.raises(UserInputError, match="does not record its pipeline waits"):
        calibrate([old])
    with pytest.raises(UserInputError, match="no run directory at"):
        calibrate([tmp_path / "nowhere"])
    short = write_run(tmp_path / "short", 1, 2, steps=1)
    with pytest.raises(UserInputError, match="fewer than two steps"):
        calibrate([short])
    missing = CliRunner().invoke(app, ["calibrate", str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.json")])
    assert missing.exit_code == 2 and "no run directory" in missing.output


def test_a_fit_that_predicts_its_own_runs_worse_says_so(tmp_path):
    """Runs whose phases say TRUE but whose step times are what PLANNED predicts (phases and step
    disagreeing, as on a busy host): the fit follows the phases and misses the steps; the user is
    told, with both errors, and the profile is still written."""
    runs = [write_run(tmp_path / "one", 1, 2, step_truth=PLANNED), write_run(tmp_path / "two", 2, 4, step_truth=PLANNED)]
    result = CliRunner().invoke(app, ["calibrate", *map(str, runs), "-o", str(tmp_path / "cal.json")], env={"COLUMNS": "160"})
    assert result.exit_code == 0 and (tmp_path / "cal.json").is_file(), result.output
    said = " ".join(result.output.split())
    assert "warning: the fitted terms predict these runs' step times worse than the profile did (mean error 0.0% ->" in said
    agreeing = [write_run(tmp_path / "three", 1, 2), write_run(tmp_path / "four", 2, 4)]
    quiet = CliRunner().invoke(app, ["calibrate", *map(str, agreeing), "-o", str(tmp_path / "cal2.json")], env={"COLUMNS": "160"})
    assert quiet.exit_code == 0 and "warning" not in quiet.output, quiet.output


def test_a_run_given_twice_or_a_split_over_kinds_is_refused(tmp_path):
    run = write_run(tmp_path / "one", 1, 2)
    with pytest.raises(UserInputError, match="is given twice"):
        calibrate([run, tmp_path / "." / "one"])
    from pipectl.artifacts.plan import Plan, ReplicaShare
    from pipectl.io import load_model

    plan = load_model(Plan, run / "plan.json")
    shares = [ReplicaShare(replica=r, device=kind, micro_batch_size=2, micro_batches=m, samples=2 * m, gradient_weight=2 * m / 8)
              for r, (kind, m) in enumerate([("cpu", 3), ("cpu-slowed-2x", 1)])]  # fmt: skip
    split = plan.chosen.model_copy(update={"device": "mixed", "replicas": shares, "data_parallel": 2, "devices": 2, "micro_batches": 3})
    write_json_atomic(run / "plan.json", plan.model_copy(update={"chosen": split}))
    with pytest.raises(UserInputError, match="not a layout of one device kind"):
        calibrate([run])


def test_a_stray_profiled_compute_ratio_is_put_back_on_the_line_of_the_others():
    """The engine's compute at one profiled b 30 % off the others' line (as a short profiling
    step can measure it): smoothing puts it back, and leaves the others where they were."""
    from pipectl.plan.costs import hardware_for, layer_seconds
    from pipectl.plan.layer_table import layer_table
    from pipectl.profile.calibrate import smooth_compute_ratios

    def totals(profile):
        hardware = hardware_for(cluster, profile)
        return [sum(layer_seconds(layer_table(profile, b, 1), hardware, 1).backward) for b in (1, 2, 4)]

    cluster = load_cluster("local")
    straight = profile_with(PLANNED.model_copy(update={"compute_ratios": [
        EngineComputeRatio(micro_batch_size=b, forward_ratio=1.0, backward_ratio=1.0) for b in (1, 2, 4)]}))  # fmt: skip
    line = totals(straight)
    assert (line[2] - line[1]) / 2 == pytest.approx(line[1] - line[0], rel=1e-6)  # the synthetic layers: a line in b
    stray = profile_with(PLANNED.model_copy(update={"compute_ratios": [
        EngineComputeRatio(micro_batch_size=b, forward_ratio=1.0, backward_ratio=1.3 if b == 2 else 1.0) for b in (1, 2, 4)]}))  # fmt: skip
    assert totals(stray)[1] == pytest.approx(1.3 * line[1])
    assert totals(smooth_compute_ratios(stray, cluster)) == pytest.approx(line, rel=1e-6)
    assert smooth_compute_ratios(straight, cluster).runtime.compute_ratios == straight.runtime.compute_ratios
