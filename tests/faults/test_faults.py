"""Faults on real `pipectl launch` runs (gpt-tiny, p=2, fp32): after a rank is killed at a known
point, `launch --resume` starts from the last complete checkpoint, trains every step exactly as a
fault-free run did, and ends with the same weights and Adam moments (1e-6 relative). The full
sweep (>= 20 random kill points and the other kinds) is benchmarks/fault_sweep.py; a few of its
kinds run here under `slow`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest


from pipectl.testing import fault_harness
from pipectl.testing import fault_trials as ft

CI_SETUP = fault_harness.Setup(steps=4, checkpoint_every=2)
LONG_SETUP = fault_harness.Setup(steps=6, checkpoint_every=2)  # the slow trials: two checkpoints before a fault


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> fault_harness.Reference:
    """The fault-free run every trial is compared with, and its census of fault points."""
    return fault_harness.reference_run(CI_SETUP, tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory) -> fault_harness.Reference:
    return fault_harness.reference_run(LONG_SETUP, tmp_path_factory.mktemp("faults-long"))


def assert_survived(trial: ft.Trial) -> None:
    assert trial.survived, "\n".join(trial.problems)
    assert trial.lost == 0 and trial.resumed == trial.expected_resume
    assert trial.weights_max_rel_diff <= fault_harness.TOLERANCE and trial.moments_max_rel_diff <= fault_harness.TOLERANCE


@pytest.mark.multiprocess
def test_the_census_counts_every_point_where_it_happens(reference):
    events = reference.events
    steps = range(1, CI_SETUP.steps + 1)
    for rank in (0, 1):
        for step in steps:
            assert events[(rank, step, "forward")] == events[(rank, step, "backward")] > 0
            assert events[(rank, step, "optimizer")] >= 1
            assert events[(rank, step, "allreduce")] >= 1  # the tied embedding's gradients, at least
            assert ((rank, step, "save") in events) == (step in CI_SETUP.checkpoint_steps)
            assert ((rank, step, "written") in events) == (step in CI_SETUP.checkpoint_steps)
    assert {(r, s) for r, s, p in events if p == "commit"} == {(0, s) for s in CI_SETUP.checkpoint_steps}


@pytest.mark.multiprocess
def test_a_rank_killed_at_a_random_point_of_a_step_loses_nothing(reference, tmp_path):
    """SIGKILL of a rank at a (rank, step, point, nth) drawn from the census with a fixed seed."""
    rng = random.Random(20)
    trigger = ft.draw_trigger(reference, rng, rng.choice(("forward", "backward", "allreduce", "optimizer")),
                              steps=range(CI_SETUP.checkpoint_every + 1, CI_SETUP.steps + 1))  # fmt: skip
    trial = ft.triggered_trial("kill", reference, tmp_path, trigger)
    assert trial.exit_codes[0] not in (0, None) and trial.fired
    assert_survived(trial)


@pytest.mark.multiprocess
def test_rank0_killed_as_it_commits_a_checkpoint_every_rank_wrote_loses_nothing(reference, tmp_path):
    """Rank 0 dies writing the manifest of step 4 (the last), after every rank reported its file:
    the checkpoint is whole in staging with its hashes, so the resume commits it and starts at 4."""
    trigger = {"rank": 0, "step": 4, "point": "commit", "nth": 0, "action": "kill"}
    trial = ft.triggered_trial("kill", reference, tmp_path, trigger)
    assert trial.expected_resume == 4 and trial.fired
    assert trial.steps_trained == [1, 2, 3, 4]  # nothing trained again
    assert_survived(trial)


@pytest.mark.multiprocess
def test_a_rank_killed_during_its_background_write_leaves_nothing_that_loads(reference, tmp_path):
    """Rank 1 dies as its file of step 4 (the last checkpoint) is written, before it reports it, while
    rank 0 has moved on: step 4 is never committed, and the resume starts from step 2."""
    trigger = {"rank": 1, "step": 4, "point": "written", "nth": 0, "action": "kill"}
    trial = ft.triggered_trial("kill", reference, tmp_path, trigger)
    assert trial.fired and trial.expected_resume == 2
    assert trial.steps_trained == [1, 2, 3, 4, 3, 4]  # 3 and 4 trained again, from step 2
    assert_survived(trial)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("rank", [0, 1])
def test_slow_a_kill_during_a_background_write_in_the_middle_of_a_run(long_reference, tmp_path, rank):
    trigger = {"rank": rank, "step": 4, "point": "written", "nth": 0, "action": "kill"}
    trial = ft.triggered_trial("kill", long_reference, tmp_path, trigger)
    assert trial.fired and trial.expected_resume in (2, 4)  # 4 only if every rank had reported it
    assert_survived(trial)


def test_a_changed_tensor_and_a_missing_one_are_differences():
    import torch

    reference = {"w/fp32": torch.tensor([1.0, -4.0]), "w/exp_avg": torch.tensor([2.0])}
    assert fault_harness.max_relative_difference(dict(reference), reference) == 0.0
    assert fault_harness.max_relative_difference({**reference, "w/fp32": torch.tensor([1.0, -4.004])}, reference) == pytest.approx(1e-3, rel=1e-4)
    assert fault_harness.max_relative_difference({"w/exp_avg": torch.tensor([2.0])}, reference) == float("inf")
    assert fault_harness.max_relative_difference({"w/fp32": reference["w/fp32"]}, reference, ("exp_avg",)) == float("inf")


def test_the_last_complete_checkpoint_before_a_step():
    setup = fault_harness.Setup(steps=7, checkpoint_every=3)
    assert setup.checkpoint_steps == [3, 6, 7]
    assert [setup.last_checkpoint_before(s) for s in range(1, 8)] == [0, 0, 0, 3, 3, 3, 6]


def test_saving_a_committed_step_again_keeps_the_same_files_and_replaces_other_ones(tmp_path):
    """What the stop after a checkpoint step does (the slow trial below shows why it matters)."""
    from pipectl.artifacts.run import CheckpointManifest
    from pipectl.rundir import checkpoints as ckpt

    root = ckpt.checkpoints_dir(tmp_path)

    def commit(payload: bytes, when: float) -> Path:
        staged = root / ckpt.STAGING_DIR / f"w1-{int(when)}" / "step00000004_universal"
        staged.mkdir(parents=True)
        (staged / "fp32.pt").write_bytes(payload)
        files = ckpt.hash_tree(staged)
        manifest = CheckpointManifest(tag="step00000004", step=4, files=files, file_bytes={"fp32.pt": len(payload)},
                                      bytes=len(payload), time_unix=when)  # fmt: skip
        return ckpt.commit_tag(root, staged, "step00000004", manifest)

    def committed_time() -> float:
        return CheckpointManifest.model_validate_json((root / "step00000004" / "manifest.json").read_text()).time_unix

    commit(b"weights", 1.0)
    commit(b"weights", 2.0)  # the same bytes: the first commit stands, the staged copy is dropped
    assert committed_time() == 1.0 and not (root / ckpt.STAGING_DIR / "w1-2").joinpath("step00000004_universal").exists()
    path = commit(b"other weights", 3.0)
    assert committed_time() == 3.0 and (path / "fp32.pt").read_bytes() == b"other weights"
    assert ckpt.verify_checkpoint(path).verified and (root / "latest").read_text() == "step00000004"


# --------------------------------------------------------------------------- the sweep's other kinds


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("point", ["forward", "backward", "allreduce", "optimizer", "save"])
def test_slow_a_kill_at_each_point(long_reference, tmp_path, point):
    trigger = ft.draw_trigger(long_reference, random.Random(point), point, steps=range(3, LONG_SETUP.steps + 1))
    assert trigger["point"] == point
    assert_survived(ft.triggered_trial("kill", long_reference, tmp_path, trigger))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_slow_a_damaged_newest_checkpoint_falls_back_to_the_one_before(long_reference, tmp_path, how):
    trigger = {"rank": 1, "step": 6, "point": "forward", "nth": 3, "action": "kill"}
    trial = ft.triggered_trial(how, long_reference, tmp_path, trigger, {"how": how, "seed": 7})
    assert trial.fault["damage"]["step"] == 4 and trial.expected_resume == 2
    assert_survived(trial)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slow_sigterm_to_a_rank_stops_at_the_step_boundary(long_reference, tmp_path):
    trigger = {"rank": 1, "step": 3, "point": "backward", "nth": 5, "action": "term"}
    trial = ft.triggered_trial("sigterm-rank", long_reference, tmp_path, trigger)
    assert trial.exit_codes == [0, 0] and trial.expected_resume == 3
    assert_survived(trial)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("signal_name", ["SIGHUP", "SIGKILL"])
def test_slow_a_closed_terminal_or_a_killed_pipectl_loses_nothing(long_reference, tmp_path, signal_name):
    """SIGHUP or kill -9 of `pipectl launch`: the ranks stop at a step boundary after a checkpoint
    (by themselves after kill -9) and the resume goes on from there, bit for bit."""
    trial = ft.signal_launch_trial(long_reference, tmp_path, 3, signal_name)
    assert trial.fired and trial.expected_resume >= 3
    assert_survived(trial)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slow_a_full_disk_for_a_metrics_line_loses_nothing(long_reference, tmp_path):
    """ENOSPC on rank 0's metrics.jsonl append at step 3: the job trains on, the line is written
    with step 4's, and every loss and tensor equals the fault-free run's."""
    trigger = {"rank": 0, "step": 3, "point": "metrics", "nth": 0, "action": "enospc"}
    trial = ft.triggered_trial("metrics-enospc", long_reference, tmp_path, trigger)
    assert trial.fired and trial.exit_codes[0] == 0
    assert_survived(trial)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slow_a_full_disk_during_a_checkpoint_write(long_reference, tmp_path):
    trigger = {"rank": 1, "step": 4, "point": "save", "nth": 0, "action": "enospc"}
    assert_survived(ft.triggered_trial("disk-full", long_reference, tmp_path, trigger))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slow_a_file_size_limit_on_a_resume(long_reference, tmp_path):
    assert_survived(ft.size_limit_trial(long_reference, tmp_path, 2, 48))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["race", "during", "resume-race"])
def test_slow_concurrent_launches_on_one_run_directory(long_reference, tmp_path, variant):
    trial = ft.concurrent_trial(long_reference, tmp_path, variant)
    assert trial.survived, "\n".join(trial.problems)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slow_a_kill_while_a_stop_saves_its_step_again_keeps_the_committed_checkpoint(long_reference, tmp_path):
    """SIGTERM in step 4, a checkpoint step: the ranks checkpoint step 4 in the loop, then stop and
    save step 4 again. Rank 0 is to be killed as that second save writes its manifest. Replacing
    the committed tag moved it aside and deleted it before the new one had a manifest, so this kill
    left no complete step 4 and the resume went back to step 2 (2 steps lost). The second save now
    finds the same files committed and keeps them: no manifest is written, the kill never comes,
    and step 4 stays complete."""
    triggers = [
        {"rank": 1, "step": 4, "point": "forward", "nth": 0, "action": "term"},
        {"rank": 0, "step": 4, "point": "commit", "nth": 1, "action": "kill"},  # the second save's manifest
    ]
    run = tmp_path / "run"
    trial = ft.Trial("kill", LONG_SETUP.label, {"triggers": triggers}, expected_resume=4)
    launches = [ft.fault_launch(long_reference, run, ft.trigger_env(tmp_path / "records", triggers))]
    fired = json.loads((tmp_path / "records" / "fired-rank1.json").read_text())["fired"]
    assert [t["action"] for t in fired] == ["term"]
    ft.resume(long_reference, run, launches, trial)
    ft.check(trial, long_reference, run, launches)
    assert trial.resumed == 4 and trial.lost == 0, "\n".join(trial.problems)
    assert_survived(trial)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slow_a_stopped_rank_ends_the_job_by_its_collective_timeout_and_loses_nothing(long_reference, tmp_path):
    trigger = ft.draw_trigger(long_reference, random.Random(11), "backward", "stop", range(3, long_reference.setup.steps))
    trial = ft.triggered_trial("stopped", long_reference, tmp_path, trigger)
    assert trial.survived, trial.problems
    assert trial.launch_seconds[0] < ft.STOPPED_RANK_COLLECTIVE_TIMEOUT + 60  # bounded: not the 10-minute default


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slow_a_disk_with_room_for_no_checkpoint_stops_at_the_first(long_reference, tmp_path):
    assert_survived(ft.tiny_disk_trial(long_reference, tmp_path, 2**20))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slow_a_checkpoint_missing_a_ranks_file_is_refused_and_the_resume_falls_back(long_reference, tmp_path):
    setup = long_reference.setup
    step = setup.steps  # step 4's checkpoint committed by then, step 2's before it
    trigger = ft.draw_trigger(long_reference, random.Random(0), "forward", "kill", range(step, step + 1))
    trial = ft.unloadable_trial(long_reference, tmp_path, trigger)
    assert trial.expected_resume > 0  # an earlier checkpoint to fall back to
    assert_survived(trial)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slow_a_live_resize_killed_while_its_joiner_warms_up_changes_nothing(tmp_path):
    """The sweep's killed-resize kind: a 1-rank job with 2 ranks in its morph table; kill -9 of
    `pipectl resize --devices 2` once the joining rank exists. The run's files are as they were,
    the joiner leaves, and every loss and tensor equals the run that was never resized."""
    one = fault_harness.Setup(pipeline_parallel=1, data_parallel=1, steps=4, checkpoint_every=2)
    two = fault_harness.Setup(pipeline_parallel=1, data_parallel=2, micro_batch_size=2, micro_batches=2)
    reference = fault_harness.reference_run(one, tmp_path / "reference", (two,))
    trial = ft.killed_resize_trial(reference, tmp_path / "trial", at_step=2, delay=0.5)
    assert trial.fired and trial.exit_codes == [0]
    assert trial.survived, "\n".join(trial.problems)
    assert trial.weights_max_rel_diff <= fault_harness.TOLERANCE and trial.moments_max_rel_diff <= fault_harness.TOLERANCE
