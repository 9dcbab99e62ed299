"""Where the step goes, predicted against measured per stage (`pipectl status`): the prediction is
the plan's candidate simulated again from the run's own profile copy, the measurement the ranks'
heartbeats; no processes."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from pipectl.artifacts.layout import layout_label
from pipectl.artifacts.plan import PlanRequest
from pipectl.artifacts.run import JobSpec, RankTiming, StepMetrics
from pipectl.cluster import load_cluster
from pipectl.io import write_json_atomic
from pipectl.rundir.status import RunStatus
from pipectl.plan.cost_table import stage_costs_for
from pipectl.plan.phases import PHASES, measured_phases
from pipectl.plan.search import plan as make_plan
from pipectl.plan.simulate import simulate
from pipectl.testing.profiles import synthetic_profile
from pipectl.planfile import write_plan
from pipectl.report.phase_table import phase_table
from pipectl.rundir.analysis import phase_comparison
from pipectl.schedule import generate

FIELDS = ("forward_seconds", "backward_seconds", "p2p_seconds", "end_of_step_seconds", "optimizer_seconds",
          "checkpoint_seconds")


def run_status(tmp_path, measured: list[list[tuple]], step_seconds: float) -> RunStatus:
    """A run of a 2-stage plan of a synthetic model whose steps' ranks measured (forward,
    backward[, sends and receives, end of step, optimizer step])."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2, 4, 8])
    write_json_atomic(tmp_path / "profile.json", profile)
    request = PlanRequest(global_batch=8, pipeline_parallel=2, data_parallel=1, tensor_parallel=1, micro_batch_size=4)
    plan = write_plan(tmp_path / "plan.json", make_plan(profile, load_cluster("local"), request), profile_file=tmp_path / "profile.json")
    label = layout_label(plan.chosen)
    metrics = [
        StepMetrics(step=s + 1, loss=1.0, step_seconds=step_seconds, samples_per_second=1.0, global_batch=8, world_size=2,
                    layout=label, time_unix=time.time(),
                    ranks=[RankTiming(rank=r, stage=r, **dict(zip(FIELDS, times))) for r, times in enumerate(ranks)])
        for s, ranks in enumerate(measured)
    ]  # fmt: skip
    job = JobSpec(name="run", model="gpt-tiny", steps=10, world_size=2, ranks_per_node=2, master_port=29500)
    return RunStatus(path=tmp_path, job=job, plan=plan, metrics=metrics, prediction=None, checkpoints=[], layouts=[label])


def test_predictions_are_the_simulated_stages_and_measurements_the_medians_after_the_first_step(tmp_path):
    steps = [[(9.0, 9.0, 9.0, 9.0, 9.0, 0.0)] * 2,
             [(0.010, 0.020, 0.03, 0.004, 0.001, 0.0), (0.011, 0.021, 0.03, 0.005, 0.002, 0.0)],
             [(0.012, 0.022, 0.04, 0.006, 0.002, 0.0), (0.013, 0.023, 0.04, 0.007, 0.003, 0.0)],
             [(0.014, 0.024, 0.05, 0.008, 0.003, 0.0), (0.015, 0.025, 0.05, 0.009, 0.004, 0.0)]]  # fmt: skip
    status = run_status(tmp_path, steps, step_seconds=0.1)
    comparison, reason = phase_comparison(status)
    assert reason is None and comparison.steps == (2, 4)
    chosen = status.plan.chosen
    costs = stage_costs_for(chosen, synthetic_profile(blocks=4, micro_batch_sizes=[1, 2, 4, 8]), load_cluster("local"))
    timeline = simulate(generate(chosen.schedule, 2, chosen.micro_batches, 1, chosen.recompute), costs)
    for stage in comparison.stages:
        seconds = {}
        for r in timeline.rank_records(stage.stage):
            seconds[r.action.kind.value] = seconds.get(r.action.kind.value, 0.0) + r.end - r.start
        forward, backward = seconds.get("F", 0) + seconds.get("R", 0), seconds["B"]
        reductions, optimizer = seconds.get("AR", 0), seconds.get("STEP", 0)
        waits = timeline.step_seconds - forward - backward - reductions - optimizer
        assert optimizer > 0
        assert stage.predicted == pytest.approx((forward, backward, waits, reductions, optimizer, 0.0))
    # step 1 (9 s each) is left out; the medians are step 3's; the end of step splits into reductions and the optimizer
    assert comparison.stages[0].measured == pytest.approx((0.012, 0.022, 0.04, 0.004, 0.002, 0.0))
    assert comparison.stages[0].unaccounted == pytest.approx(0.1 - 0.08)
    assert comparison.stages[1].measured == pytest.approx((0.013, 0.023, 0.04, 0.004, 0.003, 0.0))
    rendered = phase_table(comparison)
    assert rendered.row_count == 4 and "steps 2-4" in str(rendered.title)  # predicted, then measured, per stage
    assert comparison.to_dict()["stages"][0]["measured"]["pipeline waits"] == pytest.approx(0.04)
    assert comparison.to_dict()["stages"][1]["measured"]["optimizer"] == pytest.approx(0.003)


