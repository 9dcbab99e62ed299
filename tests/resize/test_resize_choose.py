"""The layout for N devices: morph-table look-up, fewer devices when B cannot be split, re-plan,
and errors that name the value."""

from __future__ import annotations

import pytest

from pipectl.artifacts.plan import MorphEntry, Plan, PlanRequest
from pipectl.cluster import local_cluster
from pipectl.errors import InfeasibleError, UserInputError
from pipectl.io import load_model, write_json_atomic
from pipectl.plan.search import plan as search_plan
from pipectl.testing.profiles import synthetic_profile
from pipectl.planfile import write_plan
from pipectl.resize.choose import choose_candidate, replanner, with_entry
from pipectl.schedule import ScheduleKind
from builders import gpt_tiny_candidate, plan_of


candidate = gpt_tiny_candidate


def hand_plan(table, cluster="local", **extra) -> Plan:
    return plan_of(
        candidate(), cluster=cluster, global_batch=8,
        morph_table=[MorphEntry(devices=n, candidate=c, note=note) for n, (c, note) in sorted(table.items())],
        **extra,
    )  # fmt: skip


def gpt_tiny_profile():
    return synthetic_profile(blocks=6, micro_batch_sizes=[1, 2, 4, 8], device="cpu", dtype="float32", name="gpt-tiny")


def test_table_entry_is_taken_as_is():
    plan = hand_plan({1: (candidate(1, m=4), ""), 2: (candidate(2), "")})
    choice = choose_candidate(plan, 1)
    assert choice.candidate == plan.for_devices(1).candidate
    assert choice.source == "morph-table" and not choice.fewer_devices and choice.notes == []


def test_uneven_replicas_use_every_device_and_keep_the_batch():
    # The real planner, data-parallel only: B = 8 over 3 devices, replicas of 3, 3 and 2 samples.
    plan = search_plan(
        gpt_tiny_profile(), local_cluster(4), PlanRequest(global_batch=8, pipeline_parallel=1, max_tensor_parallel=1)
    )
    choice = choose_candidate(plan, 3)
    assert not choice.fewer_devices and choice.candidate.devices == 3
    assert choice.candidate.global_batch == 8
    assert sorted(r.samples for r in choice.candidate.replicas) in ([2, 3, 3], [2, 2, 4])
    for entry in plan.morph_table:
        assert entry.candidate.global_batch == 8 and entry.candidate.devices == entry.devices


def test_batch_that_cannot_be_split_uses_fewer_devices_and_says_so():
    # Even replicas only: B = 8 over 3 devices has no d with 8 % d == 0 and d = 3.
    plan = search_plan(
        gpt_tiny_profile(), local_cluster(4),
        PlanRequest(global_batch=8, pipeline_parallel=1, max_tensor_parallel=1, uneven_replicas=False),
    )
    choice = choose_candidate(plan, 3)
    assert choice.fewer_devices and choice.candidate.devices < 3
    assert choice.candidate.global_batch == 8  # B kept exactly
    assert any(f"uses {choice.candidate.devices} of 3 devices" in note for note in choice.notes)
    assert " ".join(choice.notes).count("of 3 devices") == 1, choice.notes  # said once
    # A re-plan's own note says so already (`replan_for_devices`): not said twice.
    said = f"the best plan that keeps B = 8 uses {choice.candidate.devices} of 3 devices"
    entry = plan.for_devices(3).model_copy(update={"note": said})
    replanned = choose_candidate(plan.model_copy(update={"morph_table": []}), 3, replan=lambda _: entry)
    assert " ".join(replanned.notes).count("of 3 devices") == 1, replanned.notes
    # Every count the table covers keeps B; the entries that fit exactly are not flagged.
    for entry in plan.morph_table:
        assert entry.candidate.global_batch == 8
        assert choose_candidate(plan, entry.devices).fewer_devices == (entry.candidate.devices < entry.devices)


def test_fewer_devices_note_without_planner_note_names_the_batch():
    plan = hand_plan({3: (candidate(2), "")})
    (note,) = choose_candidate(plan, 3).notes
    assert "global batch 8 cannot be split over 3 devices" in note and "uses 2 of 3" in note


@pytest.mark.parametrize("devices", [0, -2])
def test_non_positive_counts_are_refused(devices):
    with pytest.raises(UserInputError, match=f"got {devices}"):
        choose_candidate(hand_plan({1: (candidate(1), "")}), devices)


def test_beyond_a_fixed_cluster_and_not_in_the_table_is_refused():
    plan = hand_plan({1: (candidate(1), ""), 2: (candidate(2), "")}, cluster="a100-8x8")
    with pytest.raises(UserInputError, match=r"--devices 100 exceeds cluster 'a100-8x8' \(64 devices\).*covers 1-2"):
        choose_candidate(plan, 100, replan=replanner(plan, "."))


def test_missing_entry_without_a_profile_cannot_be_replanned():
    plan = hand_plan({1: (candidate(1), ""), 2: (candidate(2), "")})
    with pytest.raises(UserInputError, match="no entry for 5 devices.*covers 1-2.*records no profile"):
        choose_candidate(plan, 5, replan=replanner(plan, "."))
    with pytest.raises(UserInputError, match="no entry for 5 devices"):
        choose_candidate(plan, 5, replan=None)


def test_an_entry_where_nothing_fits_is_infeasible():
    plan = hand_plan({1: (None, "stage 0 needs 21.3 GiB > 16 GiB"), 2: (candidate(2), "")})
    with pytest.raises(InfeasibleError, match="no layout fits on 1 device: stage 0 needs 21.3 GiB"):
        choose_candidate(plan, 1)


