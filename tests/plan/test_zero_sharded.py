"""ZeRO-2 and ZeRO-3 at p = 1: memory per stage, the per-micro-batch collectives and their overlap,
where the search tries them, and how a plan reports them (planned only: the runtime runs ZeRO-1)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from pipectl.artifacts.plan import PlanRequest, Recompute
from pipectl.artifacts.profile import LayerCost, LayerProfile, ModelProfile, ProfileSource
from pipectl.cluster import load_cluster
from pipectl.errors import InfeasibleError
from pipectl.plan.costs import hardware_for
from pipectl.plan.cost_table import stage_costs, stage_costs_for
from pipectl.plan.homogeneous import plan_homogeneous
from pipectl.plan.layer_table import layer_table
from pipectl.plan.memory import StageMemory, sharded_transient_bytes, state_bytes_per_parameter, step_bytes_per_parameter
from pipectl.plan.search import plan
from pipectl.plan.simulate import simulate
from pipectl.plan.space import enumerate_specs, search_space
from pipectl.testing.profiles import synthetic_profile
from pipectl.schedule import generate

MS = 1e-3


def _layer(index: int, parameters: int, forward: float, saved: int = 4000) -> LayerProfile:
    costs = [LayerCost(micro_batch_size=1, forward_seconds=forward, backward_seconds=2 * forward,
                       output_activation_bytes=1000, saved_activation_bytes=saved, peak_memory_bytes=4 * parameters)]
    return LayerProfile(index=index, name=f"layer{index}", kind="linear", parameter_count=parameters,
                        parameter_bytes=2 * parameters, costs=costs)


def _two_layers() -> ModelProfile:
    """200 M and 100 M parameters in bf16 (400 and 200 MB), 5 ms forward and 10 ms backward each."""
    return ModelProfile(
        model="toy", source=ProfileSource.DERIVED, device="a100-80gb", dtype="bfloat16", micro_batch_sizes=[1],
        layers=[_layer(0, 200_000_000, 0.005), _layer(1, 100_000_000, 0.005)],
    )


def _large_blocks(count: int, forward: float) -> ModelProfile:
    """`count` transformer blocks of 1.2 B parameters (linears of 300, 100, 400 and 400 M, each
    above DeepSpeed's 5e7-element prefetch bucket), `forward` seconds forward, twice that backward."""
    blocks = [_layer(i, 1_200_000_000, forward).model_copy(update={"kind": "transformer_block"}) for i in range(count)]
    return ModelProfile(model="big", source=ProfileSource.DERIVED, device="a100-80gb", dtype="bfloat16",
                        micro_batch_sizes=[1], layers=blocks)  # fmt: skip


def _with_memory(hardware, gib: float):
    device = hardware.device.model_copy(update={"memory_gib": gib, "outside_allocator_gib": 0.0})
    return dataclasses.replace(hardware, device=device)


# --- memory ----------------------------------------------------------------------------------------


def test_bytes_per_parameter_by_stage_against_hand_arithmetic():
    # bf16 + Adam: weights 2, gradients 2, optimizer 12, the step's extra 8, over d = 8.
    held = [state_bytes_per_parameter("bfloat16", zero, 8) for zero in range(4)]
    assert held == pytest.approx([2 + 2 + 12, 2 + 2 + 12 / 8, 2 + (2 + 12) / 8, (2 + 2 + 12) / 8])
    step = [step_bytes_per_parameter("bfloat16", zero, 8) for zero in range(4)]
    assert step == pytest.approx([24, 2 + 2 + 20 / 8, 2 + 22 / 8, 24 / 8])
    # fp32: 4, 4, 8 and 4 for the step.
    assert state_bytes_per_parameter("float32", 2, 4) == pytest.approx(4 + 12 / 4)
    assert step_bytes_per_parameter("float32", 3, 4) == pytest.approx(20 / 4)
    # At d = 1 nothing is sharded, whatever the stage.
    assert {state_bytes_per_parameter("bfloat16", zero, 1) for zero in range(4)} == {16}
    assert {step_bytes_per_parameter("bfloat16", zero, 1) for zero in range(4)} == {24}
    # More sharding never holds more, and the step stays the heavier phase.
    for d in (2, 8, 64):
        at_d = [state_bytes_per_parameter("bfloat16", zero, d) for zero in range(4)]
        assert at_d == sorted(at_d, reverse=True)
        for zero in range(4):
            assert step_bytes_per_parameter("bfloat16", zero, d) > state_bytes_per_parameter("bfloat16", zero, d)


def test_transients_are_the_whole_tensors_of_one_or_two_layers():
    layers = [200e6, 100e6, 300e6, 50e6]
    # ZeRO-2: the largest layer's gradient, whole (2 bytes each).
    assert sharded_transient_bytes(layers, "bfloat16", 2, 8) == 2 * 300e6
    # ZeRO-3: the weights of the largest adjacent pair (100 M + 300 M) and the largest gradient.
    assert sharded_transient_bytes(layers, "bfloat16", 3, 8) == 2 * 400e6 + 2 * 300e6
    assert sharded_transient_bytes(layers, "float32", 3, 8) == 4 * 400e6 + 4 * 300e6
    assert sharded_transient_bytes(layers, "bfloat16", 3, 1) == 0.0  # nothing gathered at d = 1
    assert sharded_transient_bytes(layers, "bfloat16", 1, 8) == 0.0


def test_stage_memory_of_each_stage_against_hand_arithmetic():
    table = layer_table(_two_layers(), 1)
    memory = StageMemory.build(table, [(0, 2)], tensor_parallel=1, recompute=False)
    parameters, saved = 300e6, 8000  # one micro-batch in flight (1F1B at p = 1)
    d = 16
    for zero, training, step, transient in (
        (1, 4 + 12 / d, 4 + 20 / d, 0.0),
        (2, 2 + 14 / d, 2 + 22 / d, 2 * 200e6),
        (3, 16 / d, 24 / d, 2 * 300e6 + 2 * 200e6),
    ):
        got = memory.per_rank_bytes(state_bytes_per_parameter("bfloat16", zero, d),
                                    step_bytes_per_parameter("bfloat16", zero, d), (1,),
                                    sharded_transient_bytes([200e6, 100e6], "bfloat16", zero, d))[0]
        assert got == pytest.approx(max(parameters * training + saved + transient, parameters * step)), zero
    # At d = 16: ZeRO-1 1.575 GB (its step), ZeRO-2 0.99 GB (training), ZeRO-3 1.3 GB (training:
    # two 400 + 200 MB gathers and a 400 MB gradient outweigh the sharded 300 MB).


# --- time ------------------------------------------------------------------------------------------


def _beside(collective: float, compute: float) -> float:
    # What a collective run beside compute adds: what outlasts it, never less than the 18.9 % the
    # compute loses while the collective runs (arXiv 2507.03114), i.e. 0.189 / 1.189 of its time.
    return max(collective - compute, collective * 0.189 / 1.189)


def test_zero3_collectives_on_a_two_layer_toy_against_a_hand_computation():
    profile = _two_layers()
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    # d = 16 spans two nodes: the inter-node ring, 5 µs and 25 GB/s. One gather (or reduce-scatter):
    gather_a = 15 * (5e-6 + 400e6 / 16 / 25e9)  # 15.075 ms
    gather_b = 15 * (5e-6 + 200e6 / 16 / 25e9)  # 7.575 ms
    forward_a = forward_b = 5 * MS
    backward_a = backward_b = 10 * MS
    per_micro_batch = (
        gather_a + _beside(gather_b, forward_a)  # forward: B's gather behind A's forward, 2.575 ms out
        + gather_b  # backward starts with B, gathered anew
        + _beside(gather_a, backward_b)  # A's gather behind B's backward, 5.075 ms out
        + _beside(gather_b, backward_a)  # B's reduce-scatter behind A's backward: hidden, 1.204 ms lost
        + gather_a  # A's reduce-scatter: nothing left to hide it
    )
    assert per_micro_batch == pytest.approx(46.579 * MS, abs=1e-6)
    costs = stage_costs(profile, hardware, [(0, 2)], micro_batch_size=1, tensor_parallel=1, data_parallel=16,
                        zero_stage=3, micro_batches=2)
    assert costs.allreduce_seconds[0] == pytest.approx(2 * per_micro_batch)
    # Per-layer checkpointing: each backward first runs its layer's forward again, which DeepSpeed's
    # hooks gather the weights for and partition after, so the backward gathers them once more; the
    # link has the recomputation's 5 ms more to hide behind in each layer's window.
    window = forward_a + backward_b  # 15 ms
    checkpointed = (
        gather_a + _beside(gather_b, forward_a)  # the forward as before
        + gather_b  # B's gather for its recomputation
        + _beside(gather_a + gather_b, window)  # A's for its recomputation, B's again for its backward: 7.65 ms out
        + _beside(gather_b + gather_a, window)  # B's reduce-scatter, A's gather again: 7.65 ms out
        + gather_a  # A's reduce-scatter
    )
    assert checkpointed == pytest.approx(55.600 * MS, abs=1e-6)
    recomputing = stage_costs(profile, hardware, [(0, 2)], micro_batch_size=1, tensor_parallel=1, data_parallel=16,
                              zero_stage=3, micro_batches=2, checkpoint_layers=True)
    assert recomputing.allreduce_seconds[0] == pytest.approx(2 * checkpointed)
    adam = 300e6 / 16 * 28 / (hardware.device.memory_bandwidth_gbytes_per_second * 1e9)
    assert costs.optimizer_seconds[0] == pytest.approx(adam)
    # One rank: the step is m x (F + B) plus the exposed collectives plus the step.
    step = simulate(generate("1f1b", 1, 2), costs).step_seconds
    assert step == pytest.approx(2 * (forward_a + forward_b + backward_a + backward_b) + 2 * per_micro_batch + adam)
    # ZeRO-3 moves 1.5x an all-reduce per micro-batch: with nothing to hide behind (no compute),
    # 3 halves of a ring all-reduce of the 600 MB per micro-batch, plus the per-layer latencies.
    idle = profile.model_copy(update={"layers": [_layer(0, 200_000_000, 0.0), _layer(1, 100_000_000, 0.0)]})
    idle_costs = stage_costs(idle, hardware, [(0, 2)], micro_batch_size=1, tensor_parallel=1, data_parallel=16,
                             zero_stage=3, micro_batches=1)
    assert idle_costs.allreduce_seconds[0] == pytest.approx(3 * (gather_a + gather_b))


def test_zero3_gathers_a_large_block_one_linear_ahead():
    # DeepSpeed prefetches whole parameters up to its 5e7-element bucket: a block of 1.2 B
    # parameters (linears of 300, 100, 400 and 400 M) is gathered one linear ahead, so fc1's
    # 400 M gather hides behind proj's compute only. 12 ms forward, 24 ms backward; d = 16 over
    # two nodes (5 µs, 25 GB/s): one gather of x M bf16 parameters takes 15 x (5 µs + 2x MB / 16 / 25 GB/s).
    profile = _large_blocks(1, 0.012)
    hardware = hardware_for(load_cluster("a100-8x8"), profile)

    def gather(millions: float) -> float:
        return 15 * (5e-6 + 2 * millions * 1e6 / 16 / 25e9)

    sizes, forward, backward = (300, 100, 400, 400), (3 * MS, 1 * MS, 4 * MS, 4 * MS), (6 * MS, 2 * MS, 8 * MS, 8 * MS)
    exposed = gather(sizes[0]) + sum(_beside(gather(sizes[k]), forward[k - 1]) for k in range(1, 4))  # forward
    exposed += gather(sizes[3])  # the backward starts with fc2, gathered anew
    for j in range(4):  # during linear j's backward: gather j - 1, reduce-scatter j + 1
        on_link = (gather(sizes[j + 1]) if j + 1 < 4 else 0.0) + (gather(sizes[j - 1]) if j > 0 else 0.0)
        exposed += _beside(on_link, backward[j])
    exposed += gather(sizes[0])  # QKV's gradient: nothing left to hide it
    costs = stage_costs(profile, hardware, [(0, 1)], micro_batch_size=1, tensor_parallel=1, data_parallel=16,
                        zero_stage=3, micro_batches=1)
    assert costs.allreduce_seconds[0] == pytest.approx(exposed)


def test_zero3_one_linear_ahead_hides_less_than_a_layer_ahead():
    # Sixteen such blocks whose compute matches their gathers (90 ms forward): a layer ahead, each
    # block's gather would hide behind the previous block's whole forward; a linear ahead, fc1's
    # hides behind proj's. (At the model's ends it is the other way: its first gather is QKV's.)
    from pipectl.plan.cost_table import sharded_exposed_seconds

    profile = _large_blocks(16, 0.09)
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    costs = stage_costs(profile, hardware, [(0, 16)], micro_batch_size=1, tensor_parallel=1, data_parallel=16,
                        zero_stage=3, micro_batches=1)
    a_layer_ahead = sharded_exposed_seconds([2.4e9] * 16, [0.09] * 16, [0.18] * 16, hardware.links.allreduce_inter,
                                            16, 3)  # fmt: skip
    assert costs.allreduce_seconds[0] > 1.5 * a_layer_ahead  # 1.51 s against 0.92 s


def test_zero3_holds_a_large_block_one_linear_at_a_time():
    # Gathered a linear at a time, a 1.2 B block holds at most fc1 and fc2 whole (800 M bf16
    # weights) and fc1's gradient (400 M), not two blocks and a block's gradient.
    from pipectl.plan.candidates import ShapeBuilder
    from pipectl.plan.spec_costs import transient_bytes

    profile = _large_blocks(2, 0.09)
    shape = ShapeBuilder(profile, hardware_for(load_cluster("a100-8x8"), profile)).shape(1, 1, Recompute.NONE, 1, 1)
    assert transient_bytes(shape, "bfloat16", 3, 16) == pytest.approx(2 * 800e6 + 2 * 400e6)
    assert transient_bytes(shape, "bfloat16", 2, 16) == pytest.approx(2 * 1.2e9)  # ZeRO-2: a block's gradient


def test_zero2_against_zero1_under_this_model():
    """ZeRO-1 (the pipeline engine's): one all-reduce after the last micro-batch. ZeRO-2: a
    reduce-scatter of every layer in every micro-batch, on the compute stream (DeepSpeed's
    overlap_comm is off by default below stage 3), and an all-gather after the step. The same
    volume at m = 1, plus a ring's latency per layer; m reduce-scatters at m > 1, so it loses
    there: it is planned for its memory, not its time."""
    profile = _two_layers()
    hardware = hardware_for(load_cluster("a100-8x8"), profile)

    def allreduce(zero: int, m: int) -> float:
        return stage_costs(profile, hardware, [(0, 2)], micro_batch_size=1, tensor_parallel=1, data_parallel=16,
                           zero_stage=zero, micro_batches=m).allreduce_seconds[0]

    ring_allreduce = 30 * (5e-6 + 600e6 / 16 / 25e9)  # 45.15 ms
    all_gather = ring_allreduce / 2  # 22.575 ms
    scatter_a = 15 * (5e-6 + 400e6 / 16 / 25e9)  # 15.075 ms
    scatter_b = 15 * (5e-6 + 200e6 / 16 / 25e9)  # 7.575 ms: both exposed
    assert allreduce(1, 1) == allreduce(1, 4) == pytest.approx(ring_allreduce)
    assert allreduce(2, 1) == pytest.approx(scatter_a + scatter_b + all_gather)  # 45.225 ms, 45.15 + a latency
    assert allreduce(2, 2) == pytest.approx(2 * (scatter_a + scatter_b) + all_gather)  # 67.875 ms
    assert allreduce(1, 1) < allreduce(2, 1) < allreduce(2, 2)


def test_the_planner_prices_zero_2_and_3_as_simulate_does():
    profile, cluster = _two_layers(), load_cluster("a100-8x8")
    request = PlanRequest(global_batch=32, zero_stages=[1, 2, 3], pipeline_parallel=1, data_parallel=16,
                          for_deepspeed=False, include_all=True, morph=False, workers=1)
    result = plan(profile, cluster, request)
    by_stage = {c.zero_stage: c for c in result.candidates if not c.checkpoint_layers}
    assert set(by_stage) == {1, 2, 3}
    for candidate in result.candidates:
        costs = stage_costs_for(candidate, profile, cluster)
        resimulated = simulate(generate(candidate.schedule, 1, candidate.micro_batches), costs).step_seconds
        assert resimulated == pytest.approx(candidate.predicted_step_seconds, rel=1e-12)
    # One stage, no tensor split: ZeRO-2 and ZeRO-3 run in DeepSpeed's ordinary engine (runtime/engines/plain.py),
    # ZeRO-3 without per-layer checkpointing.
    for candidate in result.candidates:
        assert candidate.deepspeed_runnable == (candidate.zero_stage < 3 or not candidate.checkpoint_layers)
    assert any(c.zero_stage == 3 and c.deepspeed_runnable for c in result.candidates)
    # m = 2: 2 x 30 ms of compute + the collectives above + Adam's step.
    assert by_stage[3].predicted_step_seconds - by_stage[1].predicted_step_seconds == pytest.approx(
        (2 * 46.579 - 45.15) * MS, abs=1e-6)
    # Checkpointed, ZeRO-3 gathers each layer once more per micro-batch (2 x 9.021 ms more).
    checkpointed = {c.zero_stage: c for c in result.candidates if c.checkpoint_layers}
    assert checkpointed[3].predicted_step_seconds - checkpointed[1].predicted_step_seconds == pytest.approx(
        (2 * 55.600 - 45.15) * MS, abs=1e-6)


# --- search ----------------------------------------------------------------------------------------


def test_zero_2_and_3_appear_at_p_1_only():
    profile = synthetic_profile(blocks=6, micro_batch_sizes=[1, 2])
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    request = PlanRequest(global_batch=32, zero_stages=[0, 1, 2, 3], devices=16)
    enumeration = enumerate_specs(profile, hardware, search_space(request, profile, hardware), 16)
    depths = {}
    for spec in enumeration.specs:
        depths.setdefault(spec.zero_stage, set()).add(spec.shape.pipeline_parallel)
    assert depths[2] == depths[3] == {1}
    assert max(depths[1]) > 1 and max(depths[0]) > 1
    # At d = 1 nothing shards: one candidate, labelled with the runtime's ZeRO-1.
    assert {s.zero_stage for s in enumeration.specs if s.data_parallel == 1} == {1}
    result = plan(profile, load_cluster("a100-8x8"), request.model_copy(update={"include_all": True, "for_deepspeed": False,
                                                                             "morph": False}))
    assert all(c.pipeline_parallel == 1 for c in result.candidates if c.zero_stage >= 2)


def test_zero3_fits_where_zero1_does_not_and_is_chosen_without_any_engine():
    profile = _two_layers()
    # ZeRO-1 at d = 16 needs 1.575 GB at the step; ZeRO-3 1.3 GB (see the memory test).
    hardware = _with_memory(hardware_for(load_cluster("a100-8x8"), profile), 1.4)
    cluster = load_cluster("a100-8x8")
    request = PlanRequest(global_batch=16, zero_stages=[1, 3], pipeline_parallel=1, data_parallel=16, morph=False,
                          memory_headroom=0.0, workers=1)
    # The runtime trains ZeRO-3 at p = 1, t = 1 (DeepSpeed's ordinary engine): chosen without --any-engine.
    chosen = plan_homogeneous(profile, cluster.name, hardware, request)
    assert (chosen.chosen.zero_stage, chosen.chosen.pipeline_parallel, chosen.chosen.tensor_parallel) == (3, 1, 1)
    assert chosen.chosen.deepspeed_runnable
    with pytest.raises(InfeasibleError, match="a stage does not fit"):
        plan_homogeneous(profile, cluster.name, hardware, request.model_copy(update={"zero_stages": [1]}))


def test_a_plan_keeps_the_best_zero3_row_and_says_what_it_lost_to():
    # 24 blocks of hidden 8192 (19.4 B parameters) without tensor parallelism: ZeRO-1 needs
    # 19.4e9 x (4 + 20/64) bytes > 80 GB at p = 1, ZeRO-3 19.4e9 x 24/64 = 7.3 GB plus its gathers.
    profile = synthetic_profile(blocks=24, micro_batch_sizes=[1, 2], hidden=8192, seq_len=256)
    request = PlanRequest(global_batch=64, zero_stages=[1, 3], max_tensor_parallel=1, morph=False, workers=1)
    result = plan(profile, load_cluster("a100-8x8"), request)
    assert result.chosen.zero_stage == 1 and result.chosen.pipeline_parallel > 1
    assert not any(c.zero_stage == 1 and c.pipeline_parallel == 1 for c in result.candidates)
    row = next(c for c in result.candidates if c.zero_stage == 3)
    assert row.pipeline_parallel == 1 and row.tensor_parallel == 1 and row.deepspeed_runnable  # the runtime trains it
    assert row.predicted_step_seconds > result.chosen.predicted_step_seconds
    note = next(n for n in result.notes if n.startswith("ZeRO-3"))
    assert "loses to the best candidate pipectl's runtime can run" in note and "trains ZeRO-3 with no tensor" not in note
    assert f"({result.chosen.predicted_step_seconds:.4g} s/step)" in note


def test_a_zero3_plan_that_chose_zero3_says_so_and_compares_it_with_nothing():
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2])
    request = PlanRequest(global_batch=8, zero_stages=[3], pipeline_parallel=1, data_parallel=2, morph=False, workers=1)
    result = plan(profile, load_cluster("a100-8x8").model_copy(update={"nodes": 1}), request.model_copy(update={"devices": 2}))
    assert result.chosen.zero_stage == 3
    note = next(n for n in result.notes if n.startswith("ZeRO-3"))
    assert note.endswith(", the best candidate pipectl's runtime can run") and "loses" not in note, note


