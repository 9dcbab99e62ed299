"""A data-parallel replica lost to kill -9 under `launch --recover-in-memory` (issue 21): the
surviving replica takes over from its own state and its copy of the lost one's, without a
checkpoint (the run has none before its last step), and trains every remaining step as the
fault-free run does.

Real processes: `pipectl launch` started as a user would, one torchrun per replica, gloo ranks of
gpt-tiny with fault points (src/pipectl/testing/user_model/pipectl_fault_model.py): rank 1 SIGKILLs itself as the
forward of step 3 begins. The survivor (rank 0) must find its peer gone, the agent must choose the
one-rank layout of the morph table (the same global batch), and the run must end with exit 0,
every step trained once, and each loss and the final weights and Adam moments exactly those of the
restart path from the same step: the two-replica run checkpointed after step 2 and resumed on one
rank (1e-6 relative, as the fault trials hold a restart to). The in-memory state the survivor
restored is the state a checkpoint holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


from pipectl.testing import fault_harness as harness
from pipectl.testing import fault_trials

from pipectl.artifacts.morph import MorphTrigger  # noqa: E402
from pipectl.artifacts.plan import MorphEntry  # noqa: E402
from pipectl.io import write_json_atomic  # noqa: E402
from pipectl.models import build_model  # noqa: E402
from pipectl.models.base import shape_of  # noqa: E402
from pipectl.rundir.morph_history import read_history  # noqa: E402
from builders import gpt_tiny_candidate, plan_of  # noqa: E402

STEPS = 6
D2, D1 = gpt_tiny_candidate(1, 2, m=2), gpt_tiny_candidate(1, 1, m=4)
D2P2, P2 = gpt_tiny_candidate(2, 2, m=2), gpt_tiny_candidate(2, 1, m=4)


def write_plan(path: Path, chosen, *morph_table) -> Path:
    plan = plan_of(
        chosen, global_batch=8, model=harness.MODEL, shape=shape_of(build_model("gpt-tiny")), model_reference=harness.MODEL,
        morph_table=[MorphEntry(devices=c.devices, candidate=c) for c in morph_table],
    )  # fmt: skip
    return write_json_atomic(path, plan)


def launch(plan: Path, run: Path, env: dict[str, str], *extra: str, steps: int = STEPS) -> harness.Launch:
    done = harness.run_launch(harness.launch_argv(plan, run, "--steps", str(steps), "--checkpoint-every", str(steps), *extra), env)
    assert done.exit_code == 0, done.output + (run / "logs" / "engine.log").read_text()[-4000:]
    return done


def restarted(tmp_path: Path, before: Path, after: Path, step: int) -> Path:
    """The restart path: `before`'s layout checkpointed after `step`, resumed in `after`'s."""
    run = tmp_path / "restarted"
    launch(before, run, harness.launch_env(), steps=step)
    launch(after, run, harness.launch_env(), "--resume")
    return run


def assert_same_run(run: Path, reference: Path) -> None:
    losses = harness.read_losses(run)
    assert [step for step, _ in losses] == list(range(1, STEPS + 1))  # each step once: none lost
    expected = dict(harness.read_losses(reference))
    for step, loss in losses:
        assert loss == pytest.approx(expected[step], rel=harness.TOLERANCE), step
    final, wanted = harness.final_tensors(run, STEPS), harness.final_tensors(reference, STEPS)
    assert harness.max_relative_difference(final, wanted, harness.STATES) <= harness.TOLERANCE


@pytest.mark.multiprocess
def test_a_replica_killed_mid_step_is_recovered_from_the_survivors_memory(tmp_path):
    plan = write_plan(tmp_path / "plan.json", D2, D1, D2)
    trigger = {"rank": 1, "step": 3, "point": "forward", "nth": 0, "action": "kill"}
    run = tmp_path / "faulted"
    faulted = launch(plan, run, fault_trials.trigger_env(tmp_path / "fault", trigger), "--recover-in-memory")
    assert json.loads((tmp_path / "fault" / "fired-rank1.json").read_text()), "rank 1 was not killed"
    assert "take over in memory" in faulted.output and not faulted.traceback

    (record,) = read_history(run)
    assert record.trigger is MorphTrigger.FAILURE and record.path == "live"
    assert (record.from_layout, record.to_layout) == ("t1p1d2 1f1b b2 m2", "t1p1d1 1f1b b2 m4")
    assert record.resume_step == 2 and record.excluded_ranks == [1] and record.pause_seconds is not None
    recovery = json.loads((run / "logs" / "recovery.json").read_text())
    assert recovery["recovered"] and recovery["lost_ranks"] == [1]
    assert not list((run / "checkpoints").glob("step0000000[1-5]"))  # nothing on disk to restart from
    assert_same_run(run, restarted(tmp_path, plan, write_plan(tmp_path / "d1.json", D1), 2))


@pytest.mark.slow
def test_the_replica_holding_rank_0_is_lost_from_a_two_stage_pipeline(tmp_path):
    """p = 2, d = 2: rank 0 (stage 0 of replica 0, and the job's store) is killed in its backward of
    step 2; replica 1's two ranks take over as a p = 2 pipeline (renumbered 0 and 1), each stage
    from its own half of the ZeRO-1 state and its copy of replica 0's half."""
    plan = write_plan(tmp_path / "plan.json", D2P2, P2, D2P2)
    trigger = {"rank": 0, "step": 2, "point": "backward", "nth": 0, "action": "kill"}
    run = tmp_path / "faulted"
    launch(plan, run, fault_trials.trigger_env(tmp_path / "fault", trigger), "--recover-in-memory")
    (record,) = read_history(run)
    assert (record.to_layout, record.resume_step, record.excluded_ranks) == ("t1p2d1 1f1b b2 m4", 1, [0, 1])
    assert record.bytes_moved > 0  # the stages' halves of the state moved between the survivors
    assert_same_run(run, restarted(tmp_path, plan, write_plan(tmp_path / "p2.json", P2), 1))
