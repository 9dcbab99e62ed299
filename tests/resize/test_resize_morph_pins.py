"""A resize whose re-plan drops the plan's pinned degrees drops the morph-table entries planned under
them too: the run's plan.json never offers a pinned layout once its request holds no pin."""

from __future__ import annotations

import json
from pathlib import Path

from pipectl.artifacts.plan import Plan, PlanRequest
from pipectl.cluster import local_cluster
from pipectl.io import load_model, write_json_atomic
from pipectl.plan.search import plan as search_plan
from pipectl.planfile import write_plan
from pipectl.resize.choose import choose_candidate, replanner, with_entry
from pipectl.resize.restart import resized_plan
from pipectl.testing.profiles import synthetic_profile

from tests.e2e.test_first_hour import pipectl, said, succeeded


def gpt_tiny_profile():
    return synthetic_profile(blocks=6, micro_batch_sizes=[1, 2, 4, 8], device="cpu", dtype="float32", name="gpt-tiny")


def planned_on_disk(folder: Path, request: PlanRequest, devices: int) -> Plan:
    """A plan written by the planner to folder/out/plan.json, its profile copied beside it."""
    profile_path = folder / "profile.json"
    write_json_atomic(profile_path, gpt_tiny_profile())
    made = search_plan(gpt_tiny_profile(), local_cluster(devices), request)
    write_plan(folder / "out" / "plan.json", made, profile_file=profile_path)
    return load_model(Plan, folder / "out" / "plan.json")


def test_a_replan_that_drops_the_pins_drops_the_entries_planned_under_them(tmp_path):
    pinned = planned_on_disk(tmp_path, PlanRequest(global_batch=16, pipeline_parallel=2, max_tensor_parallel=1), 2)
    assert [e.devices for e in pinned.morph_table] == [2] and pinned.morph_table[0].candidate.pipeline_parallel == 2
    to_one = choose_candidate(pinned, 1, replan=replanner(pinned, tmp_path / "out"))
    assert to_one.source == "re-planned" and to_one.candidate.pipeline_parallel == 1
    # The table written with it is the re-planned entry alone: the p = 2 entry for 2 devices is gone.
    assert with_entry(pinned, to_one.entry) == [to_one.entry]
    resized = resized_plan(pinned, to_one)
    assert resized.request.pipeline_parallel is None and [e.devices for e in resized.morph_table] == [1]
    # Back to 2 devices: re-planned without the pin, the best on at most 2 devices, as a fresh plan gives.
    back = choose_candidate(resized, 2, replan=replanner(resized, tmp_path / "out"))
    fresh = search_plan(gpt_tiny_profile(), local_cluster(2), PlanRequest(global_batch=16, max_tensor_parallel=1, devices=2))
    assert back.source == "re-planned"
    assert back.candidate.predicted_step_seconds == fresh.for_devices(2).candidate.predicted_step_seconds
    assert back.candidate.predicted_step_seconds <= to_one.candidate.predicted_step_seconds


def test_a_replan_that_keeps_the_pins_keeps_the_table(tmp_path):
    pinned = planned_on_disk(tmp_path, PlanRequest(global_batch=16, pipeline_parallel=2, max_tensor_parallel=1), 2)
    to_three = choose_candidate(pinned, 3, replan=replanner(pinned, tmp_path / "out"))
    assert to_three.candidate.pipeline_parallel == 2
    assert [e.devices for e in with_entry(pinned, to_three.entry)] == [2, 3]


def dry_run(devices: int, cwd: Path) -> dict:
    done = pipectl("resize", "runs/mine", "--devices", devices, "--steps", 20, "--dry-run", "--json", cwd=cwd)
    assert succeeded(done), said(done)
    return json.loads(done.stdout)


def test_after_a_resize_drops_the_pin_more_devices_are_never_slower_than_fewer(tmp_path):
    """The user walk: p = 2 pinned on 2 devices, resized to 1 (the pin dropped), then asked for 2
    devices again. The 2-device layout used to be the stale pinned p = 2 entry, slower than the
    1-device re-plan and than the 3-device one. (Slurm engine: the run's files are written, nothing
    trains, so the resize rewrites plan.json at once.)"""
    assert succeeded(pipectl("profile", "gpt-tiny", "--derive", "--device", "cpu", "-o", "profile.json", cwd=tmp_path))
    planned = pipectl("plan", "--profile", "profile.json", "--cluster", "local", "--devices", 2, "--pipeline-parallel", 2,
                      "--global-batch", 16, "-o", "plan.json", cwd=tmp_path)  # fmt: skip
    assert succeeded(planned), said(planned)
    launched = pipectl("launch", "plan.json", "--run-dir", "runs/mine", "--steps", 12, "--engine", "slurm", cwd=tmp_path)
    assert succeeded(launched), said(launched)
    resized = pipectl("resize", "runs/mine", "--devices", 1, "--steps", 16, cwd=tmp_path)
    assert succeeded(resized) and "re-planned without pinning it" in " ".join(resized.stdout.split()), said(resized)
    unpinned = pipectl("plan", "--profile", "profile.json", "--cluster", "local", "--devices", 2, "--global-batch", 16,
                       "-o", "fresh.json", cwd=tmp_path)  # fmt: skip
    assert succeeded(unpinned), said(unpinned)
    fresh = json.loads((tmp_path / "fresh.json").read_text())["chosen"]
    one, two, three = (dry_run(n, tmp_path)["candidate"] for n in (1, 2, 3))
    assert two["predicted_step_seconds"] == fresh["predicted_step_seconds"]
    assert two["predicted_step_seconds"] <= one["predicted_step_seconds"]
    assert three["predicted_step_seconds"] <= two["predicted_step_seconds"]
