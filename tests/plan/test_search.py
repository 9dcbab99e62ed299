"""The search: B kept exactly, pruning never drops the exhaustive optimum, typed rejections."""

from __future__ import annotations

import pytest

from pipectl.artifacts.plan import Engine, Objective
from pipectl.cluster import load_cluster, local_cluster
from pipectl.errors import InfeasibleError, UserInputError
from pipectl.plan.candidates import lower_bound_seconds, recomputing_stages, tied
from pipectl.plan.costs import hardware_for
from pipectl.plan.evaluate import Evaluator
from pipectl.artifacts.plan import PlanRequest
from pipectl.plan.homogeneous import goal_for, rank
from pipectl.plan.search import plan
from pipectl.plan.space import enumerate_specs, search_space
from pipectl.testing.profiles import synthetic_profile
from pipectl.schedule import ScheduleKind


def _profile(blocks=6, **kwargs):
    kwargs.setdefault("block_forward_seconds", [0.01 * (1 + 0.3 * (i % 3)) for i in range(blocks)])
    return synthetic_profile(blocks=blocks, micro_batch_sizes=[1, 2, 4], **kwargs)


def _search_parts(profile, cluster, request):
    hardware = hardware_for(cluster, profile)
    space = search_space(request, profile, hardware)
    enumeration = enumerate_specs(profile, hardware, space, request.devices or hardware.devices)
    return hardware, enumeration


@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("objective", [Objective.TIME, Objective.COST])
@pytest.mark.parametrize("batch", [12, 16, 24])
def test_pruning_never_drops_the_exhaustive_optimum(objective, batch, reference):
    # With the fast paths and in reference mode (every spec simulated) alike.
    profile = _profile()
    cluster = load_cluster("a100-8x8")
    request = PlanRequest(global_batch=batch, devices=8, objective=objective, top=3)
    hardware, enumeration = _search_parts(profile, cluster, request)
    goal = goal_for(request, profile, hardware)
    evaluator = Evaluator(hardware, batch, reference=reference)
    exhaustive = rank(enumeration.specs, goal, evaluator, keep=3, exhaustive=True, engine=Engine.ANY)
    pruned = rank(
        enumeration.specs, goal, Evaluator(hardware, batch, reference=reference), keep=3, exhaustive=False,
        engine=Engine.ANY,
    )
    assert pruned.top[0][0] == exhaustive.top[0][0]
    assert [k for k, _, _ in pruned.top] == [k for k, _, _ in exhaustive.top[:3]]
    assert pruned.simulated < exhaustive.simulated  # it did prune


def test_lower_bound_never_exceeds_the_simulated_step():
    profile = _profile(blocks=8)
    cluster = load_cluster("a100-8x8")
    request = PlanRequest(global_batch=32, devices=16, schedules=list(ScheduleKind))  # every schedule the planner prices
    hardware, enumeration = _search_parts(profile, cluster, request)
    evaluator = Evaluator(hardware, 32, reference=True)  # the simulation itself, not a fast path
    assert len(enumeration.specs) > 50
    for spec in enumeration.specs[::3]:
        assert spec.lower_bound_seconds <= evaluator.step_seconds(spec) * (1 + 1e-9), spec.describe()


def test_lower_bound_is_exact_for_equal_stages_without_communication():
    from pipectl.plan.candidates import ShapeBuilder
    import numpy as np

    profile = synthetic_profile(blocks=8, micro_batch_sizes=[1], edge_forward_seconds=0.0)
    hardware = hardware_for(local_cluster(4), profile)
    shape = ShapeBuilder(profile, hardware).shape(1, 1, False, 4, 1)
    # Blocks are equal; free transfers: (m + p - 1)(t_f + t_b).
    shape.send_lower_bound[:] = 0.0
    zeros = np.zeros(4)
    forward, backward = shape.forward.max(), shape.backward.max()
    bound = lower_bound_seconds(shape, ScheduleKind.ONE_F_ONE_B, 8, zeros, zeros)
    assert bound == pytest.approx((8 + 4 - 1) * (forward + backward), rel=1e-6)
    assert not recomputing_stages(shape, ScheduleKind.ONE_F_ONE_B).any()