def test_the_furthest_phase_is_named_and_a_short_run_says_why_there_is_none(tmp_path):
    probe, _ = phase_comparison(run_status(tmp_path / "probe", [[(0.0, 0.0, 0.0, 0.0, 0.0)] * 2] * 2, step_seconds=0.0))
    # As ranks record them: the end of step is the reductions and the optimizer step together.
    predicted = [(f, b, w, r + o, o) for f, b, w, r, o, _ in (stage.predicted for stage in probe.stages)]
    step = max(f + b + w + e for f, b, w, e, _ in predicted)
    slow_links = [(f, b, w + 1.0, e, o) for f, b, w, e, o in predicted]
    comparison, _ = phase_comparison(run_status(tmp_path / "links", [slow_links] * 3, step_seconds=step + 1.0))
    assert {stage.furthest for stage in comparison.stages} == {"pipeline waits"}
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(phase_table(comparison))
    text = console.export_text()  # five phases (no checkpoint waited), predicted then measured, in 100 columns
    assert "…" not in text and max(len(line.rstrip()) for line in text.splitlines()) <= 100
    assert "where the step goes, s " in text and "reductions" in text and "optimizer" in text
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.split()[:2] == ["0", "predicted"])
    assert len(lines[first].split()) == 7 and lines[first + 1].split()[0] == "measured"
    assert lines[first + 1].split()[-1] == "waits"
    slow_backward = [(f, 3 * b, w, e, o) for f, b, w, e, o in predicted]
    comparison, _ = phase_comparison(run_status(tmp_path / "compute", [slow_backward] * 3, step_seconds=step * 3))
    assert {stage.furthest for stage in comparison.stages} == {"backward"}
    older = [(f, b) for f, b, _, _, _ in predicted]  # a run that recorded compute only
    comparison, _ = phase_comparison(run_status(tmp_path / "older", [older] * 3, step_seconds=step))
    assert comparison.stages[0].measured[2:] == (None,) * 4 and comparison.stages[0].unaccounted is None
    before_split = [(f, b, w, e) for f, b, w, e, _ in predicted]  # a run that recorded its end of step whole
    comparison, _ = phase_comparison(run_status(tmp_path / "whole", [before_split] * 3, step_seconds=step))
    assert comparison.stages[0].measured[2] is not None and comparison.stages[0].measured[3:] == (None,) * 3
    assert comparison.stages[0].unaccounted == pytest.approx(0.0, abs=1e-9)  # what the phases leave, from the whole end
    short = run_status(tmp_path / "short", [[(0.01, 0.02, 0.0, 0.0, 0.0)] * 2], step_seconds=0.1)
    assert phase_comparison(short) == (None, f"phases are compared after two steps of {layout_label(short.plan.chosen)}")
    # Steps trained, their ranks' detail gone (logs/ deleted): not "after two steps".
    bare = run_status(tmp_path / "bare", [[]] * 3, step_seconds=0.1)
    assert phase_comparison(bare)[1].startswith("no phases per rank recorded for the steps of "), phase_comparison(bare)


