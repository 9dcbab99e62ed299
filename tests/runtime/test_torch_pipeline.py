"""The second execution path (`pipectl.runtime.engines.torch_pipeline`): pipectl's own schedules (1F1B,
interleaved p=2 v=2, ZB-H1 with the split backward I/W, ZBV with two chunks per rank placed as a V)
run by torch's `_PipelineScheduleRuntime`
on 2 local gloo ranks give the one-process losses at every step,
and each rank executes exactly the planned compute order (as recorded by the stages torch's runtime
called, not echoed from the plan).

gpt-tiny (9 layers, head tied to the embedding: the tied gradient is summed across the two ranks;
under ZBV's V rank 0 holds both the embedding and the head),
global batch 8, 4 micro-batches, 4 steps, fp32. One spawn of 2 ranks runs every schedule in turn.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from pipectl.errors import ScheduleError
from pipectl.runtime.engines.dsconfig import ZBV_MIN_TORCH, installed_torch
from pipectl.runtime.engines.torch_pipeline import TorchPipelineJob, reference_run, spawn_local
from pipectl.runtime.engines.torch_stages import even_cuts, planned_compute_order, to_torch_actions
from pipectl.schedule import interleaved, one_f_one_b, zb_h1, zbv
from pipectl.schedule.validate import validate

MODEL = "gpt-tiny"
LAYERS = 9  # embed, 6 blocks, final_norm, head
STEPS = 4
GLOBAL_BATCH = 8
MICRO_BATCHES = 4

JOBS = {
    "1f1b p2": TorchPipelineJob(MODEL, one_f_one_b(2, MICRO_BATCHES), even_cuts(LAYERS, 2), STEPS, GLOBAL_BATCH),
    "interleaved p2 v2": TorchPipelineJob(
        MODEL, interleaved(2, MICRO_BATCHES, 2), even_cuts(LAYERS, 4), STEPS, GLOBAL_BATCH
    ),
    "zb-h1 p2": TorchPipelineJob(MODEL, zb_h1(2, MICRO_BATCHES), even_cuts(LAYERS, 2), STEPS, GLOBAL_BATCH),
    "zbv p2": TorchPipelineJob(MODEL, zbv(2, MICRO_BATCHES), even_cuts(LAYERS, 4), STEPS, GLOBAL_BATCH),
}
# torch before 2.12 cannot run a V on gloo (launch refuses it: runtime/engines/dsconfig.py).
ZBV_RUNS = (installed_torch() or ZBV_MIN_TORCH) >= ZBV_MIN_TORCH
if not ZBV_RUNS:
    del JOBS["zbv p2"]
NEEDS_ZBV = pytest.mark.skipif(not ZBV_RUNS, reason=f"zbv needs torch {ZBV_MIN_TORCH[0]}.{ZBV_MIN_TORCH[1]} or later")


@pytest.fixture(scope="module")
def runs():
    names = list(JOBS)
    outcomes = spawn_local([JOBS[n] for n in names], timeout_seconds=120)
    return {name: {rank: results[i] for rank, results in outcomes.items()} for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def reference():
    return reference_run(JOBS["1f1b p2"])


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-4 * abs(want)


@pytest.mark.multiprocess
def test_every_schedule_gives_the_one_process_loss_at_every_step(runs, reference):
    assert len(reference) == STEPS
    assert len(set(reference)) > 1  # the weights move: not the same loss every step
    for name, ranks in runs.items():
        for rank, result in ranks.items():
            assert len(result.losses) == STEPS
            for step, (got, want) in enumerate(zip(result.losses, reference), start=1):
                assert _close(got, want), f"{name} rank {rank} step {step}: {got} vs {want}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["interleaved p2 v2", "zb-h1 p2", pytest.param("zbv p2", marks=NEEDS_ZBV)])
def test_gives_the_1f1b_loss_at_every_step(runs, name):
    one_f_one_b_losses = runs["1f1b p2"][1].losses
    for step, (got, want) in enumerate(zip(runs[name][1].losses, one_f_one_b_losses), start=1):
        assert _close(got, want), f"{name} step {step}: {got} vs {want}"


@pytest.mark.multiprocess
def test_each_rank_executes_the_planned_compute_order(runs):
    for name, ranks in runs.items():
        schedule = JOBS[name].schedule
        for rank, result in ranks.items():
            planned = planned_compute_order(schedule, rank)
            assert len(result.executed) == STEPS
            for step, executed in enumerate(result.executed, start=1):
                assert executed == planned, f"{name} rank {rank} step {step}"
    # Two stages per rank really ran, in the interleaved order.
    rank0 = runs["interleaved p2 v2"][0].executed[0]
    assert {a[0] for a in rank0} == {"0", "2"}
    assert rank0[:4] == ["0F0", "0F1", "2F0", "2F1"]
    # The split backward really ran split: I and W, W postponed on the last stage.
    zb_rank1 = runs["zb-h1 p2"][1].executed[0]
    assert zb_rank1[:5] == ["1F0", "1I0", "1F1", "1I1", "1W0"]
    assert not any("B" in a for a in zb_rank1)
    # The V: rank 0 ran stages 0 and 3, rank 1 stages 1 and 2, and rank 1 handed stage 1's output
    # to stage 2 on itself (2F0 right after 1F0, nothing from rank 0 in between).
    if not ZBV_RUNS:
        return
    v_rank0, v_rank1 = runs["zbv p2"][0].executed[0], runs["zbv p2"][1].executed[0]
    assert {a[0] for a in v_rank0} == {"0", "3"} and {a[0] for a in v_rank1} == {"1", "2"}
    assert v_rank1[:2] == ["1F0", "2F0"] and not any("B" in a for a in v_rank0 + v_rank1)


def test_the_model_ties_its_head_across_the_two_ranks():
    """So the loss tests cover the cross-rank sum of the tied gradient (embed on rank 0, head on 1)."""
    from pipectl.models.registry import build_model

    layers = build_model(MODEL).layers
    assert len(layers) == LAYERS and layers[0].tie_key == layers[-1].tie_key == "embed"
    for name, job in JOBS.items():
        schedule = job.schedule
        # ZBV's V puts the first and the last stage on rank 0: one module there for both uses.
        together = name == "zbv p2"
        assert (schedule.rank_of(0) == schedule.rank_of(schedule.virtual_stages - 1)) is together


def test_translation_keeps_stage_and_micro_batch_numbering():
    schedule = interleaved(2, 4, 2)
    actions = to_torch_actions(schedule)
    for rank in (0, 1):
        assert [str(a) for a in actions[rank]] == planned_compute_order(schedule, rank)


def test_zb_h1_is_a_valid_schedule_with_the_1f1b_peak():
    for p, m in ((2, 4), (4, 8), (4, 2)):
        schedule = zb_h1(p, m)
        validate(schedule)
        for rank in range(p):
            in_flight = peak = 0
            for action in schedule.compute_order(rank):
                in_flight += {"F": 1, "W": -1}.get(action.kind.value, 0)
                peak = max(peak, in_flight)
            assert peak <= min(p, m), (p, m, rank)


def test_recompute_is_refused():
    with pytest.raises(ScheduleError, match="recompute"):
        to_torch_actions(one_f_one_b(2, 4, recompute=True))


def test_torch_private_pipelining_api_is_where_we_use_it():
    """Fails loudly when a torch upgrade moves or renames the private names this path relies on."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime

    assert _Action._fields[:3] == ("stage_index", "computation_type", "microbatch_index")
    assert str(_Action(2, _ComputationType.FORWARD, 1)) == "2F1"
    for name, value in (("FORWARD", "F"), ("FULL_BACKWARD", "B"), ("BACKWARD_INPUT", "I"), ("BACKWARD_WEIGHT", "W")):
        assert _ComputationType[name].value == value
    assert callable(_PipelineScheduleRuntime._prepare_schedule_with_comms)
    params = inspect.signature(_PipelineScheduleRuntime._prepare_schedule_with_comms).parameters
    assert list(params)[:3] == ["self", "actions", "format"]
    assert "scale_grads" in inspect.signature(_PipelineScheduleRuntime.__init__).parameters or "scale_grads" in (
        inspect.signature(_PipelineScheduleRuntime.__mro__[1].__init__).parameters
    )
    # The entry points RecordingStage overrides, with the arguments the runtime passes.
    assert list(inspect.signature(PipelineStage.forward_one_chunk).parameters)[:2] == ["self", "fwd_chunk_id"]
    assert list(inspect.signature(PipelineStage.backward_one_chunk).parameters) == [
        "self", "bwd_chunk_id", "loss", "full_backward", "last_backward"
    ]
    assert list(inspect.signature(PipelineStage.backward_weight_one_chunk).parameters) == [
        "self", "bwd_chunk_id", "last_backward"
    ]