def test_every_candidate_keeps_the_global_batch_and_fits():
    profile = _profile()
    result = plan(profile, load_cluster("a100-8x8"), PlanRequest(global_batch=48, devices=16, include_all=True))
    memory = 80 * 1024**3
    assert result.candidates
    for candidate in result.candidates:
        assert candidate.global_batch == 48
        if candidate.replicas:  # uneven: the micro-batches dealt out as evenly as they go
            counts = [r.micro_batches for r in candidate.replicas]
            assert max(counts) - min(counts) == 1 and max(counts) == candidate.micro_batches
        else:
            assert candidate.data_parallel * candidate.micro_batch_size * candidate.micro_batches == 48
        assert candidate.devices <= 16
        assert max(candidate.peak_memory_bytes) <= memory
        assert candidate.stage_layers[0][0] == 0 and candidate.stage_layers[-1][1] == len(profile.layers)
    steps = [tied(c.predicted_step_seconds) for c in result.candidates]  # equal to 12 digits: a tie, by preference
    assert steps == sorted(steps)
    assert result.chosen.deepspeed_runnable


def test_batch_that_nothing_divides_uses_fewer_devices():
    # B = 7 (prime): only d in {1, 7} with b in {1, 7}; with 4 devices d=7 is impossible.
    profile = _profile()
    result = plan(profile, local_cluster(4), PlanRequest(global_batch=7))
    assert result.chosen.data_parallel == 1
    assert result.chosen.global_batch == 7
    assert result.infeasible["global batch not divisible by data-parallel degree x micro-batch size"] > 0


def test_memory_rejections_are_typed_and_explained():
    # A model far too big for one CPU rank's 8 GiB budget unless it is cut.
    profile = synthetic_profile(blocks=8, hidden=3072, seq_len=512, vocab=1000, device="cpu", micro_batch_sizes=[1])
    result = plan(profile, local_cluster(4), PlanRequest(global_batch=4))
    assert result.infeasible["a stage does not fit in device memory"] > 0
    assert any("needs" in note and "GiB >" in note for note in result.notes)
    assert result.chosen.pipeline_parallel * result.chosen.tensor_parallel > 1


def test_nothing_fits_is_an_infeasible_error_with_reasons():
    profile = synthetic_profile(blocks=2, hidden=16384, seq_len=2048, vocab=1000, device="cpu", micro_batch_sizes=[1])
    with pytest.raises(InfeasibleError, match="does not fit in device memory"):
        plan(profile, local_cluster(2), PlanRequest(global_batch=4))


def test_why_nothing_fits_is_said_of_the_count_asked_not_of_the_morph_tables():
    """A resize of GPT-3 to 8 devices said '1857 x fewer micro-batches than data-parallel replicas
    (... d=193)': the reasons were counted over every count the morph table covers. They are the
    same whether a morph table is asked for or not."""
    profile = synthetic_profile(blocks=4, hidden=16384, seq_len=2048, vocab=1000, device="cpu", micro_batch_sizes=[1])
    said = {}
    for morph in (False, True):
        with pytest.raises(InfeasibleError) as caught:
            plan(profile, local_cluster(8), PlanRequest(global_batch=4, devices=1, morph=morph))
        said[morph] = caught.value.message
    assert said[True] == said[False] and "on 1 device:" in said[True], said


@pytest.mark.parametrize(
    "request_fields, message",
    [
        ({"global_batch": 0}, "global batch must be a positive"),
        ({"global_batch": 16, "pipeline_parallel": 99}, "pipeline-parallel degree 99"),
        ({"global_batch": 16, "tensor_parallel": 3}, "tensor-parallel degree 3"),
        ({"global_batch": 16, "data_parallel": 3, "uneven_replicas": False}, "not divisible by data-parallel degree 3"),
        ({"global_batch": 16, "data_parallel": 17}, "data-parallel degree 17 is more than the global batch's 16"),
        ({"global_batch": 16, "data_parallel": 4, "micro_batch_size": 8}, "data-parallel degree 4 x micro-batch 8"),
        ({"global_batch": 16, "devices": 1000}, "--devices 1000"),
        ({"global_batch": 16, "zero_stages": [3], "pipeline_parallel": 2}, "ZeRO stage 3 is not supported with pipeline"),
        ({"global_batch": 16, "objective": "cost-deadline"}, "deadline"),
    ],
)
def test_bad_requests_name_the_value(request_fields, message):
    with pytest.raises(UserInputError, match=message):
        plan(_profile(), load_cluster("a100-8x8"), PlanRequest(**request_fields))


