"""The planner with tensor-parallel shard costs (`LayerProfile.shards`): one rank's figures where a
profile has them, replicated layers whole, and today's division by t for profiles without any."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

from pipectl.artifacts.plan import PlanRequest
from pipectl.artifacts.profile import LayerCost, ModelProfile, ShardProfile
from pipectl.cluster import load_cluster
from pipectl.io import load_model
from pipectl.plan.candidates import ShapeBuilder
from pipectl.plan.costs import hardware_for, layer_seconds
from pipectl.plan.cost_table import stage_costs
from pipectl.plan.layer_table import interpolate, layer_table
from pipectl.plan.memory_ranges import RangeMemory
from pipectl.plan.memory import StageMemory
from pipectl.plan.search import plan
from pipectl.testing.profiles import synthetic_profile
from pipectl.models.registry import load_model_config
from pipectl.profile.derive import derive_profile

DATA = Path(__file__).parent / "data"


def with_block_shards(profile: ModelProfile, degrees, time_factor=lambda t: 1 / t) -> ModelProfile:
    """`profile` with a shard of every transformer block at each t: a rank's time x time_factor(t),
    its saved bytes (8 + 24/t)/32 of the block's (16-bit Megatron counting), its parameters the
    split matrices and biases / t plus 6h whole (LayerNorms, row-parallel biases)."""
    h = profile.hidden
    element = profile.layers[1].parameter_bytes // profile.layers[1].parameter_count
    layers = []
    for layer in profile.layers:
        if layer.kind == "transformer_block":
            shards = []
            for t in degrees:
                parameters = (12 * h * h + 7 * h) // t + 6 * h
                costs = []
                for cost in layer.costs:
                    saved = cost.saved_activation_bytes * (8 + 24 / t) // 32
                    costs.append(LayerCost(
                        micro_batch_size=cost.micro_batch_size,
                        forward_seconds=cost.forward_seconds * time_factor(t),
                        backward_seconds=cost.backward_seconds * time_factor(t),
                        output_activation_bytes=cost.output_activation_bytes,
                        saved_activation_bytes=int(saved),
                        peak_memory_bytes=2 * parameters * element + int(saved) + cost.output_activation_bytes,
                        forward_flops=cost.forward_flops / t,
                    ))  # fmt: skip
                shards.append(ShardProfile(tensor_parallel=t, parameter_count=parameters,
                                           parameter_bytes=parameters * element, costs=costs))  # fmt: skip
            layer = layer.model_copy(update={"shards": shards})
        layers.append(layer)
    return ModelProfile.model_validate(profile.model_copy(update={"layers": layers}).model_dump())


def test_a_profile_without_shards_gives_the_plan_it_gave_before_shards_existed():
    # Both files were written before profiles had shards: the profile (derived gpt2-2.5b on A100s)
    # and the plan the planner made of it, tensor-parallel candidates included.
    profile = load_model(ModelProfile, DATA / "gpt2-2.5b-a100-unsharded.profile.json")
    assert not profile.has_shards
    # Uneven replicas came later too: without them, the same plan. So did tensor groups spanning
    # two nodes (t = 16): the search inside a node, --max-tensor-parallel 8, is the old one.
    request = PlanRequest(global_batch=512, top=10, workers=1, uneven_replicas=False, recompute="stage")
    # The morph table covered every count then; now on request (by default a node's counts and whole nodes).
    # The cluster then priced collectives inside a node at NVLink's 300 GB/s (now NCCL's 230 apart).
    cluster = load_cluster("a100-8x8")
    (nodes,) = cluster.node_types
    old_links = nodes.links.model_copy(update={"intra_node_allreduce_bandwidth_gbytes_per_second": 300.0})
    cluster = cluster.model_copy(update={"node_types": [nodes.model_copy(update={"links": old_links})]})
    made = plan(profile, cluster, request.model_copy(update={"max_tensor_parallel": 8, "morph_every_count": True}))
    before = json.loads((DATA / "gpt2-2.5b-a100-unsharded.plan.json").read_text())
    made_fields = json.loads(made.model_dump_json())
    assert made_fields["request"]["max_tensor_parallel"] == 8 and before["request"]["max_tensor_parallel"] is None
    made_fields["request"]["max_tensor_parallel"] = None
    assert made_fields["request"].pop("uneven_replicas") is False
    assert made_fields["request"].pop("morph_every_count") is True and made_fields["request"].pop("morph_counts") == []
    # Per-layer checkpointing came later too: without it (recompute "stage" is the old search).
    assert made_fields["request"].pop("recompute") == "stage"
    for candidate in [made_fields["chosen"], *made_fields["candidates"]]:
        assert candidate.pop("checkpoint_layers") is False
    for entry in made_fields["morph_table"]:
        if entry["candidate"] is not None:
            assert entry["candidate"].pop("checkpoint_layers") is False
    assert made_fields.pop("kind_profiles") == []  # profiles per device kind came later as well
    assert made_fields["request"].pop("engine") == "deepspeed"  # and the engine (for_deepspeed said it)
    for candidate in [made_fields["chosen"], *made_fields["candidates"],
                      *(entry["candidate"] for entry in made_fields["morph_table"] if entry["candidate"])]:
        assert candidate.pop("engine") == ("deepspeed" if candidate["deepspeed_runnable"] else None)
    assert made_fields.pop("cluster_file") is None  # a shipped cluster; a file's path came later
    # The plan now also keeps the fastest ones DeepSpeed runs where the top 10 did not hold 10 of
    # them: the top 10 are the old plan's, in its order, among them.
    top = [c for c in made_fields["candidates"] if c in before["candidates"]]
    runnable = [c for c in made_fields["candidates"] if c["deepspeed_runnable"]]
    assert len(runnable) >= 10 and all(c in top or c in runnable[:10] for c in made_fields["candidates"])
    made_fields["candidates"] = top
    assert made_fields == before
    assert {c.tensor_parallel for c in made.candidates} > {1}
    # The default search prices t = 16 too; across two nodes it enters neither the choice nor the top 10.
    spanning = plan(profile, cluster, request)
    assert spanning.infeasible != made.infeasible  # t = 16 was searched
    assert [spanning.chosen, *spanning.candidates] == [made.chosen, *made.candidates]


def _small_request():
    # Two blocks, B = 2 on 4 devices: dividing by t makes t = 2 the fastest layout.
    return PlanRequest(global_batch=2, devices=4, workers=1)


def test_shards_as_slow_as_the_whole_block_stop_the_planner_choosing_t2():
    profile = synthetic_profile(blocks=2, micro_batch_sizes=[1, 2], block_forward_seconds=0.05)
    cluster = load_cluster("a100-8x8")
    divided = plan(profile, cluster, _small_request())
    assert divided.chosen.tensor_parallel == 2
    halved = plan(with_block_shards(profile, [2, 4, 8]), cluster, _small_request())
    assert halved.chosen.tensor_parallel == 2  # shards that do halve the time: t = 2 still wins
    launch_bound = plan(with_block_shards(profile, [2, 4, 8], time_factor=lambda t: 1.0), cluster, _small_request())
    assert launch_bound.chosen.tensor_parallel == 1
    assert all(c.tensor_parallel == 1 for c in launch_bound.candidates[:3])


def test_layer_seconds_read_shards_and_keep_replicated_layers_whole():
    profile = with_block_shards(synthetic_profile(blocks=3, micro_batch_sizes=[1, 4]), [2, 4], lambda t: 0.7)
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    whole = layer_seconds(layer_table(profile, 2), hardware, 1)
    table = layer_table(profile, 2, 4)
    seconds = layer_seconds(table, hardware, 4)
    allreduce = max(  # at least the host's issue of the collective (`tensor_parallel_communication`)
        hardware.links.allreduce_intra.ring_allreduce_seconds(table.output_activation_bytes[1], 4),
        (hardware.device.kernel_overhead_us or 0) * 1e-6,
    )
    for index, layer in enumerate(profile.layers):
        if layer.kind == "transformer_block":
            # b = 2 lies between the shard's measured sizes: interpolated like any cost; + 2 all-reduces.
            expected = interpolate([(c.micro_batch_size, c.forward_seconds) for c in layer.shard(4).costs], 2)
            assert seconds.forward[index] == pytest.approx(expected + 2 * allreduce, rel=1e-12)
            assert seconds.forward[index] == pytest.approx(0.7 * whole.forward[index] + 2 * allreduce, rel=1e-12)
        else:  # embedding, final norm, head: replicated, the whole layer's time on every rank
            assert seconds.forward[index] == whole.forward[index]
            assert seconds.backward[index] == whole.backward[index]
    assert table.forward_flops == layer_table(profile, 2).forward_flops  # the model's FLOPs, not a rank's


def test_memory_holds_shard_parameters_and_saved_bytes_and_replicated_layers_whole():
    profile = with_block_shards(synthetic_profile(blocks=4, micro_batch_sizes=[1, 2], tied=True), [2])
    table = layer_table(profile, 2, 2)
    cuts = [(0, 3), (3, 7)]  # embed + 2 blocks | 2 blocks + final norm + head
    memory = StageMemory.build(table, cuts, tensor_parallel=2, recompute=False)
    layers = profile.layers
    for rank, (start, end) in enumerate(cuts):
        parameters = sum(
            layer.shard(2).parameter_count if layer.shards else layer.parameter_count for layer in layers[start:end]
        )
        saved = sum(
            (layer.shard(2) if layer.shards else layer).cost(2).saved_activation_bytes for layer in layers[start:end]
        )
        assert memory.parameters[rank] == parameters
        assert memory.unit_bytes[rank] == saved
    # Without shards every layer was divided by t, the embedding and head included.
    plain = StageMemory.build(layer_table(synthetic_profile(blocks=4, micro_batch_sizes=[1, 2]), 2), cuts,
                              tensor_parallel=2, recompute=False)  # fmt: skip
    assert memory.parameters[0] > plain.parameters[0] and memory.unit_bytes[1] > plain.unit_bytes[1]
    # The partitioner's rows give the same bytes for each stage, recomputing or not.
    rows = RangeMemory.build(table, 2)
    for recompute in (True, False):
        for rank, (start, end) in enumerate(cuts):
            alone = [(0, start)] if start else []
            cut = alone + [(start, end)] + ([(end, 7)] if end < 7 else [])
            stage = StageMemory.build(table, cut, tensor_parallel=2, recompute=recompute)
            keeps = recompute and end < 7
            got = rows.stage_bytes(start, end, state_bytes=16.0, step_bytes=24.0, units=3, recompute=keeps)
            assert got == stage.per_rank_bytes(16.0, 24.0, (3,) * len(cut))[len(alone)]


def test_a_degree_without_shards_divides_only_the_layers_that_split():
    profile = with_block_shards(synthetic_profile(blocks=2, micro_batch_sizes=[1]), [2])
    whole = layer_table(profile, 1)
    table = layer_table(profile, 1, 4)  # blocks split, but the profile has no t = 4 shard
    assert table.divided == (False, True, True, False, False)
    assert table.saved_activation_bytes[1] == whole.saved_activation_bytes[1] / 4
    assert table.parameter_count[1] == -(-whole.parameter_count[1] // 4)
    assert table.parameter_count[0] == whole.parameter_count[0] and table.forward_seconds[4] == whole.forward_seconds[4]
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    from pipectl.plan.costs import tensor_parallel_slowdown

    slowdown = tensor_parallel_slowdown(hardware.device, 1, 4)
    seconds = layer_seconds(table, hardware, 4)
    allreduce = max(  # at least the host's issue of the collective (`tensor_parallel_communication`)
        hardware.links.allreduce_intra.ring_allreduce_seconds(table.output_activation_bytes[1], 4),
        (hardware.device.kernel_overhead_us or 0) * 1e-6,
    )
    assert seconds.forward[1] == pytest.approx(whole.forward_seconds[1] / 4 * slowdown + 2 * allreduce, rel=1e-12)


def test_the_shape_builder_and_the_cost_table_agree_with_shards():
    profile = with_block_shards(synthetic_profile(blocks=6, micro_batch_sizes=[1, 2]), [2, 4], lambda t: 0.8 / t)
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    builder = ShapeBuilder(profile, hardware)
    for t in (1, 2, 4):
        shape = builder.shape(t, 2, False, 2, 1)
        costs = stage_costs(profile, hardware, shape.stage_layers, micro_batch_size=2, tensor_parallel=t,
                            data_parallel=1, pipeline_parallel=2)  # fmt: skip
        assert tuple(shape.forward.tolist()) == costs.forward_seconds
        assert tuple(shape.backward.tolist()) == costs.backward_seconds


def test_shards_must_hold_at_least_their_share_and_agree_on_degrees():
    profile = with_block_shards(synthetic_profile(blocks=2, micro_batch_sizes=[1]), [2])
    block = profile.layers[1]
    with pytest.raises(ValueError, match="less than 1/2"):
        block.model_validate({**block.model_dump(), "shards": [{**block.shards[0].model_dump(), "parameter_count": 1}]})
    data = profile.model_dump()
    data["layers"][2]["shards"] = []  # block.1 without the shard block.0 has
    data["layers"][1]["shards"][0]["tensor_parallel"] = 4
    data["layers"][2]["shards"] = [{**data["layers"][1]["shards"][0], "tensor_parallel": 2}]
    with pytest.raises(ValueError, match="same degrees"):
        ModelProfile.model_validate(data)


def test_a_shard_lists_the_layers_micro_batch_sizes_once_each():
    # A shard whose costs repeat a size once divided by zero in the planner's interpolation.
    profile = with_block_shards(synthetic_profile(blocks=2, micro_batch_sizes=[1, 2]), [2])
    block = profile.layers[1].model_dump()
    shard = block["shards"][0]
    for costs in ([shard["costs"][0], shard["costs"][0]], shard["costs"][:1], shard["costs"][::-1]):
        with pytest.raises(ValueError, match="t=2 shard has costs for micro-batch sizes"):
            profile.layers[1].model_validate({**block, "shards": [{**shard, "costs": costs}]})


@pytest.mark.parametrize("seed", range(4))
def test_stage_memory_from_range_rows_is_the_same_with_shards(seed):
    """The vectorised path (`rows`) and the loop give the same bytes with shards: several chunks per
    rank, the tied embedding and head replicated, t with and without shards."""
    import random

    rng = random.Random(seed)
    profile = derive_profile(load_model_config("gpt-tiny"), "a100-80gb", [1, 2])  # shards at t = 2, 4
    for _ in range(20):
        t, recompute, b = rng.choice((1, 2, 4, 8)), rng.random() < 0.5, rng.choice((1, 2, 3))
        table = layer_table(profile, b, t)
        layers = table.layers
        p = rng.randint(1, 3)
        stages = p * rng.randint(1, max(1, layers // p))
        ends = sorted(rng.sample(range(1, layers), stages - 1)) + [layers]
        cuts = tuple(zip([0] + ends[:-1], ends))
        rows = RangeMemory.build(table, t)
        slow = StageMemory.build(table, cuts, tensor_parallel=t, recompute=recompute, pipeline_parallel=p)
        fast = StageMemory.build(table, cuts, tensor_parallel=t, recompute=recompute, pipeline_parallel=p, rows=rows)
        for mine, theirs in zip(
            (fast.parameters, fast.unit_bytes, fast.recompute_buffer_bytes, fast.working_bytes),
            (slow.parameters, slow.unit_bytes, slow.recompute_buffer_bytes, slow.working_bytes),
        ):
            assert mine.tolist() == theirs.tolist()


def test_the_search_tries_only_the_degrees_a_sharded_profile_has():
    from pipectl.catalog import get_device
    from pipectl.models.registry import load_model_config
    from pipectl.plan.space import tensor_parallel_possible
    from pipectl.profile.derive import derive_profile

    # gpt-small: 12 heads, hidden 768: t = 8 divides the hidden size but not the heads.
    sharded = derive_profile(load_model_config("gpt-small"), get_device("a100-80gb"), [1], "bfloat16")
    assert sharded.shard_degrees() == [2, 4]
    assert [t for t in (2, 4, 8) if tensor_parallel_possible(sharded, t)] == [2, 4]
    plain = sharded.model_copy(update={"layers": [layer.model_copy(update={"shards": []}) for layer in sharded.layers]})
    assert [t for t in (2, 4, 8) if tensor_parallel_possible(plain, t)] == [2, 4, 8]
