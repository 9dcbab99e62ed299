"""The planner's terms for another engine's features (`EngineFeatures`, `ModelProfile.engine`):
sequence-parallel and vocabulary-parallel collectives, tensor-parallel and data-parallel overlap,
and the plan-only marking of what pipectl's runtimes cannot run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipectl.artifacts.model import ModelConfig
from pipectl.artifacts.plan import PlanRequest
from pipectl.artifacts.profile import EngineFeatures
from pipectl.artifacts.cluster import ClusterSpec
from pipectl.cluster import LinkCost
from pipectl.errors import PipectlError, UserInputError
from pipectl.plan.costs import exposed_tensor_parallel_seconds, hardware_for, layer_seconds, tensor_parallel_communication
from pipectl.plan.cost_table import overlapped_data_parallel_seconds, stage_costs
from pipectl.plan.placement import tensor_parallel_link
from pipectl.plan.layer_table import layer_table
from pipectl.plan.search import plan
from pipectl.profile.derive import derive_profile

GPT = ModelConfig(name="g", family="gpt", shape_only=True, layers=8, hidden=4096, heads=32, seq_len=2048,
                  vocab=51200, tied_embeddings=False)
LINK = LinkCost(2e-6, 200e9)


def _cluster(nodes: int = 4) -> ClusterSpec:
    return ClusterSpec(name="h", node_types=[{"name": "n", "device": "h100-80gb", "devices_per_node": 8, "nodes": nodes}])


def test_sequence_parallel_collectives_take_the_all_reduces_time():
    """All-gather + reduce-scatter of the whole b s h = one ring all-reduce of it; the table holds
    the s/t shard a rank keeps, so the message is t times that."""
    plain = derive_profile(GPT, "h100-80gb", [1])
    sp = derive_profile(GPT, "h100-80gb", [1], engine=EngineFeatures(name="e", sequence_parallel=True))
    t = 8
    whole = tensor_parallel_communication(layer_table(plain, 1, t), LINK, t)
    split = tensor_parallel_communication(layer_table(sp, 1, t), LINK, t, sp.engine)
    block = 1
    assert split[0][block] == pytest.approx(whole[0][block]) and split[1][block] == pytest.approx(whole[1][block])
    one = LINK.ring_allreduce_seconds(2048 * 4096 * 2, t)
    assert whole[0][block] == pytest.approx(2 * one) and whole[1][block] == pytest.approx(2 * one)
    assert whole[0][0] == 0.0 and whole[1][-1] == 0.0  # a replicated embedding and head: none


def test_vocab_parallel_adds_one_all_reduce_to_embedding_forward_and_head_backward():
    vp = derive_profile(GPT, "h100-80gb", [1], engine=EngineFeatures(name="e", vocab_parallel=True))
    forward, backward = tensor_parallel_communication(layer_table(vp, 1, 4), LINK, 4, vp.engine)
    one = LINK.ring_allreduce_seconds(2048 * 4096 * 2, 4)
    assert forward[0] == pytest.approx(one) and backward[0] == 0.0
    assert backward[-1] == pytest.approx(one) and forward[-1] == 0.0


# Compute beside a collective runs 18.9 % slower (arXiv 2507.03114): a collective of C seconds
# hidden whole behind its compute still adds C x 0.189 / 1.189.
HIDDEN_SHARE = 0.189 / 1.189


SEQUENCE_PARALLEL = EngineFeatures(name="e", sequence_parallel=True)


def _sequence_parallel_seconds(t: int):
    """(table, hardware, layer seconds without overlap, with tensor-parallel overlap asked for) of
    the sequence-parallel GPT at tensor-parallel degree t on 8-GPU H100 nodes."""
    overlap = SEQUENCE_PARALLEL.model_copy(update={"tensor_parallel_overlap": True})
    profile = derive_profile(GPT, "h100-80gb", [1], engine=SEQUENCE_PARALLEL)
    table = layer_table(profile, 1, t)
    hardware = hardware_for(_cluster(), profile)
    return table, hardware, layer_seconds(table, hardware, t), layer_seconds(table, replace(hardware, features=overlap), t)


def test_tensor_parallel_overlap_exposes_what_outlasts_the_compute_or_what_the_compute_loses():
    assert exposed_tensor_parallel_seconds(0.003, 0.01, overlapped=False) == 0.003
    assert exposed_tensor_parallel_seconds(0.003, 0.01, overlapped=True) == pytest.approx(0.003 * HIDDEN_SHARE)
    assert exposed_tensor_parallel_seconds(0.013, 0.01, overlapped=True) == pytest.approx(0.003)
    table, hardware, exposed, hidden = _sequence_parallel_seconds(8)
    forward_comm, _ = tensor_parallel_communication(table, hardware.links.allreduce_intra, 8, SEQUENCE_PARALLEL)
    assert forward_comm[1] < table.forward_seconds[1]  # hidden whole: only the contention shows
    assert exposed.forward[1] - hidden.forward[1] == pytest.approx(forward_comm[1] * (1 - HIDDEN_SHARE))
    assert hidden.forward[1] == pytest.approx(table.forward_seconds[1] + forward_comm[1] * HIDDEN_SHARE)


def test_tensor_parallel_overlap_stays_inside_a_node():
    # Transformer Engine's Userbuffers overlap needs the tensor group in one NVLink domain: a t = 16
    # group over two 8-GPU nodes pays its collectives whole, overlap asked for or not.
    table, hardware, exposed, asked = _sequence_parallel_seconds(16)
    assert asked.forward == exposed.forward and asked.backward == exposed.backward
    link = tensor_parallel_link(hardware.links, 16, 8)  # the spanning ring, over both nodes' NICs
    ring = tensor_parallel_communication(table, link, 16, SEQUENCE_PARALLEL)[0][1]
    assert ring > 0 and exposed.forward[1] == pytest.approx(table.forward_seconds[1] + ring)


def test_overlapped_data_parallel_arithmetic():
    # Reduce-scatter 0.3 s (last bucket 0.01 s) behind a 0.2 s backward: the last bucket + the 0.09 s
    # the other 0.29 s outlast it; the gather hidden behind a 0.5 s forward, less what it slows.
    assert overlapped_data_parallel_seconds(0.3, 0.3, 0.01, 0.2, 0.5, gather_overlapped=True) == pytest.approx(
        0.01 + 0.09 + 0.3 * HIDDEN_SHARE)
    # Hidden behind a 1 s backward: the last bucket + what the backward loses; the gather whole
    # without its overlap.
    assert overlapped_data_parallel_seconds(0.3, 0.3, 0.05, 1.0, 0.5, gather_overlapped=False) == pytest.approx(
        0.05 + 0.25 * HIDDEN_SHARE + 0.3)


def test_gradient_overlap_hides_the_reduction_behind_the_last_backward():
    profile = derive_profile(GPT, "h100-80gb", [1, 4])
    cut = [(0, len(profile.layers))]
    hardware = hardware_for(_cluster(), profile)
    features = EngineFeatures(name="e", gradient_reduce_overlap=True, parameter_gather_overlap=True)
    plain = stage_costs(profile, hardware, cut, micro_batch_size=4, tensor_parallel=1, data_parallel=32, zero_stage=1)
    overlapped = stage_costs(profile, replace(hardware, features=features), cut, micro_batch_size=4,
                             tensor_parallel=1, data_parallel=32, zero_stage=1)
    ring = hardware.links.allreduce_inter
    held = sum(layer.parameter_count for layer in profile.layers)
    assert plain.allreduce_seconds[0] == pytest.approx(ring.ring_allreduce_seconds(held * 2, 32))
    bucket = ring.ring_allreduce_seconds(40e6 * 2, 32) / 2
    half = plain.allreduce_seconds[0] / 2  # the reduce-scatter, and the all-gather
    expected = bucket + max(half - bucket - plain.backward_seconds[0], (half - bucket) * HIDDEN_SHARE) + max(
        half - plain.forward_seconds[0], half * HIDDEN_SHARE)
    assert overlapped.allreduce_seconds[0] == pytest.approx(expected)
    assert overlapped.allreduce_seconds[0] < plain.allreduce_seconds[0]


FP32_GRADIENTS = EngineFeatures(name="megatron-core", gradients_reduced_in_fp32=True)


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_gradients_reduced_in_fp32_move_four_bytes_and_the_parameters_two(zero_stage):
    """Megatron with bf16 all-reduces (ZeRO-0) or reduce-scatters (its distributed optimizer)
    fp32 gradients; the distributed optimizer all-gathers the bf16 parameters."""
    profile = derive_profile(GPT, "h100-80gb", [1])
    cut = [(0, len(profile.layers))]
    hardware = hardware_for(_cluster(), profile)
    d = 32
    ring = hardware.links.allreduce_inter
    held = sum(layer.parameter_count for layer in profile.layers)
    plain = stage_costs(profile, hardware, cut, micro_batch_size=1, tensor_parallel=1, data_parallel=d,
                        zero_stage=zero_stage)
    fp32 = stage_costs(profile, replace(hardware, features=FP32_GRADIENTS), cut, micro_batch_size=1,
                       tensor_parallel=1, data_parallel=d, zero_stage=zero_stage)
    assert plain.allreduce_seconds[0] == pytest.approx(ring.ring_allreduce_seconds(held * 2, d))
    if zero_stage == 0:
        expected = ring.ring_allreduce_seconds(held * 4, d)
    else:
        expected = ring.ring_allreduce_seconds(held * 4, d) / 2 + ring.ring_allreduce_seconds(held * 2, d) / 2
    assert fp32.allreduce_seconds[0] == pytest.approx(expected)
    assert fp32.forward_seconds == plain.forward_seconds and fp32.optimizer_seconds == plain.optimizer_seconds


def test_gradients_reduced_in_fp32_double_zero2_scatters_not_zero3_gathers():
    from pipectl.plan.cost_table import sharded_exposed_seconds

    link = LinkCost(5e-6, 25e9)
    layer_bytes, forward, backward = [1e9, 1e9], [0.01, 0.01], [0.02, 0.02]
    scatter = link.ring_allreduce_seconds(2e9, 8) / 2
    assert sharded_exposed_seconds(layer_bytes, forward, backward, link, 8, 2, gradient_scale=2.0) == (
        pytest.approx(2 * scatter))
    gather = link.ring_allreduce_seconds(1e9, 8) / 2
    # ZeRO-3 (the module docstring's formula): gather(0) + max(gather(1) - forward(0)) forward;
    # scatter(0) + gather(1) + max(scatter(1) - backward(0)) + max(gather(0) - backward(1)) backward.
    expected = gather + (gather - 0.01) + scatter + gather + (scatter - 0.02) + (gather - 0.02)
    assert sharded_exposed_seconds(layer_bytes, forward, backward, link, 8, 3, gradient_scale=2.0) == (
        pytest.approx(expected))


def test_fp32_gradient_buffers_hold_four_bytes_a_parameter():
    from pipectl.plan.memory import state_bytes_per_parameter, state_dtype, step_bytes_per_parameter

    held = state_dtype("bfloat16", FP32_GRADIENTS)
    assert state_bytes_per_parameter(held, 1, 4) == 2 + 4 + 12 / 4
    assert step_bytes_per_parameter(held, 1, 4) == 2 + 4 + (12 + 4) / 4  # no fp32 copy at the step
    assert state_dtype("float32", FP32_GRADIENTS) == "float32" and state_dtype("bfloat16", None) == "bfloat16"
    request = PlanRequest(global_batch=64, devices=8, tensor_parallel=1, pipeline_parallel=2, data_parallel=4,
                          micro_batch_size=1, morph=False, workers=1, engine="any")
    peaks = [plan(derive_profile(GPT, "h100-80gb", [1], engine=engine), _cluster(1), request).chosen.peak_memory_bytes
             for engine in (EngineFeatures(name="megatron-core"), FP32_GRADIENTS)]
    assert all(fp32 > bf16 for bf16, fp32 in zip(*peaks))


def test_a_profile_with_engine_features_is_planned_for_comparison_only():
    profile = derive_profile(GPT, "h100-80gb", [1, 2], engine=EngineFeatures(name="megatron-core", vocab_parallel=True))
    with pytest.raises(UserInputError, match="megatron-core"):
        plan(profile, _cluster(1), PlanRequest(global_batch=16, devices=8, morph=False, workers=1))
    result = plan(profile, _cluster(1), PlanRequest(global_batch=16, devices=8, morph=False, workers=1, engine="any"))
    assert result.chosen.engine is None
    assert any("megatron-core" in note and "plan and simulate only" in note for note in result.chosen.notes)


def test_the_search_and_the_cost_table_agree_with_every_feature_on():
    """The vectorised search (`spec_costs.data_parallel_costs`) and `cost_table.stage_costs` give one
    step: a plan's prediction re-simulated from its cost table, for an engine profile."""
    engine = EngineFeatures(name="megatron-core", sequence_parallel=True, vocab_parallel=True, fused_elementwise=True,
                            tensor_parallel_overlap=True, gradient_reduce_overlap=True, parameter_gather_overlap=True,
                            gradients_reduced_in_fp32=True)
    _search_agrees_with_the_cost_table(engine)