def planned_on_disk(tmp_path, request: PlanRequest, devices: int = 2) -> Plan:
    """A plan written by the planner to tmp_path/out/plan.json, its profile copied beside it."""
    profile_path = tmp_path / "profile.json"
    write_json_atomic(profile_path, gpt_tiny_profile())
    made = search_plan(gpt_tiny_profile(), local_cluster(devices), request)
    write_plan(tmp_path / "out" / "plan.json", made, profile_file=profile_path)
    profile_path.unlink()  # the plan does not depend on the original any more
    return load_model(Plan, tmp_path / "out" / "plan.json")


def test_missing_entry_is_replanned_from_the_plans_profile(tmp_path, monkeypatch):
    plan = planned_on_disk(tmp_path, PlanRequest(global_batch=8, max_tensor_parallel=1))
    assert plan.for_devices(4) is None
    monkeypatch.chdir(tmp_path)  # not where the plan lies
    choice = choose_candidate(plan, 4, replan=replanner(plan, tmp_path / "out"))
    assert choice.source == "re-planned" and choice.requested_devices == 4
    assert choice.candidate.global_batch == 8 and choice.candidate.devices <= 4
    assert "re-planned from" in choice.notes[0]
    # The re-planned entry completes the morph table, in order.
    table = with_entry(plan, choice.entry)
    assert [e.devices for e in table] == [1, 2, 4]


@pytest.mark.parametrize(
    "request_fields, kept",
    [
        (dict(schedules=[ScheduleKind.GPIPE], allow_recompute=False), dict(schedule=ScheduleKind.GPIPE, recompute=False)),
        (dict(tensor_parallel=2), dict(tensor_parallel=2)),
        (dict(pipeline_parallel=2, schedules=[ScheduleKind.ONE_F_ONE_B]), dict(pipeline_parallel=2, schedule=ScheduleKind.ONE_F_ONE_B)),
    ],
)
def test_a_replan_keeps_every_constraint_of_the_request(tmp_path, request_fields, kept):
    plan = planned_on_disk(tmp_path, PlanRequest(global_batch=8, **request_fields))
    assert plan.request == PlanRequest(global_batch=8, **request_fields)
    for name, value in kept.items():
        assert getattr(plan.chosen, name) == value
    choice = choose_candidate(plan, 4, replan=replanner(plan, tmp_path / "out"))
    assert choice.source == "re-planned" and choice.candidate.devices == 4
    for name, value in kept.items():
        assert getattr(choice.candidate, name) == value, name


def test_degrees_pinned_for_more_devices_than_the_resize_leaves_are_dropped_and_named(tmp_path):
    # p = 2 pinned on 2 devices; a resize to 1 cannot keep it: it re-plans without, and says so.
    plan = planned_on_disk(tmp_path, PlanRequest(global_batch=8, pipeline_parallel=2, max_tensor_parallel=1), devices=2)
    assert plan.chosen.pipeline_parallel == 2 and plan.for_devices(1) is None
    choice = choose_candidate(plan, 1, replan=replanner(plan, tmp_path / "out"))
    assert choice.candidate.devices == 1 and choice.candidate.pipeline_parallel == 1
    assert choice.candidate.global_batch == 8
    assert any("pinned p = 2, more than 1 device can hold: re-planned without pinning it" in note
               for note in choice.notes)  # fmt: skip
    # Where the pin holds, it is kept (above: `test_a_replan_keeps_every_constraint_of_the_request`).
    # The run's plan.json says so too: its request (what `launch --print-config` writes back, to
    # re-plan the job) asks for 1 device, without the pin; the rest of the request stays.
    from pipectl.resize.restart import resized_plan

    resized = resized_plan(plan, choice)
    assert resized.request == plan.request.model_copy(update={"devices": 1, "pipeline_parallel": None})
    back = resized_plan(resized, choose_candidate(resized, 2, replan=replanner(resized, tmp_path / "out")))
    assert back.request.devices == 2 and back.chosen.devices == 2


def test_a_replan_refuses_a_profile_that_changed_since_planning(tmp_path):
    plan = planned_on_disk(tmp_path, PlanRequest(global_batch=8))
    copy = tmp_path / "out" / plan.profile.file
    copy.write_text(copy.read_text().replace('"gpt-tiny"', '"gpt-other"'))
    with pytest.raises(Exception, match=f"{plan.profile.file} has sha256 .*the plan was made from"):
        choose_candidate(plan, 4, replan=replanner(plan, tmp_path / "out"))
    copy.unlink()
    with pytest.raises(UserInputError, match="profile .* is missing"):
        choose_candidate(plan, 4, replan=replanner(plan, tmp_path / "out"))


def test_a_replan_reads_and_verifies_the_profiles_of_the_other_kinds_too(tmp_path):
    profile_path, other_path = tmp_path / "profile.json", tmp_path / "other.json"
    write_json_atomic(profile_path, gpt_tiny_profile())
    write_json_atomic(other_path, gpt_tiny_profile().model_copy(update={"device": "a100-80gb"}))
    made = search_plan(gpt_tiny_profile(), local_cluster(2), PlanRequest(global_batch=8))
    write_plan(tmp_path / "out" / "plan.json", made, profile_file=profile_path, kind_profile_files=[other_path])
    plan = load_model(Plan, tmp_path / "out" / "plan.json")
    [ref] = plan.kind_profiles
    assert choose_candidate(plan, 4, replan=replanner(plan, tmp_path / "out")).source == "re-planned"
    copy = tmp_path / "out" / ref.file
    copy.write_text(copy.read_text().replace('"a100-80gb"', '"h100-80gb"'))
    with pytest.raises(Exception, match=f"{ref.file} has sha256 .*the plan was made from"):
        choose_candidate(plan, 4, replan=replanner(plan, tmp_path / "out"))
