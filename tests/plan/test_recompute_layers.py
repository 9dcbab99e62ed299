"""Per-layer activation checkpointing in the planner: its memory, its time, and when the search takes it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipectl.artifacts.plan import Candidate, Plan, PlanRequest, Recompute, RecomputeChoice
from pipectl.artifacts.profile import LayerCost, LayerProfile, ModelProfile, ProfileSource
from pipectl.cluster import load_cluster, local_cluster
from pipectl.plan.candidates import ShapeBuilder
from pipectl.plan.costs import hardware_for
from pipectl.plan.cost_table import stage_costs_for
from pipectl.plan.flops import LayerFlops, step_flops
from pipectl.plan.layer_table import layer_table
from pipectl.plan.memory_ranges import FurthestFittingEnds, RangeMemory
from pipectl.plan.memory import StageMemory
from pipectl.plan.search import plan
from pipectl.testing.profiles import synthetic_profile
from pipectl.schedule import ScheduleKind
from tests.plan.test_memory_h100 import _one_h100, gpt_1_83b

DATA = Path(__file__).parent / "data"


def _hand_made() -> ModelProfile:
    """Four layers with round figures at b = 1 (bytes): output 10, 20, 30, 40; saved 100, 300,
    200, 50; parameters 1000 each; no working memory."""
    outputs, saved = (10, 20, 30, 40), (100, 300, 200, 50)
    layers = [
        LayerProfile(
            index=i, name=f"layer.{i}", kind="linear", parameter_count=1000, parameter_bytes=4000,
            costs=[LayerCost(micro_batch_size=1, forward_seconds=1.0 + i, backward_seconds=2.0 * (1.0 + i),
                             output_activation_bytes=outputs[i], saved_activation_bytes=saved[i],
                             peak_memory_bytes=4000 + saved[i] + outputs[i])],
        )
        for i in range(4)
    ]  # fmt: skip
    return ModelProfile(model="hand", source=ProfileSource.MEASURED, device="cpu", dtype="float32",
                        micro_batch_sizes=[1], layers=layers)


def test_per_layer_checkpointing_keeps_the_layers_inputs_and_one_layers_saved_activations():
    table = layer_table(_hand_made(), 1)
    cut = [(0, 2), (2, 4)]
    layer = StageMemory.build(table, cut, tensor_parallel=1, recompute=Recompute.LAYER)
    # Stage 0: inputs of layers 0 and 1 (tokens: 0, then layer 0's output 10); its largest layer
    # saves 300. Stage 1, the last, checkpoints too: inputs 20 + 30, largest 200.
    assert layer.unit_bytes.tolist() == [10.0, 50.0]
    assert layer.recompute_buffer_bytes.tolist() == [300.0, 200.0]
    stage = StageMemory.build(table, cut, tensor_parallel=1, recompute=Recompute.STAGE)
    assert stage.unit_bytes.tolist() == [0.0, 250.0]  # its input; the last stage keeps everything
    assert stage.recompute_buffer_bytes.tolist() == [400.0, 0.0]
    none = StageMemory.build(table, cut, tensor_parallel=1, recompute=False)
    assert none.unit_bytes.tolist() == [400.0, 250.0] and none.recompute_buffer_bytes.tolist() == [0.0, 0.0]
    # 3 micro-batches in flight on stage 0, 1 on stage 1, 16 bytes per parameter held, 20 at the step.
    peaks = layer.per_rank_bytes(16.0, 20.0, (3, 1))
    assert peaks.tolist() == [max(16 * 2000 + 3 * 10 + 300, 20 * 2000), max(16 * 2000 + 50 + 200, 20 * 2000)]
    # Bools read as before: True is whole-stage recomputation.
    again = StageMemory.build(table, cut, tensor_parallel=1, recompute=True)
    assert again.unit_bytes.tolist() == [0.0, 250.0] and again.recompute_buffer_bytes.tolist() == [400.0, 0.0]


def test_a_one_stage_plan_checkpoints_every_layer_at_t2_dividing_saved_but_not_inputs():
    table = layer_table(_hand_made(), 1)
    memory = StageMemory.build(table, [(0, 4)], tensor_parallel=2, recompute=Recompute.LAYER)
    assert memory.unit_bytes.tolist() == [60.0]  # 0 + 10 + 20 + 30: inputs are whole on every rank
    assert memory.recompute_buffer_bytes.tolist() == [150.0]  # 300 / t


@pytest.mark.parametrize("seed", range(3))
def test_the_range_rows_and_the_furthest_ends_agree_with_the_stage_memory(seed):
    rng = random.Random(seed)
    profile = synthetic_profile(blocks=7, micro_batch_sizes=[1, 2], hidden=128, seq_len=256,
                                block_forward_seconds=[rng.uniform(0.5, 2.0) for _ in range(7)],
                                head_working_per_logit=rng.choice((0.0, 8.0)))
    for t in (1, 2):
        table = layer_table(profile, 2, t)
        rows = RangeMemory.build(table, t)
        layers = table.layers
        for start in range(layers):
            for end in range(start + 1, layers + 1):
                alone = StageMemory.build(table, [(start, end)], tensor_parallel=t, recompute=Recompute.LAYER)
                expected = alone.per_rank_bytes(16.0, 24.0, (3,))[0]
                got = rows.stage_bytes(start, end, state_bytes=16.0, step_bytes=24.0, units=3, recompute=Recompute.LAYER)
                assert got == expected
        # Every cut at once (the fast path) equals stage by stage (the reference).
        cuts = [(0, 3), (3, 5), (5, layers)]
        fast = StageMemory.build(table, cuts, tensor_parallel=t, recompute=Recompute.LAYER, rows=rows)
        slow = StageMemory.build(table, cuts, tensor_parallel=t, recompute=Recompute.LAYER)
        for a, b in zip((fast.unit_bytes, fast.recompute_buffer_bytes), (slow.unit_bytes, slow.recompute_buffer_bytes)):
            assert a.tolist() == b.tolist()
        # The furthest fitting end is the last end whose stage fits, by brute force.
        capacity = rows.stage_bytes(0, 4, state_bytes=16.0, step_bytes=24.0, units=3, recompute=Recompute.LAYER)
        ends = FurthestFittingEnds(rows, capacity)
        for start in range(layers):
            fitting = [end for end in range(start + 1, layers + 1)
                       if rows.stage_bytes(start, end, state_bytes=16.0, step_bytes=24.0, units=3,
                                           recompute=Recompute.LAYER) <= capacity]  # fmt: skip
            assert ends.end(start, 16.0, 24.0, 3, Recompute.LAYER) == max(fitting, default=start)
        # ... and it is remembered apart from the other kinds of stage.
        assert ends.end(0, 16.0, 24.0, 3, False) != ends.end(0, 16.0, 24.0, 3, Recompute.LAYER)


def test_the_lm_head_is_left_alone_keeping_its_saved_activations_and_running_once():
    profile = _hand_made()
    layers = [*profile.layers[:3], profile.layers[3].model_copy(update={"kind": "lm_head"})]
    table = layer_table(profile.model_copy(update={"layers": layers}), 1)
    memory = StageMemory.build(table, [(0, 2), (2, 4)], tensor_parallel=1, recompute=Recompute.LAYER)
    assert memory.unit_bytes.tolist() == [10.0, 20.0 + 50.0]  # layer 2's input, the head's saved 50
    assert memory.recompute_buffer_bytes.tolist() == [300.0, 200.0]
    hardware = hardware_for(local_cluster(2), profile)
    seconds = ShapeBuilder(profile.model_copy(update={"layers": layers}), hardware).seconds(1, 1)
    assert seconds.recomputed_forward(2, 4) == seconds.forward[2]  # not the head's


def test_each_backward_costs_its_layers_forward_once_more_and_the_schedule_has_no_recompute():
    profile = _hand_made()
    hardware = hardware_for(local_cluster(2), profile)
    builder = ShapeBuilder(profile, hardware)
    plain = builder.shape_from_cuts(1, 1, Recompute.NONE, 2, 1, [(0, 2), (2, 4)])
    layer = builder.shape_from_cuts(1, 1, Recompute.LAYER, 2, 1, [(0, 2), (2, 4)])
    assert layer.forward.tolist() == plain.forward.tolist()
    table = layer_table(profile, 1)
    assert (layer.backward - plain.backward).tolist() == pytest.approx([table.forward(0, 2), table.forward(2, 4)])
    assert layer.backward[1] - plain.backward[1] > 0  # the last stage recomputes too


def _pinned(profile, cluster, **fields):
    request = PlanRequest(global_batch=64, schedules=[ScheduleKind.ONE_F_ONE_B], morph=False, include_all=True, **fields)
    return plan(profile, cluster, request)


def test_memory_forces_per_layer_checkpointing_on_one_h100_at_b16():
    # The 1.83 B GPT that ran out of memory at b 16 without recomputation (test_memory_h100.py).
    result = _pinned(gpt_1_83b(), _one_h100(), micro_batch_size=16)
    assert {c.recompute_granularity for c in result.candidates} == {Recompute.LAYER}
    chosen = result.chosen
    assert chosen.checkpoint_layers and not chosen.recompute and chosen.pipeline_parallel == 1
    # The head is not checkpointed: it keeps its logits, the others their input.
    table = layer_table(gpt_1_83b(), 16)
    kept = sum(table.input_activation_bytes(i) for i in range(10)) + table.saved_activation_bytes[10]
    assert table.layer_inputs(0, 11) == kept
    with pytest.raises(Exception, match="does not fit"):
        _pinned(gpt_1_83b(), _one_h100(), micro_batch_size=16, recompute=RecomputeChoice.STAGE)


def test_no_checkpointing_where_memory_does_not_force_it():
    # b 8 fits without: recomputation only costs time, so the fastest candidate keeps everything.
    result = _pinned(gpt_1_83b(), _one_h100(), micro_batch_size=8)
    assert {c.recompute_granularity for c in result.candidates} == {Recompute.NONE, Recompute.LAYER}
    assert result.chosen.recompute_granularity is Recompute.NONE
    by_granularity = {c.recompute_granularity: c for c in result.candidates}
    assert by_granularity[Recompute.LAYER].predicted_step_seconds > by_granularity[Recompute.NONE].predicted_step_seconds
    assert max(by_granularity[Recompute.LAYER].peak_memory_bytes) < max(by_granularity[Recompute.NONE].peak_memory_bytes)


def test_a_checkpointing_candidate_resimulates_to_its_own_step_and_hfu_counts_every_layer():
    result = _pinned(gpt_1_83b(), _one_h100(), micro_batch_size=16)
    chosen = result.chosen
    costs = stage_costs_for(chosen, gpt_1_83b(), _one_h100())
    builder = ShapeBuilder(gpt_1_83b(), hardware_for(_one_h100(), gpt_1_83b()))
    shape = builder.shape_from_cuts(1, 16, Recompute.LAYER, 1, 1, [tuple(s) for s in chosen.stage_layers])
    assert costs.backward_seconds[0] == pytest.approx(float(shape.backward[0]), rel=1e-12)
    flops = LayerFlops(forward=tuple(float(i + 1) for i in range(11)), split=(True,) * 11, source="profile", detail="",
                       not_checkpointed=(False,) * 10 + (True,))  # fmt: skip
    every = step_flops(flops, 64, chosen.stage_layers, False, checkpoint_layers=True)
    assert every.recomputed == 64 * sum(range(1, 11))  # every layer but the head
    assert step_flops(flops, 64, chosen.stage_layers, False).recomputed == 0


def test_a_candidate_recomputes_whole_stages_or_checkpoints_layers_not_both():
    fields = dict(devices=2, device="cpu", tensor_parallel=1, pipeline_parallel=2, data_parallel=1,
                  micro_batch_size=1, micro_batches=2, schedule="1f1b", zero_stage=1, stage_layers=[(0, 2), (2, 4)],
                  predicted_step_seconds=1.0, samples_per_second=2.0, tflops_per_device=0.0,
                  peak_memory_bytes=[1, 1], bubble_fraction=0.0, communication_fraction=0.0,
                  cost_per_million_samples=0.0)  # fmt: skip
    assert Candidate(recompute=False, checkpoint_layers=True, **fields).recompute_granularity is Recompute.LAYER
    assert Candidate(recompute=True, **fields).recompute_granularity is Recompute.STAGE
    with pytest.raises(ValidationError, match="exclude each other"):
        Candidate(recompute=True, checkpoint_layers=True, **fields)


def test_an_older_plan_file_without_the_field_loads_unchanged():
    text = (DATA / "gpt2-2.5b-a100-unsharded.plan.json").read_text()
    assert "checkpoint_layers" not in text and '"recompute": "' not in text
    old = Plan.model_validate(json.loads(text))
    assert not old.chosen.checkpoint_layers and all(not c.checkpoint_layers for c in old.candidates)
    assert old.request.allow_recompute and old.request.recompute is RecomputeChoice.AUTO
    never = PlanRequest.model_validate({**json.loads(text)["request"], "allow_recompute": False})
    assert never.recompute_granularities == (Recompute.NONE,)
    with pytest.raises(ValidationError, match="allow_recompute is false but recompute is 'layer'"):
        PlanRequest(global_batch=8, allow_recompute=False, recompute="layer")


def test_the_simulators_cost_table_of_a_candidate_carries_the_recomputed_forwards():
    # `pipectl simulate`'s table (`stage_costs_for`) of a checkpointing candidate: each backward is
    # the plain one plus the stage's forward (no engine terms here, so no per-micro-batch overhead).
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1])
    cluster = load_cluster("a100-8x8")
    result = plan(profile, cluster, PlanRequest(global_batch=8, devices=2, pipeline_parallel=2, morph=False,
                                                 include_all=True, recompute=RecomputeChoice.LAYER))  # fmt: skip
    layered = [c for c in result.candidates if c.checkpoint_layers]
    assert layered
    for candidate in layered[:3]:
        costs = stage_costs_for(candidate, profile, cluster)
        plain = stage_costs_for(candidate.model_copy(update={"checkpoint_layers": False}), profile, cluster)
        extra = [b - a for a, b in zip(plain.backward_seconds, costs.backward_seconds)]
        # The first stage's whole forward; the last stage's but the head's.
        assert extra[0] == pytest.approx(plain.forward_seconds[0], rel=1e-9)
        assert 0 < extra[-1] < plain.forward_seconds[-1]
        seconds = ShapeBuilder(profile, hardware_for(cluster, profile)).seconds(candidate.micro_batch_size, 1)
        assert extra == pytest.approx([seconds.recomputed_forward(*stage) for stage in candidate.stage_layers], rel=1e-9)
        assert costs.forward_seconds == plain.forward_seconds