def test_a_checkpoints_wait_is_its_own_phase_spread_over_the_steps(tmp_path):
    # The step after a checkpoint waits 30 ms for its copies (inside the end of step, as ranks record
    # it); the other steps none. The phase is the mean over steps 2-4, the reductions stay apart.
    plain, after_checkpoint = (0.01, 0.02, 0.0, 0.005, 0.002, 0.0), (0.01, 0.02, 0.0, 0.035, 0.002, 0.03)
    steps = [[plain] * 2, [plain] * 2, [after_checkpoint] * 2, [plain] * 2]
    status = run_status(tmp_path, steps, step_seconds=0.1)
    comparison, _ = phase_comparison(status)
    measured = comparison.stages[0].measured
    assert measured[PHASES.index("checkpoint copy")] == pytest.approx(0.01)
    assert measured[PHASES.index("gradient reductions")] == pytest.approx(0.003)
    assert comparison.stages[0].predicted[PHASES.index("checkpoint copy")] == 0.0
    assert comparison.stages[0].furthest != "checkpoint copy"  # priced at 0 by design: never the term to look at
    # What calibration fits the end of the step to: without the checkpoint's wait (0.005 s every step).
    assert measured_phases(status.metrics, comparison.layout).end_of_step[0] == pytest.approx(0.005)
    assert comparison.to_dict()["stages"][0]["measured"]["checkpoint copy"] == pytest.approx(0.01)
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(phase_table(comparison))
    text = console.export_text()  # a column where a step waited (a GPU's copies), else none; 100 columns
    assert "ckpt" in text and "…" not in text and max(len(line.rstrip()) for line in text.splitlines()) <= 100


def test_a_split_over_device_kinds_is_not_compared_per_stage(tmp_path):
    from pipectl.artifacts.plan import ReplicaShare

    status = run_status(tmp_path, [[(0.01, 0.02, 0.0, 0.0, 0.0)] * 2] * 3, step_seconds=0.1)
    shares = [ReplicaShare(replica=r, device=kind, micro_batch_size=4, micro_batches=1, samples=4, gradient_weight=0.5)
              for r, kind in enumerate(["cpu", "cpu-slowed-2x"])]  # fmt: skip
    split = status.plan.chosen.model_copy(update={"device": "mixed", "replicas": shares, "data_parallel": 2})
    from dataclasses import replace

    status = replace(status, plan=status.plan.model_copy(update={"chosen": split}))
    assert phase_comparison(status) == (None, "the layout splits its replicas over device kinds: phases are compared for layouts of one kind")


def test_steps_of_another_layout_between_are_not_counted_and_the_title_says_so(tmp_path):
    """A resize away and back: the layout's steps 2-3 and 6-7 are counted, not 4-5 of the other."""
    timings = [(0.01, 0.02, 0.0, 0.001, 0.001, 0.0)] * 2
    status = run_status(tmp_path, [timings] * 7, step_seconds=0.05)
    for row in status.metrics[3:5]:
        row.layout = "t1p1d2 1f1b b4 m1"
    comparison, _ = phase_comparison(status)
    assert comparison.steps == (2, 7) and comparison.count == 3  # 2, 3 and 7: step 6 restarts the layout
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(phase_table(comparison))
    assert f"(medians over 3 steps of {comparison.layout} between 2 and 7)" in console.export_text()
    assert comparison.to_dict()["steps_counted"] == 3
    comparison, _ = phase_comparison(run_status(tmp_path / "one", [timings] * 7, step_seconds=0.05))
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(phase_table(comparison))
    assert "(medians over steps 2-7)" in console.export_text()


def test_a_calibration_or_cluster_edited_since_planning_is_said_under_the_table(tmp_path):
    """Where the plan's cluster or calibration file changed since planning, the predictions price it as
    it is now; the table says so, as `simulate` does (a calibration replaced under a run moved its
    waits from 4 to 935 ms without a word)."""
    from dataclasses import replace

    steps = [[(0.01, 0.02, 0.03, 0.004, 0.001, 0.0)] * 2] * 3
    comparison, _ = phase_comparison(run_status(tmp_path, steps, step_seconds=0.1))
    assert comparison.changed == () and "changed since planning" not in str(phase_table(comparison).caption)
    edited = replace(comparison, changed=("/data/cal[v2].json",))
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(phase_table(edited))
    assert "predicted with /data/cal[v2].json as it is now: it changed since planning" in " ".join(console.export_text().split())
    assert edited.to_dict()["files_changed_since_planning"] == ["/data/cal[v2].json"]