def test_the_search_and_the_cost_table_agree_on_fp32_gradients_reduced_at_the_end_of_the_step():
    """Without the overlap the search prices the data-parallel ring itself, over every point at once
    (`spec_costs._data_parallel_costs_over`): fp32 gradients there too, and the tied embedding's."""
    tied = GPT.model_copy(update={"tied_embeddings": True})
    _search_agrees_with_the_cost_table(FP32_GRADIENTS, tied)


def _search_agrees_with_the_cost_table(engine: EngineFeatures, model: ModelConfig = GPT) -> None:
    from pipectl.plan.phases import simulated_phases

    profile = derive_profile(model, "h100-80gb", [1, 2], engine=engine)
    cluster = _cluster(4)
    result = plan(profile, cluster, PlanRequest(global_batch=64, devices=32, tensor_parallel=4, pipeline_parallel=2,
                                                morph=False, workers=1, engine="any", include_all=True))
    for candidate in result.candidates[:5]:
        assert candidate.data_parallel > 1
        _, step = simulated_phases(candidate, profile, cluster)
        assert step == pytest.approx(candidate.predicted_step_seconds, rel=1e-9)


def test_uniform_cuts_split_the_blocks_evenly():
    from pipectl.plan.partition import uniform_cuts

    kinds = ["embedding"] + ["transformer_block"] * 8 + ["layer_norm", "lm_head"]
    assert uniform_cuts(kinds, 4) == [(0, 3), (3, 5), (5, 7), (7, 11)]
    # 10 blocks over 4 stages: the inner stages take the two extra ones.
    kinds = ["embedding"] + ["transformer_block"] * 10 + ["layer_norm", "lm_head"]
    assert [end - start for start, end in uniform_cuts(kinds, 4)] == [3, 3, 3, 4]
    assert uniform_cuts(kinds, 11) is None