@pytest.mark.parametrize("memory_gib", [0.004, 0.006, 0.01])
def test_the_enumeration_keeps_exactly_the_zero_2_and_3_points_that_fit_one_by_one(memory_gib):
    # Largest d first, a stage that does not fit at some d is not tried at smaller ones: the same
    # points as checking each.
    from pipectl.plan.candidates import ShapeBuilder
    from pipectl.plan.spec_costs import state_bytes, step_bytes, transient_bytes
    from pipectl.plan.memory import in_flight_units
    from pipectl.schedule import ScheduleKind

    profile = synthetic_profile(blocks=8, micro_batch_sizes=[1, 2], hidden=128, seq_len=256, attention_core=(0.4, 0.1))
    hardware = _with_memory(hardware_for(load_cluster("a100-8x8"), profile), memory_gib)
    request = PlanRequest(global_batch=24, zero_stages=[1, 2, 3], schedules=[ScheduleKind.GPIPE])
    space = search_space(request, profile, hardware)
    enumeration = enumerate_specs(profile, hardware, space, 64)
    got = {(s.shape.tensor_parallel, s.shape.micro_batch_size, s.shape.recompute, s.data_parallel, s.zero_stage)
           for s in enumeration.specs if s.zero_stage >= 2}
    builder = ShapeBuilder(profile, hardware)
    expected = set()
    for t in space.tensor_parallel:
        # One stage: never whole-stage recompute; per-layer checkpointing and selective
        # recomputation give points of their own.
        for b, recompute in itertools.product(space.micro_batch_sizes,
                                              (Recompute.NONE, Recompute.LAYER, Recompute.SELECTIVE)):
            shape = builder.shape(t, b, recompute, 1, 1)
            for d in range(2, min(64 // t, 24 // b) + 1):
                if 24 % (d * b):
                    continue  # uneven replicas: refused for ZeRO-2/3 (they reduce every micro-batch)
                m = 24 // (d * b)
                for zero in (2, 3):
                    kind = ScheduleKind.GPIPE  # m in flight at p = 1: memory grows as d shrinks
                    if shape.memory.fits(state_bytes(profile.dtype, zero, d, kind), step_bytes(profile.dtype, zero, d, kind),
                                         in_flight_units(kind, 1, m), hardware.memory_bytes,
                                         transient_bytes(shape, profile.dtype, zero, d)):
                        expected.add((t, b, recompute, d, zero))
    assert got == expected
    assert expected  # some fit, and (below) some do not
    assert len(expected) < 2 * sum(min(64 // t, 24 // b) - 1 for t in space.tensor_parallel for b in space.micro_batch_sizes)


def test_with_measured_engine_terms_the_planner_and_simulate_agree():
    # A CPU profile with the engine's measured terms on the local cluster: host slowdown, busy
    # handoffs and the engine's small collectives enter ZeRO-2/3's figures as they do ZeRO-1's.
    from pipectl.artifacts.profile import RuntimeCosts
    from pipectl.cluster import local_cluster

    runtime = RuntimeCosts(engine="test engine", forward_overhead_seconds=0.001, backward_overhead_seconds=0.002,
                           step_fixed_seconds=0.004, step_seconds_per_parameter=1e-8, busy_handoff_seconds=2e-4)
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2], device="cpu", dtype="float32")
    profile = profile.model_copy(update={"runtime": runtime})
    cluster = local_cluster(4)
    request = PlanRequest(global_batch=8, zero_stages=[1, 2, 3], pipeline_parallel=1, for_deepspeed=False,
                          include_all=True, morph=False, workers=1)
    result = plan(profile, cluster, request)
    assert {c.zero_stage for c in result.candidates if c.data_parallel > 1} == {1, 2, 3}
    for candidate in result.candidates:
        costs = stage_costs_for(candidate, profile, cluster)
        resimulated = simulate(generate(candidate.schedule, 1, candidate.micro_batches), costs).step_seconds
        assert resimulated == pytest.approx(candidate.predicted_step_seconds, rel=1e-12)


def test_zero3_with_per_layer_checkpointing_is_planned_only():
    """The runtime trains ZeRO-3 at p = 1, t = 1, but not with per-layer checkpointing (its
    recomputed forwards find the weights partitioned); ZeRO-2 with it runs."""
    from pipectl.artifacts.plan import RecomputeChoice

    profile, cluster = _two_layers(), load_cluster("a100-8x8")
    request = PlanRequest(global_batch=32, zero_stages=[2, 3], pipeline_parallel=1, data_parallel=16,
                          recompute=RecomputeChoice.LAYER, for_deepspeed=False, include_all=True, morph=False, workers=1)
    candidates = plan(profile, cluster, request).candidates
    checkpointed = {c.zero_stage: c for c in candidates if c.checkpoint_layers}
    plain = {c.zero_stage: c for c in candidates if not c.checkpoint_layers}
    assert set(checkpointed) == set(plain) == {2, 3}
    assert checkpointed[2].deepspeed_runnable and plain[3].deepspeed_runnable
    assert not checkpointed[3].deepspeed_runnable
    assert any("not with per-layer checkpointing" in note for note in checkpointed[3].notes)


def test_zero2_is_runnable_with_one_stage_and_no_tensor_split_and_never_uneven():
    """ZeRO-2 at p = 1, t = 1 is a candidate the runtime trains (chosen without --any-engine when it
    is best); replicas that d x b does not divide are rejected for it with their reason."""
    profile, cluster = _two_layers(), load_cluster("a100-8x8")
    request = PlanRequest(global_batch=32, zero_stages=[2], pipeline_parallel=1, tensor_parallel=1, morph=False, workers=1)
    chosen = plan(profile, cluster, request).chosen
    assert chosen.zero_stage == 2 and chosen.deepspeed_runnable and not chosen.replicas
    uneven = request.model_copy(update={"global_batch": 30, "data_parallel": 4, "micro_batch_size": 2})
    with pytest.raises(InfeasibleError, match="ZeRO-2/3 reduce after every micro-batch"):
        plan(profile, cluster, uneven)