def test_pinned_degrees_are_honoured():
    result = plan(
        _profile(),
        load_cluster("a100-8x8"),
        PlanRequest(global_batch=32, pipeline_parallel=2, data_parallel=2, micro_batch_size=2, schedule="gpipe", morph=False),
    )
    c = result.chosen
    assert (c.pipeline_parallel, c.data_parallel, c.micro_batch_size, c.schedule) == (2, 2, 2, ScheduleKind.GPIPE)
    assert c.micro_batches == 8


def test_two_bw_only_when_asked_and_always_flagged():
    default = plan(_profile(), local_cluster(4), PlanRequest(global_batch=16, include_all=True, morph=False))
    assert all(c.schedule is not ScheduleKind.PIPEDREAM_2BW for c in default.candidates)
    asked = plan(
        _profile(), local_cluster(4),
        PlanRequest(global_batch=16, schedules=["2bw", "1f1b"], include_all=True, morph=False),
    )
    flagged = [c for c in asked.candidates if c.schedule is ScheduleKind.PIPEDREAM_2BW]
    assert flagged and all(any("1-stale" in n for n in c.notes) and not c.deepspeed_runnable for c in flagged)
    assert asked.chosen.schedule is not ScheduleKind.PIPEDREAM_2BW


def test_interleaved_is_not_chosen_for_deepspeed_but_listed():
    profile = _profile(blocks=8)
    request = PlanRequest(global_batch=32, schedules=["interleaved"], pipeline_parallel=2, devices=2, morph=False)
    with pytest.raises(InfeasibleError, match="DeepSpeed"):
        plan(profile, load_cluster("a100-8x8"), request)
    anywhere = plan(profile, load_cluster("a100-8x8"), request.model_copy(update={"for_deepspeed": False}))
    assert anywhere.chosen.schedule is ScheduleKind.INTERLEAVED and anywhere.chosen.chunks in (2, 4)
    assert anywhere.chosen.micro_batches % 2 == 0


def test_cost_deadline_picks_the_cheapest_meeting_it():
    profile = _profile()
    cluster = load_cluster("a100-8x8")
    fast = plan(profile, cluster, PlanRequest(global_batch=64, include_all=True, morph=False))
    slowest_needed = max(c.predicted_step_seconds for c in fast.candidates)
    request = PlanRequest(
        global_batch=64, objective="cost-deadline", deadline_hours=slowest_needed * 10 / 3600, samples=640,
        include_all=True, morph=False,
    )
    result = plan(profile, cluster, request)
    meeting = [c for c in result.candidates if c.predicted_step_seconds * 10 <= slowest_needed * 10]
    assert result.chosen.cost_per_million_samples == pytest.approx(min(c.cost_per_million_samples for c in meeting))


def test_shape_stage_times_match_the_per_stage_definitions():
    from pipectl.plan.candidates import ShapeBuilder
    from pipectl.plan.spec_costs import tied_seconds
    from pipectl.plan.layer_table import layer_table

    profile = synthetic_profile(blocks=8, micro_batch_sizes=[2])
    hardware = hardware_for(local_cluster(8), profile)
    builder = ShapeBuilder(profile, hardware)
    shape = builder.shape_from_cuts(2, 2, False, 2, 2, [(0, 2), (2, 5), (5, 8), (8, 11)])
    seconds = builder.seconds(2, 2)
    table = layer_table(profile, 2)
    assert shape.forward.tolist() == [seconds.stage_forward(s, e) for s, e in shape.stage_layers]
    assert shape.backward.tolist() == [seconds.stage_backward(s, e) for s, e in shape.stage_layers]
    links = hardware.links
    fastest = links.intra if links.intra.seconds(1e6) <= links.inter.seconds(1e6) else links.inter
    expected_sends = [fastest.seconds(table.output_activation_bytes[e - 1]) for _, e in shape.stage_layers[:-1]]
    assert shape.send_lower_bound.tolist() == expected_sends
    # The tied embedding (layer 0, stage 0 on rank 0) and head (last layer, stage 3 on rank 1)
    # sit on different ranks: both ranks pay the tied all-reduce, the same amount.
    tied = tied_seconds(shape, hardware, 2, 2)
    assert tied[0] > 0 and tied[0] == tied[1]
    # On one rank (p = 1 with two chunks) there is nothing to synchronise.
    one_rank = builder.shape_from_cuts(2, 2, False, 1, 2, [(0, 5), (5, 11)])
    assert not tied_seconds(one_rank, hardware, 2, 2).any()


