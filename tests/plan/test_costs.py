"""Cost tables: interpolation, tensor-parallel charges, placement of links, all-reduce, recompute."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipectl.cluster import load_cluster, local_cluster
from pipectl.plan.costs import hardware_for, layer_seconds, tensor_parallel_communication, tensor_parallel_slowdown
from pipectl.plan.placement import ranks_share_node, replicas_share_node, tensor_parallel_link, tensor_parallel_placeable
from pipectl.plan.cost_table import stage_costs
from pipectl.plan.layer_table import interpolate, layer_table
from pipectl.plan.simulate import simulate
from pipectl.testing.profiles import synthetic_profile
from pipectl.schedule import ScheduleKind, generate


def test_interpolation_between_and_beyond_profiled_sizes():
    points = [(1, 2.0), (4, 5.0), (8, 13.0)]
    assert interpolate(points, 2) == pytest.approx(3.0)
    assert interpolate(points, 6) == pytest.approx(9.0)
    assert interpolate(points, 16) == pytest.approx(29.0)  # slope of the last two
    assert interpolate(points, 0.5) == pytest.approx(1.0)  # proportional below the first


def test_profile_times_are_used_on_their_own_device():
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2], device="a100-80gb")
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    assert hardware.compute_scale == 1.0
    costs = stage_costs(profile, hardware, [(0, 7)], micro_batch_size=2, tensor_parallel=1, data_parallel=1)
    table = layer_table(profile, 2)
    assert costs.forward_seconds[0] == pytest.approx(sum(table.forward_seconds))
    assert costs.backward_seconds[0] == pytest.approx(sum(table.backward_seconds))
    assert costs.recompute_seconds == costs.forward_seconds  # recompute = one more forward


def test_other_device_scales_by_peak_flops():
    profile = synthetic_profile(blocks=2, micro_batch_sizes=[1], device="v100-16gb")
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    assert hardware.compute_scale == pytest.approx(125 / 312)


def test_tensor_parallel_divides_compute_and_adds_two_allreduces_each_way():
    profile = synthetic_profile(blocks=2, micro_batch_sizes=[8], device="a100-80gb")
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    table = layer_table(profile, 8)
    one = layer_seconds(table, hardware, 1)
    four = layer_seconds(table, hardware, 4)
    slowdown = tensor_parallel_slowdown(hardware.device, 8, 4)
    assert slowdown > 1
    block = 1
    ring = hardware.links.allreduce_intra.ring_allreduce_seconds(table.output_activation_bytes[block], 4)
    # A collective takes at least the host's time to issue it, as a kernel does.
    collective = max(ring, hardware.device.kernel_overhead_us * 1e-6)
    assert four.forward[block] == pytest.approx(one.forward[block] / 4 * slowdown + 2 * collective)
    assert four.backward[block] == pytest.approx(one.backward[block] / 4 * slowdown + 2 * collective)
    # The embedding is not a block: no tensor-parallel all-reduce charged.
    assert four.forward[0] == pytest.approx(one.forward[0] / 4 * slowdown)


def test_tensor_group_spanning_two_nodes_is_priced_on_their_inter_node_links():
    # a100-8x8: NVLink 3 µs, 300 GB/s (collectives at NCCL's 230); InfiniBand 5 µs, 25 GB/s per GPU, 8 GPUs a node.
    profile = synthetic_profile(blocks=2, micro_batch_sizes=[8], device="a100-80gb")
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    table = layer_table(profile, 8)
    block = 1
    assert table.output_activation_bytes[block] == 64 * 32 * 8 * 2  # h s b x 2 bytes = 32768
    # One ring over 16 GPUs: 2(t - 1) steps of 5 µs + M/t over the node's 8 NICs (8 x 25 GB/s).
    spanning = 2 * 15 * (5e-6 + 32768 / 16 / (8 * 25e9))
    inside = 2 * 7 * (3e-6 + 32768 / 8 / 230e9)
    assert spanning == pytest.approx(1.503072e-4)
    one, eight, sixteen = (layer_seconds(table, hardware, t) for t in (1, 8, 16))
    for t, seconds, ring in ((8, eight, inside), (16, sixteen, spanning)):
        slowdown = tensor_parallel_slowdown(hardware.device, 8, t)
        assert seconds.forward[block] == pytest.approx(one.forward[block] / t * slowdown + 2 * ring)
        assert seconds.backward[block] == pytest.approx(one.backward[block] / t * slowdown + 2 * ring)
    link = tensor_parallel_link(hardware.links, 16, 8)
    assert (link.latency_seconds, link.bandwidth_bytes_per_second) == pytest.approx((5e-6, 200e9))
    assert tensor_parallel_link(hardware.links, 8, 8) == hardware.links.allreduce_intra


def test_tensor_group_link_is_never_faster_than_the_node_itself():
    # One device per node: its own NIC; many slow NICs: the node's own collective bandwidth (NCCL's
    # 230 GB/s over NVLink) is the slower link of the ring.
    profile = synthetic_profile(blocks=1, micro_batch_sizes=[1], device="a100-80gb")
    links = hardware_for(load_cluster("a100-8x8"), profile).links
    assert tensor_parallel_link(links, 2, 1).bandwidth_bytes_per_second == pytest.approx(25e9)
    assert tensor_parallel_link(links, 64, 32).bandwidth_bytes_per_second == pytest.approx(230e9)


def test_tensor_groups_sit_in_a_node_or_span_whole_nodes():
    assert [t for t in range(1, 33) if tensor_parallel_placeable(t, 8)] == [1, 2, 4, 8, 16, 24, 32]
    assert [t for t in range(1, 7) if tensor_parallel_placeable(t, 1)] == [1, 2, 3, 4, 5, 6]


def test_stages_and_replicas_of_tensor_groups_spanning_nodes_talk_over_inter_node_links():
    # t = 16 on 8-GPU nodes: every stage has two nodes of its own, so every cut and every
    # data-parallel ring crosses nodes.
    assert not ranks_share_node(0, 1, p=2, t=16, d=2, devices_per_node=8)
    assert not replicas_share_node(0, p=1, t=16, d=2, devices_per_node=8)
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1], device="a100-80gb", tied=False)
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    table = layer_table(profile, 1, 16)
    costs = stage_costs(profile, hardware, [(0, 3), (3, 7)], micro_batch_size=1, tensor_parallel=16, data_parallel=2)
    assert costs.send_forward_seconds[0] == pytest.approx(hardware.links.inter.seconds(table.output_activation_bytes[2]))
    gradient_bytes = table.parameters(0, 3) / 16 * 2
    expected = hardware.links.allreduce_inter.ring_allreduce_seconds(gradient_bytes, 2)
    assert costs.allreduce_seconds[0] == pytest.approx(expected)


def test_placement_tensor_groups_then_stages_then_replicas():
    # 8 devices per node, t=2, p=4: one pipeline fills a node; replicas go to other nodes.
    assert ranks_share_node(0, 3, p=4, t=2, d=2, devices_per_node=8)
    assert not replicas_share_node(0, p=4, t=2, d=2, devices_per_node=8)
    # t=2, p=8: a pipeline spans two nodes; the cut between rank 3 and 4 crosses.
    assert ranks_share_node(2, 3, p=8, t=2, d=1, devices_per_node=8)
    assert not ranks_share_node(3, 4, p=8, t=2, d=1, devices_per_node=8)
    # Two replicas of a 2-device pipeline fit in one node.
    assert replicas_share_node(1, p=2, t=1, d=2, devices_per_node=8)


def test_p2p_over_inter_node_links_when_the_cut_crosses_nodes():
    profile = synthetic_profile(blocks=14, micro_batch_sizes=[1], device="a100-80gb")
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    stages = [(0, 2)] + [(i, i + 1) for i in range(2, 16)] + [(16, 17)]
    assert len(stages) == 16
    costs = stage_costs(profile, hardware, stages, micro_batch_size=1, tensor_parallel=1, data_parallel=1)
    table = layer_table(profile, 1)
    intra = hardware.links.intra.seconds(table.output_activation_bytes[1])
    inter = hardware.links.inter.seconds(table.output_activation_bytes[8])
    assert costs.send_forward_seconds[0] == pytest.approx(intra)
    assert costs.send_forward_seconds[7] == pytest.approx(inter)  # rank 7 -> 8: next node
    assert inter > intra


def test_data_parallel_allreduce_and_zero_optimizer():
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1], device="a100-80gb", tied=False)
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    table = layer_table(profile, 1)
    single = stage_costs(profile, hardware, [(0, 7)], micro_batch_size=1, tensor_parallel=1, data_parallel=1)
    assert single.allreduce_seconds == (0.0,)
    eight = stage_costs(profile, hardware, [(0, 7)], micro_batch_size=1, tensor_parallel=1, data_parallel=8)
    gradient_bytes = table.parameters(0, 7) * 2  # bf16 gradients
    expected = hardware.links.allreduce_intra.ring_allreduce_seconds(gradient_bytes, 8)
    assert eight.allreduce_seconds[0] == pytest.approx(expected)
    sharded = stage_costs(profile, hardware, [(0, 7)], micro_batch_size=1, tensor_parallel=1, data_parallel=8, zero_stage=1)
    assert sharded.optimizer_seconds[0] == pytest.approx(eight.optimizer_seconds[0] / 8)


def test_fp16_optimizer_step_adds_loss_scaling_passes_over_the_gradients():
    # DeepSpeed's fp16 step: overflow check, flatten, fp32 cast, norm, unscale, Adam, copy back.
    bf16 = synthetic_profile(blocks=4, micro_batch_sizes=[1], device="a100-80gb", tied=False)
    fp16 = bf16.model_copy(update={"dtype": "float16"})
    cluster = load_cluster("a100-8x8")
    seconds = {}
    for name, profile in (("bf16", bf16), ("fp16", fp16)):
        hardware = hardware_for(cluster, profile)
        assert hardware.loss_scaled is (name == "fp16")
        costs = stage_costs(profile, hardware, [(0, 7)], micro_batch_size=1, tensor_parallel=1, data_parallel=8,
                            zero_stage=1)
        seconds[name] = costs.optimizer_seconds[0]
    parameters = layer_table(bf16, 1).parameters(0, 7) / 8
    bandwidth = hardware.device.memory_bandwidth_gbytes_per_second * 1e9
    assert seconds["bf16"] == pytest.approx(parameters * 28 / bandwidth)
    assert seconds["fp16"] == pytest.approx(parameters * 66 / bandwidth)


def test_a_small_tensor_parallel_collective_costs_its_issue_on_the_host():
    profile = synthetic_profile(blocks=2, micro_batch_sizes=[1], device="a100-80gb")
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    table = layer_table(profile, 1)
    small = replace(table, output_activation_bytes=tuple(0.0 if b == 0 else 1e3 for b in table.output_activation_bytes))
    ring = hardware.links.allreduce_intra.ring_allreduce_seconds(1e3, 4)
    issue = hardware.device.kernel_overhead_us * 1e-6
    assert ring < issue
    forward, backward = tensor_parallel_communication(small, hardware.links.allreduce_intra, 4, issue_seconds=issue)
    assert forward[1] == pytest.approx(2 * issue) and backward[1] == pytest.approx(2 * issue)
    forward, _ = tensor_parallel_communication(small, hardware.links.allreduce_intra, 4)
    assert forward[1] == pytest.approx(2 * ring)


def test_tied_embedding_gradients_are_all_reduced_between_first_and_last_stage():
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1], device="cpu")
    hardware = hardware_for(local_cluster(2), profile)
    costs = stage_costs(profile, hardware, [(0, 3), (3, 7)], micro_batch_size=1, tensor_parallel=1, data_parallel=1)
    assert costs.allreduce_seconds[0] > 0 and costs.allreduce_seconds[1] > 0
    untied = synthetic_profile(blocks=4, micro_batch_sizes=[1], device="cpu", tied=False)
    costs = stage_costs(untied, hardware_for(local_cluster(2), untied), [(0, 3), (3, 7)],
                        micro_batch_size=1, tensor_parallel=1, data_parallel=1)
    assert costs.allreduce_seconds == (0.0, 0.0)


def test_recompute_costs_one_more_forward_in_the_simulated_step():
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1], device="cpu", edge_forward_seconds=0.0)
    hardware = hardware_for(local_cluster(2), profile)
    costs = stage_costs(profile, hardware, [(0, 3), (3, 7)], micro_batch_size=1, tensor_parallel=1, data_parallel=1)
    plain = simulate(generate(ScheduleKind.GPIPE, 2, 4), costs)
    recomputed = simulate(generate(ScheduleKind.GPIPE, 2, 4, recompute=True), costs)
    # Stage 0 (not last) recomputes 4 micro-batches; the first hides in the wait for stage 1's
    # backward, the other 3 add to the step.
    extra = recomputed.step_seconds - plain.step_seconds
    assert 3 * costs.forward_seconds[0] * 0.999 <= extra <= 4 * costs.forward_seconds[0] * 1.001


@pytest.mark.parametrize("cluster_name, devices, batch", [("a100-8x8", 16, 64), ("local", 4, 16)])
def test_stage_costs_for_reproduces_the_plans_prediction(cluster_name, devices, batch):
    from pipectl.plan.cost_table import stage_costs_for
    from pipectl.artifacts.plan import PlanRequest
    from pipectl.plan.search import plan

    profile = synthetic_profile(blocks=6, micro_batch_sizes=[1, 2, 4], device="a100-80gb" if cluster_name != "local" else "cpu")
    cluster = load_cluster(cluster_name) if cluster_name != "local" else local_cluster(devices)
    result = plan(profile, cluster, PlanRequest(global_batch=batch, devices=devices, include_all=True, morph=False))
    for candidate in result.candidates[:8]:
        costs = stage_costs_for(candidate, profile, cluster)
        schedule = generate(candidate.schedule, candidate.pipeline_parallel, candidate.micro_batches,
                            candidate.chunks, candidate.recompute)
        assert simulate(schedule, costs).step_seconds == pytest.approx(candidate.predicted_step_seconds, rel=1e-9)


# --- measured engine terms (profile.runtime) ---------------------------------------------------


def _runtime(**overrides):
    from pipectl.artifacts.profile import EngineComputeRatio, RuntimeCosts

    values = dict(
        engine="test engine",
        forward_overhead_seconds=0.001,
        backward_overhead_seconds=0.002,
        step_fixed_seconds=0.004,
        step_seconds_per_parameter=1e-8,
        compute_ratios=[
            EngineComputeRatio(micro_batch_size=1, forward_ratio=1.5, backward_ratio=1.25),
            EngineComputeRatio(micro_batch_size=2, forward_ratio=1.5, backward_ratio=1.25),
        ],
    )
    values.update(overrides)
    return RuntimeCosts(**values)


def _cpu_profile_with_runtime(**overrides):
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2], device="cpu", dtype="float32")
    return profile.model_copy(update={"runtime": _runtime(**overrides)})


def test_runtime_terms_apply_only_on_the_device_they_were_measured_on():
    profile = _cpu_profile_with_runtime()
    assert hardware_for(local_cluster(2), profile).runtime is profile.runtime
    assert hardware_for(load_cluster("a100-8x8"), profile).runtime is None


def test_engine_ratio_and_overhead_enter_every_stage_per_micro_batch():
    profile = _cpu_profile_with_runtime()
    plain = profile.model_copy(update={"runtime": None})
    cuts = [(0, 3), (3, 7)]
    with_terms = stage_costs(profile, hardware_for(local_cluster(2), profile), cuts,
                             micro_batch_size=2, tensor_parallel=1, data_parallel=1)  # fmt: skip
    without = stage_costs(plain, hardware_for(local_cluster(2), plain), cuts,
                          micro_batch_size=2, tensor_parallel=1, data_parallel=1)  # fmt: skip
    for stage in range(2):
        assert with_terms.forward_seconds[stage] == pytest.approx(1.5 * without.forward_seconds[stage] + 0.001)
        assert with_terms.backward_seconds[stage] == pytest.approx(1.25 * without.backward_seconds[stage] + 0.002)
    assert with_terms.recompute_seconds == with_terms.forward_seconds  # R re-runs the engine's forward


def test_engine_end_of_step_replaces_the_bandwidth_estimate_of_adam():
    profile = _cpu_profile_with_runtime()
    hardware = hardware_for(local_cluster(2), profile)
    table = layer_table(profile, 2)
    costs = stage_costs(profile, hardware, [(0, 3), (3, 7)], micro_batch_size=2, tensor_parallel=1, data_parallel=1)
    for rank, (start, end) in enumerate([(0, 3), (3, 7)]):
        held = table.parameters(start, end)
        assert costs.optimizer_seconds[rank] == pytest.approx(0.004 + 1e-8 * held)


def test_engine_collectives_with_data_and_pipeline_parallelism():
    from pipectl.plan.cost_table import SMALL_COLLECTIVE_BYTES, SMALL_COLLECTIVES_PER_DATA_PARALLEL_GROUP, SMALL_COLLECTIVES_PER_PIPELINE, data_parallel_seconds

    profile = _cpu_profile_with_runtime()
    hardware = hardware_for(local_cluster(4), profile)
    ring = hardware.links.allreduce_intra
    held = [1e5, 2e5]
    allreduce, optimizer = data_parallel_seconds(
        held, hardware, pipeline_parallel=2, tensor_parallel=1, data_parallel=2, zero_stage=1, element_bytes=4
    )
    small_d = ring.ring_allreduce_seconds(SMALL_COLLECTIVE_BYTES, 2)
    for rank in range(2):
        gradient = ring.ring_allreduce_seconds(held[rank] * 4, 2)
        expected = 1.5 * gradient + (SMALL_COLLECTIVES_PER_DATA_PARALLEL_GROUP + SMALL_COLLECTIVES_PER_PIPELINE) * small_d
        assert allreduce[rank] == pytest.approx(expected)
        assert optimizer[rank] == pytest.approx(0.004 + 1e-8 * held[rank])
    # One rank: nothing to communicate, only the engine's own end of step.
    alone, _ = data_parallel_seconds(
        [1e5], hardware, pipeline_parallel=1, tensor_parallel=1, data_parallel=1, zero_stage=1, element_bytes=4
    )
    assert alone == [0.0]


def test_one_rank_step_is_micro_batches_times_engine_work_plus_end_of_step():
    # p = d = 1: the simulated step is m x (ratio x layers + overhead, forward and backward) plus the
    # measured end of step: the calibration's own decomposition, recomposed.
    profile = _cpu_profile_with_runtime()
    hardware = hardware_for(local_cluster(1), profile)
    table = layer_table(profile, 2)
    costs = stage_costs(profile, hardware, [(0, 7)], micro_batch_size=2, tensor_parallel=1, data_parallel=1)
    m = 4
    step = simulate(generate(ScheduleKind.ONE_F_ONE_B, 1, m), costs).step_seconds
    per_micro_batch = 1.5 * sum(table.forward_seconds) + 0.001 + 1.25 * sum(table.backward_seconds) + 0.002
    assert step == pytest.approx(m * per_micro_batch + 0.004 + 1e-8 * table.parameters(0, 7))


def test_engine_ratio_is_flat_beyond_the_measured_sizes():
    from pipectl.artifacts.profile import EngineComputeRatio
    from pipectl.plan.costs import engine_compute_ratios

    runtime = _runtime(compute_ratios=[
        EngineComputeRatio(micro_batch_size=2, forward_ratio=1.2, backward_ratio=1.0),
        EngineComputeRatio(micro_batch_size=8, forward_ratio=1.8, backward_ratio=1.6),
    ])  # fmt: skip
    assert engine_compute_ratios(runtime, 1) == (1.2, 1.0)
    assert engine_compute_ratios(runtime, 4) == pytest.approx((1.4, 1.2))
    assert engine_compute_ratios(runtime, 32) == (1.8, 1.6)
    assert engine_compute_ratios(None, 4) == (1.0, 1.0)


def test_busy_handoff_raises_the_intra_node_latency_and_each_collective():
    from pipectl.plan.cost_table import data_parallel_seconds

    slow = _cpu_profile_with_runtime(busy_handoff_seconds=0.003)
    fast = _cpu_profile_with_runtime(busy_handoff_seconds=1e-6)
    catalog_latency = hardware_for(local_cluster(2), fast).links.intra_latency_seconds
    assert catalog_latency > 1e-6  # a handoff below the link latency changes nothing
    hardware = hardware_for(local_cluster(2), slow)
    assert hardware.links.intra_latency_seconds == 0.003
    assert hardware.links.intra.seconds(0) == 0.003
    assert hardware.links.allreduce_intra_latency_seconds == hardware_for(local_cluster(2), fast).links.allreduce_intra_latency_seconds
    # d = 2, p = 1: gradient all-reduce, parameter all-gather and the two small all-reduces each wait one handoff.
    with_handoff, _ = data_parallel_seconds([1e5], hardware, pipeline_parallel=1, tensor_parallel=1,
                                            data_parallel=2, zero_stage=1, element_bytes=4)  # fmt: skip
    plain = hardware_for(local_cluster(2), _cpu_profile_with_runtime())
    without, _ = data_parallel_seconds([1e5], plain, pipeline_parallel=1, tensor_parallel=1,
                                       data_parallel=2, zero_stage=1, element_bytes=4)  # fmt: skip
    assert with_handoff[0] - without[0] == pytest.approx(4 * 0.003)


def test_busy_allreduce_fit_prices_intra_node_collectives_without_a_separate_handoff():
    from pipectl.plan.cost_table import data_parallel_seconds

    measured = _cpu_profile_with_runtime(
        busy_handoff_seconds=0.003, busy_allreduce_latency_seconds=0.0005,
        busy_allreduce_bandwidth_bytes_per_second=5e8,
    )  # fmt: skip
    hardware = hardware_for(local_cluster(2), measured)
    links = hardware.links
    assert (links.allreduce_intra_latency_seconds, links.allreduce_intra_bandwidth_bytes_per_second) == (0.0005, 5e8)
    assert links.sources["allreduce_intra"] == "profile runtime (busy all-reduce)"
    assert links.intra_latency_seconds == 0.003  # p2p still waits the busy handoff
    seconds, _ = data_parallel_seconds([1e5], hardware, pipeline_parallel=1, tensor_parallel=1,
                                       data_parallel=2, zero_stage=1, element_bytes=4)  # fmt: skip
    # d = 2 ring: gradient all-reduce + half of one for the parameter all-gather + two 8-byte
    # all-reduces, each 2 (alpha + bytes / 2 / bw), and no handoff on top.
    ring = lambda nbytes: 2 * (0.0005 + nbytes / 2 / 5e8)  # noqa: E731
    assert seconds[0] == pytest.approx(ring(4e5) + ring(4e5) / 2 + 2 * ring(8))


def test_host_slowdown_is_the_one_rank_or_the_two_rank_figure():
    profile = _cpu_profile_with_runtime(alone_compute_slowdown=1.2, concurrent_compute_slowdown=1.5, concurrent_ranks=2)
    plain = _cpu_profile_with_runtime()

    def costs(which, devices, d):
        return stage_costs(which, hardware_for(local_cluster(devices), which), [(0, 7)],
                           micro_batch_size=2, tensor_parallel=1, data_parallel=d)  # fmt: skip

    one_rank, one_plain = costs(profile, 1, 1), costs(plain, 1, 1)
    assert one_rank.forward_seconds[0] == pytest.approx(1.2 * one_plain.forward_seconds[0])
    two, two_plain = costs(profile, 2, 2), costs(plain, 2, 2)
    assert two.forward_seconds[0] == pytest.approx(1.5 * two_plain.forward_seconds[0])
    assert two.backward_seconds[0] == pytest.approx(1.5 * two_plain.backward_seconds[0])
    assert two.optimizer_seconds[0] == pytest.approx(1.5 * two_plain.optimizer_seconds[0])
    # One rank of a two-device pool still has the host to itself.
    assert costs(profile, 2, 1).forward_seconds == one_rank.forward_seconds


def test_more_ranks_than_cores_share_them():
    # Measured: two ranks at once on a 2-core host compute 1.5x slower than one alone.
    profile = _cpu_profile_with_runtime(concurrent_compute_slowdown=1.5, concurrent_ranks=2, host_cores=2)
    unknown_cores = _cpu_profile_with_runtime(concurrent_compute_slowdown=1.5, concurrent_ranks=2)
    plain = _cpu_profile_with_runtime()

    def forward(which, devices, d):
        costs = stage_costs(which, hardware_for(local_cluster(devices), which), [(0, 7)],
                            micro_batch_size=2, tensor_parallel=1, data_parallel=d)  # fmt: skip
        return costs.forward_seconds[0]

    base = forward(plain, 4, 4)
    assert forward(profile, 2, 2) == pytest.approx(1.5 * base)
    # Three and four ranks on two cores: 1.5 and 2 times the two-rank figure (each gets 2/3, 1/2 a core).
    assert forward(profile, 3, 3) == pytest.approx(1.5 * 1.5 * base)
    assert forward(profile, 4, 4) == pytest.approx(2.0 * 1.5 * base)
    # A pool of four running two of them: two ranks, two cores.
    assert forward(profile, 4, 2) == pytest.approx(1.5 * base)
    # A profile that did not record its host's cores keeps the two-rank figure.
    assert forward(unknown_cores, 4, 4) == pytest.approx(1.5 * base)


def test_a_plan_for_more_ranks_than_cores_says_why_it_leaves_some_idle():
    from pipectl.artifacts.plan import PlanRequest
    from pipectl.plan.search import plan

    # Compute-bound CPU ranks: four on two cores take twice as long each, so two are chosen.
    profile = _cpu_profile_with_runtime(concurrent_compute_slowdown=1.0, concurrent_ranks=2, host_cores=2)
    result = plan(profile, local_cluster(4), PlanRequest(global_batch=16, workers=1))
    assert result.chosen.devices == 2
    assert "uses 2 of the 4 devices (the host has 2 cores: more ranks than cores share them)" in result.chosen.notes
    # Where the cores are unknown, the four ranks look faster and are taken.
    unknown = _cpu_profile_with_runtime(concurrent_compute_slowdown=1.0, concurrent_ranks=2)
    assert plan(unknown, local_cluster(4), PlanRequest(global_batch=16, workers=1)).chosen.devices == 4


@pytest.mark.parametrize("name", ["pipectl.plan.costs", "pipectl.plan.layer_table"])
def test_docstring_examples_hold(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