def test_an_engine_with_uniform_stages_plans_its_even_cut_only():
    engine = EngineFeatures(name="megatron", vocab_parallel=True, uniform_stages=True)
    profile = derive_profile(GPT, "h100-80gb", [1, 2], engine=engine)
    result = plan(profile, _cluster(1), PlanRequest(global_batch=16, devices=8, tensor_parallel=2, pipeline_parallel=4,
                                                    morph=False, workers=1, engine="any", include_all=True))
    for candidate in result.candidates:
        blocks = [sum(1 for i in range(start, end) if profile.layers[i].kind == "transformer_block")
                  for start, end in candidate.stage_layers]
        assert set(blocks) == {8 // (4 * candidate.chunks)}
    # v = 4 would need 16 blocks: only 1 and 2 chunks are planned.
    assert {c.chunks for c in result.candidates} <= {1, 2}
    # More stages than blocks is no matter of memory: refused as what it is, named in the example.
    with pytest.raises(PipectlError) as refused:
        plan(profile, _cluster(2), PlanRequest(global_batch=16, devices=10, tensor_parallel=1, pipeline_parallel=10,
                                               morph=False, workers=1, engine="any", schedule="1f1b"))
    assert "the engine splits its blocks evenly" in refused.value.message, refused.value.message
    assert "8 blocks over p=10 x v=1 stages" in refused.value.message and "memory" not in refused.value.message


def test_an_engine_whose_transfers_block_is_timed_as_rendezvous():
    """DeepSpeed's pipeline engine sends and receives synchronously (`EngineFeatures.blocking_p2p`):
    the profile's hardware times transfers as rendezvous, as gloo's, so a plan can only lose time
    against edge-delay transfers; the search and the re-simulated cost table still agree."""
    from pipectl.plan.phases import simulated_phases

    blocking = derive_profile(GPT, "h100-80gb", [1], engine=EngineFeatures(name="deepspeed", blocking_p2p=True))
    plain = derive_profile(GPT, "h100-80gb", [1])
    cluster = _cluster(2)
    assert hardware_for(cluster, blocking).device.blocking_p2p and not hardware_for(cluster, plain).device.blocking_p2p
    request = PlanRequest(global_batch=16, devices=16, tensor_parallel=1, pipeline_parallel=8, schedule="1f1b",
                          morph=False, workers=1, engine="any")
    slow, fast = plan(blocking, cluster, request).chosen, plan(plain, cluster, request).chosen
    assert slow.predicted_step_seconds > fast.predicted_step_seconds
    _, step = simulated_phases(slow, blocking, cluster)
    assert step == pytest.approx(slow.predicted_step_seconds, rel=1e-9)


def test_an_engine_that_all_reduces_before_its_sharded_step_pays_the_whole_ring_and_the_gather():
    """DeepSpeed's BF16_Optimizer (bf16 at stage 0 under the pipeline engine) all-reduces the
    gradients, then all-gathers each replica's updated shard: a full ring of gradients plus half a
    ring of parameters, where ZeRO-1's reduce-scatter is half a ring."""
    profile = derive_profile(GPT, "h100-80gb", [1])
    cut = [(0, len(profile.layers))]
    hardware = hardware_for(_cluster(), profile)
    d = 32
    ring = hardware.links.allreduce_inter
    held = sum(layer.parameter_count for layer in profile.layers)
    whole = replace(hardware, features=EngineFeatures(name="deepspeed bf16", gradients_all_reduced=True))
    costs = {
        name: stage_costs(profile, chosen, cut, micro_batch_size=1, tensor_parallel=1, data_parallel=d, zero_stage=1)
        for name, chosen in (("scatter", hardware), ("all-reduce", whole))
    }
    half_ring = ring.ring_allreduce_seconds(held * 2, d) / 2
    assert costs["scatter"].allreduce_seconds[0] == pytest.approx(2 * half_ring)
    assert costs["all-reduce"].allreduce_seconds[0] == pytest.approx(3 * half_ring)
    assert costs["all-reduce"].forward_seconds == costs["scatter"].forward_seconds


def test_blocking_launches_add_the_hosts_time_to_every_kernel():
    """CUDA_LAUNCH_BLOCKING=1: the host issues no kernel before the previous one ended, so a phase
    lasts its kernels' time plus one issue each, where it otherwise hides the issues behind the GPU."""
    from pipectl.profile.compute_model import ComputeDevice, Kernel, phase_seconds

    device = ComputeDevice("x", 1e12, 1e12, 1.0, 1.0, 1e-5, 1, 2)
    kernels = [Kernel("a", 0, 0, 1e-3)] * 3
    assert phase_seconds(kernels, device) == pytest.approx(1e-5 + 3e-3)
    assert phase_seconds(kernels, replace(device, launch_blocking=True)) == pytest.approx(3 * (1e-5 + 1e-3))
    plain = derive_profile(GPT, "h100-80gb", [1])
    blocking = derive_profile(GPT, "h100-80gb", [1], engine=EngineFeatures(name="e", launch_blocking=True))
    for layer, slower in zip(plain.layers, blocking.layers):  # the embedding's forward is one kernel
        assert slower.costs[0].forward_seconds >= layer.costs[0].forward_seconds
        assert slower.costs[0].backward_seconds > layer.costs[0].backward_seconds
    block, slower_block = plain.layers[1].costs[0], blocking.layers[1].costs[0]
    assert slower_block.forward_seconds > block.forward_seconds
    assert not EngineFeatures(name="e", launch_blocking=True).runnable_by_pipectl