def test_tied_all_reduce_lands_on_the_ranks_holding_the_tied_layers():
    from pipectl.plan.candidates import ShapeBuilder
    from pipectl.plan.spec_costs import tied_seconds

    profile = synthetic_profile(blocks=8, micro_batch_sizes=[1])
    hardware = hardware_for(local_cluster(8), profile)
    shape = ShapeBuilder(profile, hardware).shape_from_cuts(1, 1, False, 4, 1, [(0, 3), (3, 6), (6, 9), (9, 11)])
    tied = tied_seconds(shape, hardware, 2, 2)
    assert [rank for rank in range(4) if tied[rank] > 0] == [0, 3]


@pytest.mark.parametrize("seed", range(3))
def test_the_plan_is_the_same_whatever_the_number_of_workers(monkeypatch, seed):
    import dataclasses
    import random

    from pipectl.plan import homogeneous, space
    from pipectl.plan.homogeneous import SearchStats

    monkeypatch.setattr(space, "PARALLEL_MIN_FAMILIES", 0)  # share even this small search
    rng = random.Random(seed)
    blocks = 10
    profile = synthetic_profile(
        blocks=blocks, micro_batch_sizes=[1, 2, 4], hidden=128, seq_len=256,
        block_forward_seconds=[0.01 * rng.uniform(0.5, 2.0) for _ in range(blocks)],
    )
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    # Memory tight enough that many points are rejected and some need the memory-constrained cut.
    hardware = dataclasses.replace(hardware, device=hardware.device.model_copy(update={"memory_gib": 0.004 * (seed + 2), "outside_allocator_gib": 0.0}))
    shared = space.share
    remote = []

    def counting_share(*args, **kwargs):
        outcomes = shared(*args, **kwargs)
        remote.append(sum(outcome.remote is not None for outcome in outcomes))
        return outcomes

    monkeypatch.setattr(space, "share", counting_share)
    plans, stats, simulations = [], [], []
    for workers in (1, 2, 3):
        stat = SearchStats()
        request = PlanRequest(global_batch=48, top=5, workers=workers)
        try:
            result = homogeneous.plan_homogeneous(profile, "tight", hardware, request, stats=stat)
        except InfeasibleError as error:
            result = str(error)
        plans.append(result if isinstance(result, str) else result.model_dump_json())
        stats.append((stat.specs, stat.shapes, stat.rejected))
        simulations.append(stat.simulations)
    assert remote[0] == 0 and remote[1] > 0 and remote[2] > 0  # children did compute units
    assert plans[0] == plans[1] == plans[2]
    assert stats[0] == stats[1] == stats[2]
    # Timing the morph table ahead in two processes times a few specs the one loop prunes.
    assert simulations[0] <= simulations[1] == simulations[2]
    assert stats[0][0] and stats[0][2]  # some points fit and some did not


def test_rejections_merge_keeps_the_first_example():
    from pipectl.plan.candidates import Rejection, Rejections

    first, second = Rejections(), Rejections()
    first.add(Rejection.MEMORY, "first memory example", count=2)
    second.add(Rejection.MEMORY, "second memory example")
    second.add(Rejection.TOO_FEW_LAYERS, "layers example", count=3)
    first.merge(second)
    assert first.counts == {Rejection.MEMORY: 3, Rejection.TOO_FEW_LAYERS: 3}
    assert first.examples == {Rejection.MEMORY: "first memory example", Rejection.TOO_FEW_LAYERS: "layers example"}


@pytest.mark.parametrize("cluster_name", ["a100-8x8", "a100-384x8", "v100-4vm", "mixed-v100-p100"])
@pytest.mark.parametrize("model", ["gpt2-2.5b", "gpt3-175b"])
def test_shipped_clusters_plan_the_same_with_one_or_two_workers(monkeypatch, cluster_name, model):
    from pipectl.catalog import get_device
    from pipectl.models.registry import load_model_config
    from pipectl.plan import space
    from pipectl.profile.derive import derive_profile

    monkeypatch.setattr(space, "PARALLEL_MIN_FAMILIES", 0)
    cluster = load_cluster(cluster_name)
    device = get_device(cluster.node_types[0].device)
    profile = derive_profile(load_model_config(model), device, [1, 2, 4])
    plans = []
    for workers in (1, 2):
        try:
            plans.append(plan(profile, cluster, PlanRequest(global_batch=512, workers=workers)).model_dump_json())
        except InfeasibleError as error:
            plans.append(str(error))
    assert plans[0] == plans[1]


def test_six_stages_by_six_replicas_run_a_batch_six_does_not_divide():
    # Varuna ran 6 x 6 on 36 devices at B = 8192, which 6 does not divide: uneven replicas keep B.
    profile = _profile(blocks=12)
    request = PlanRequest(global_batch=8192, devices=36, pipeline_parallel=6, data_parallel=6, tensor_parallel=1,
                          micro_batch_size=4, schedule="1f1b", morph=False)
    chosen = plan(profile, load_cluster("a100-8x8"), request).chosen
    assert (chosen.pipeline_parallel, chosen.data_parallel, chosen.devices) == (6, 6, 36)
    assert [r.micro_batches for r in chosen.replicas] == [342, 342, 341, 341, 341, 341]  # 2048 = 6 x 341 + 2
    assert chosen.global_batch == 8192 and chosen.micro_batches == 342
    with pytest.raises(UserInputError, match="not divisible by data-parallel degree 6"):
        plan(profile, load_cluster("a100-8x8"), request.model_copy(update={"uneven_replicas": False}))


def test_a_device_with_more_memory_fits_what_a_smaller_one_cannot():
    # GPT-3 175B on 4 nodes of 8: its training state (16 bytes per parameter under ZeRO-1 at d = 1,
    # 2.8 TB) needs more than 32 x 80 GB, but fits 32 x 192 GB; the catalog's MI300X against H100 SXM.
    from pipectl.artifacts.cluster import ClusterSpec
    from pipectl.catalog import get_device
    from pipectl.models.registry import load_model_config
    from pipectl.profile.derive import derive_profile

    request = PlanRequest(global_batch=512, micro_batch_size=1, schedule="1f1b", morph=False)
    chosen = {}
    for name in ("h100-80gb", "mi300x"):
        cluster = ClusterSpec(name=name, node_types=[{"name": "n", "device": name, "devices_per_node": 8, "nodes": 4}])
        profile = derive_profile(load_model_config("gpt3-175b"), get_device(name), [1])
        try:
            chosen[name] = plan(profile, cluster, request).chosen
        except InfeasibleError as error:
            chosen[name] = str(error)
    assert "nothing fits" in chosen["h100-80gb"] and "does not fit in device memory" in chosen["h100-80gb"]
    mi300x = chosen["mi300x"]
    assert mi300x.devices <= 32 and max(mi300x.peak_memory_bytes) > get_device("h100-80gb").memory_bytes
    assert max(mi300x.peak_memory_bytes) <= 192 * 2**30


def test_a_deadline_no_candidate_meets_is_said_with_the_steps_it_needs_readably():
    """'no candidate finishes 585937500 steps' was hard to read; every other count has separators."""
    profile = _profile()
    request = PlanRequest(global_batch=64, objective="cost-deadline", deadline_hours=0.001, samples=64 * 12345,
                          morph=False)  # fmt: skip
    notes = plan(profile, load_cluster("a100-8x8"), request).notes
    assert any(note.startswith("no candidate finishes 12,345 steps within 0.001 h") for note in notes), notes


def test_a_step_no_real_device_runs_is_one_error_not_a_traceback():
    """Layer times of a device far off (a hand-edited catalog or calibration: a GEMM at 1e-9 of peak)
    put a step beyond what a plan may hold (1e9 s); that is said, naming the device, as input to fix."""
    profile = synthetic_profile(blocks=24, micro_batch_sizes=[1], block_forward_seconds=4e8)
    with pytest.raises(UserInputError, match=r"predicted at .* s, beyond 1e\+09 s: the figures of a100-80gb"):
        plan(profile, load_cluster("a100-8x8"), PlanRequest(global_batch=8, morph=False))
