"""Heterogeneous clusters: uneven split by VirtualFlow's rule, or the homogeneous subset."""

from __future__ import annotations

import pytest
import yaml

from pipectl.cluster import load_cluster
from pipectl.plan.costs import hardware_for
from pipectl.plan.hetero import uneven_split
from pipectl.artifacts.plan import PlanRequest
from pipectl.plan.search import plan
from pipectl.testing.profiles import synthetic_profile


def _cluster(tmp_path, fast: str, slow: str, nodes=(1, 1)):
    spec = {
        "schema_version": 1,
        "name": "two-kinds",
        "node_types": [
            {"name": "fast", "device": fast, "devices_per_node": 4, "nodes": nodes[0], "price_per_device_hour_on_demand": 2.0},
            {"name": "slow", "device": slow, "devices_per_node": 4, "nodes": nodes[1], "price_per_device_hour_on_demand": 1.0},
        ],
    }
    path = tmp_path / "two-kinds.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_cluster(path)


def _profile():
    return synthetic_profile(blocks=4, micro_batch_sizes=[1, 2, 4], device="v100-16gb")


def test_similar_kinds_split_the_batch_and_weights_sum_to_one(tmp_path):
    cluster = _cluster(tmp_path, "v100-32gb", "v100-16gb")
    result = plan(_profile(), cluster, PlanRequest(global_batch=64, morph=False))
    chosen = result.chosen
    assert chosen.device == "mixed"
    assert chosen.replicas is not None and chosen.global_batch == 64
    assert sum(r.gradient_weight for r in chosen.replicas) == pytest.approx(1.0)
    assert {r.device for r in chosen.replicas} == {"v100-32gb", "v100-16gb"}
    assert any("as fast as the best homogeneous subset" in n for n in result.notes)
    assert chosen.deepspeed_runnable  # the runtime weights each replica's gradient by its samples
    # Re-simulated replica by replica (`pipectl simulate`, status, calibrate): the slowest is the plan's step.
    from pipectl.plan.hetero import replica_stage_costs
    from pipectl.plan.simulate import simulate_step_seconds
    from pipectl.schedule import generate

    steps = [
        simulate_step_seconds(generate(chosen.schedule, chosen.pipeline_parallel, m, chosen.chunks, chosen.recompute), costs)
        for _, m, costs in replica_stage_costs(chosen, _profile(), cluster)
    ]
    assert len(steps) >= 2 and max(steps) == pytest.approx(chosen.predicted_step_seconds, rel=1e-6)


def test_faster_kind_gets_more_micro_batches(tmp_path):
    cluster = _cluster(tmp_path, "a100-80gb", "v100-16gb")
    profile = _profile()
    homogeneous = plan(profile, cluster.model_copy(update={"node_types": cluster.node_types[:1]}),
                       PlanRequest(global_batch=64, morph=False, tensor_parallel=1, pipeline_parallel=1))
    split = uneven_split(profile, cluster, homogeneous.chosen, PlanRequest(global_batch=64))
    assert split is not None
    per_kind = {}
    for share in split.replicas:
        per_kind.setdefault(share.device, []).append(share.samples)
    assert min(per_kind["a100-80gb"]) > max(per_kind["v100-16gb"])
    assert sum(s.samples for s in split.replicas) == 64


def _with_links(cluster, **links):
    return cluster.model_copy(update={"inter_node_links": cluster.inter_node_links.model_copy(update=links)})


def test_one_ring_over_a_slow_link_means_homogeneous_subset(tmp_path):
    # Four V100-32GB in one node all-reduce over NVLink; a split adds the V100-16GB node, and the
    # one ring of all replicas then runs at its slowest hop, here 100 kB/s between the groups.
    cluster = _cluster(tmp_path, "v100-32gb", "v100-16gb")
    request = PlanRequest(global_batch=32, morph=False)
    fast_ring = plan(_profile(), cluster, request)
    assert fast_ring.chosen.device == "mixed"
    slow_ring = plan(_profile(), _with_links(cluster, inter_node_bandwidth_gbytes_per_second=1e-4), request)
    assert slow_ring.chosen.device in ("v100-32gb", "v100-16gb")  # equally fast on this model
    assert any("homogeneous subset" in n for n in slow_ring.notes)
    assert slow_ring.chosen.global_batch == 32


def test_the_ring_of_a_split_runs_at_its_slowest_link(tmp_path):
    # The same split priced twice: only the link between the groups differs, and every replica's
    # all-reduce (the fast kind's too) pays for it.
    cluster = _cluster(tmp_path, "a100-80gb", "v100-16gb")
    profile = _profile()
    template = plan(profile, cluster.model_copy(update={"node_types": cluster.node_types[:1]}),
                    PlanRequest(global_batch=64, morph=False, tensor_parallel=1, pipeline_parallel=1)).chosen
    request = PlanRequest(global_batch=64)
    fast = uneven_split(profile, cluster, template, request)
    slow = uneven_split(profile, _with_links(cluster, inter_node_bandwidth_gbytes_per_second=0.1), template, request)
    assert fast is not None and slow is not None
    assert slow.predicted_step_seconds > fast.predicted_step_seconds
    assert slow.communication_fraction > fast.communication_fraction


def test_an_emulated_slower_kind_gets_its_share_by_its_slowdown():
    """local-mixed: one CPU rank and one emulated twice as slow. The split gives the slow kind
    about a third of the batch, its layers cost twice the CPU's, and the plan says it is emulated."""
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2, 4], device="cpu")
    cluster = load_cluster("local-mixed")
    result = plan(profile, cluster, PlanRequest(global_batch=16, morph=False, micro_batch_size=1))
    chosen = result.chosen
    assert chosen.device == "mixed" and chosen.deepspeed_runnable
    samples = {r.device: r.samples for r in chosen.replicas}
    assert samples["cpu"] + samples["cpu-slowed-2x"] == 16
    assert samples["cpu"] in (10, 11)  # 11 x 1 against 5 x 2 (or 10 against 12 where the ring tips it)
    slow = hardware_for(cluster, profile, "cpu-half-speed")
    fast = hardware_for(cluster, profile, "cpu")
    assert (slow.kind, slow.compute_scale, fast.kind, fast.compute_scale) == ("cpu-slowed-2x", 2.0, "cpu", 1.0)
    assert any("as fast as the best homogeneous subset (1 x cpu" in n for n in result.notes)


def test_the_split_may_take_another_micro_batch_than_the_best_layout_of_one_kind():
    """b = 4 is 5 % cheaper per sample than b = 1, so one CPU alone runs 4 x 4; but split with a
    kind twice as slow, 4 micro-batches of 4 go 3 + 1 (3 x 3.8 = 11.4 units of b = 1) while 16 of 1
    go 11 + 5 (11 units): the split is searched over the ranked layouts, not only the fastest."""
    base = synthetic_profile(blocks=4, micro_batch_sizes=[1, 4], device="cpu", dtype="float32")
    layers = []
    for layer in base.layers:
        costs = [c.model_copy(update={"forward_seconds": c.forward_seconds * 0.95, "backward_seconds": c.backward_seconds * 0.95})
                 if c.micro_batch_size == 4 else c for c in layer.costs]
        layers.append(layer.model_copy(update={"costs": costs}))
    profile = base.model_copy(update={"layers": layers})
    result = plan(profile, load_cluster("local-mixed"),
                  PlanRequest(global_batch=16, morph=False, pipeline_parallel=1, tensor_parallel=1))
    homogeneous = next(c for c in result.candidates if c.device == "cpu")
    assert (homogeneous.micro_batch_size, homogeneous.micro_batches) == (4, 4)
    chosen = result.chosen
    assert chosen.device == "mixed" and chosen.micro_batch_size == 1
    assert {r.device: r.micro_batches for r in chosen.replicas} == {"cpu": 11, "cpu-slowed-2x": 5}


def test_a_split_on_one_host_is_priced_with_the_hosts_own_all_reduce_and_shared_cores():
    """local-mixed is one machine: the ring of its split runs at the profile's busy all-reduce
    after compute (measured on the host), not at the cluster's inter-node figures, and both ranks
    compute at the host's two-ranks-at-once slowdown."""
    from pipectl.artifacts.profile import RuntimeCosts

    runtime = RuntimeCosts(engine="deepspeed", forward_overhead_seconds=0, backward_overhead_seconds=0,
                           step_fixed_seconds=0, step_seconds_per_parameter=0, busy_allreduce_latency_seconds=0.01,
                           busy_allreduce_bandwidth_bytes_per_second=1e8, concurrent_compute_slowdown=1.5)
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1], device="cpu").model_copy(update={"runtime": runtime})
    cluster = load_cluster("local-mixed")
    request = PlanRequest(global_batch=16, morph=False, micro_batch_size=1, pipeline_parallel=1, tensor_parallel=1)
    alone = plan(profile, cluster.model_copy(update={"node_types": cluster.node_types[:1]}), request).chosen
    on_host = uneven_split(profile, cluster, alone, request)
    apart = uneven_split(profile, cluster.model_copy(update={"one_host": False}), alone, request)
    assert on_host.predicted_step_seconds > apart.predicted_step_seconds + 0.01  # the busy ring's latency at least


def test_a_layout_with_fewer_micro_batches_than_replicas_is_not_split():
    # B = 64 in micro-batches of 8 over 16 replicas (8 V100s + 8 P100s, one device each): 8 < 16.
    profile = synthetic_profile(blocks=8)
    cluster = load_cluster("mixed-v100-p100")
    template = plan(profile, cluster.model_copy(update={"node_types": cluster.node_types[:1]}),
                    PlanRequest(global_batch=64, morph=False, micro_batch_size=8, pipeline_parallel=1, tensor_parallel=1)).chosen
    assert uneven_split(profile, cluster, template, PlanRequest(global_batch=64)) is None
    assert plan(profile, cluster, PlanRequest(global_batch=64, workers=1)).chosen.global_batch == 64


def test_tensor_groups_spanning_two_vms_are_split_over_kinds_too():
    # mixed-v100-p100: 4 GPUs a VM, so t = 8 is a tensor group over two VMs of one kind.
    profile = synthetic_profile(blocks=8)
    cluster = load_cluster("mixed-v100-p100")
    template = plan(profile, cluster.model_copy(update={"node_types": cluster.node_types[:1]}),
                    PlanRequest(global_batch=64, morph=False, pipeline_parallel=1, tensor_parallel=8)).chosen
    split = uneven_split(profile, cluster, template, PlanRequest(global_batch=64))
    assert split is not None and split.tensor_parallel == 8
    assert sorted(share.device for share in split.replicas) == ["p100", "v100-16gb"]
    assert sum(share.samples for share in split.replicas) == 64


def test_kinds_with_different_replica_counts_split_without_failing_validation(tmp_path):
    """GPT-2 2.5B over 2 V100 nodes and 1 P100 node, each kind priced with its own derived profile:
    the split's slowest replica (a P100 one, with few micro-batches) is summarised at its own m,
    never as a homogeneous record of d_total replicas, whose even shares failed Candidate's check
    (a traceback from pipectl plan)."""
    from pipectl.catalog import get_device
    from pipectl.models.registry import load_model_config
    from pipectl.profile.derive import derive_profile

    config = load_model_config("gpt2-2.5b")
    v100, p100 = (derive_profile(config, get_device(kind), [1, 2, 4, 8]) for kind in ("v100-16gb", "p100"))
    cluster = _cluster(tmp_path, "v100-16gb", "p100", nodes=(2, 1))
    result = plan(v100, cluster, PlanRequest(global_batch=512, morph=False), kind_profiles=[p100])  # raised before
    split_note = [n for n in result.notes if "uneven split over p100, v100-16gb" in n]
    assert split_note, result.notes  # the split was priced (chosen or not, the note says how it compares)
    assert result.chosen.global_batch == 512


def test_a_splits_tensor_parallel_all_reduces_stay_on_each_kinds_own_links(tmp_path):
    # t = 2 inside a node of 4: its all-reduces never leave the node, so a slow link between the
    # kinds' nodes slows the split's data-parallel ring only, not its forward and backward.
    cluster = _cluster(tmp_path, "v100-32gb", "v100-16gb")
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2, 4], device="v100-16gb")
    template = plan(profile, cluster.model_copy(update={"node_types": cluster.node_types[:1]}),
                    PlanRequest(global_batch=64, morph=False, tensor_parallel=2, pipeline_parallel=1)).chosen
    from pipectl.plan.hetero import replica_stage_costs

    costs = {}
    for name, gbytes in (("fast", 100.0), ("slow", 0.1)):
        split = uneven_split(profile, _with_links(cluster, inter_node_bandwidth_gbytes_per_second=gbytes), template,
                             PlanRequest(global_batch=64))
        assert split is not None and split.tensor_parallel == 2
        costs[name] = replica_stage_costs(split, profile, _with_links(cluster, inter_node_bandwidth_gbytes_per_second=gbytes))
    for (_, _, fast), (_, _, slow) in zip(costs["fast"], costs["slow"]):
        assert list(slow.forward_seconds) == list(fast.forward_seconds)
        assert list(slow.backward_seconds) == list(fast.backward_seconds)
        assert slow.allreduce_seconds[0] > fast.allreduce_seconds[0]


def test_simulate_re_prices_uneven_replicas_of_one_kind_as_the_plan_did(tmp_path):
    # d = 3 replicas of t = 2 share B / b = 8 micro-batches as 3, 3, 2: one kind, one pool on the
    # node's own links (before, its tensor-parallel all-reduces were priced on the inter-node link).
    from pipectl.plan.hetero import replica_stage_costs
    from pipectl.plan.simulate import simulate_step_seconds
    from pipectl.schedule import generate

    cluster = load_cluster("a100-8x8")
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2], device="a100-80gb")
    chosen = plan(profile, cluster, PlanRequest(global_batch=16, morph=False, tensor_parallel=2, pipeline_parallel=2,
                                                data_parallel=3, micro_batch_size=2)).chosen
    groups = replica_stage_costs(chosen, profile, cluster)
    assert [m for _, m, _ in groups] == [3, 2]
    steps = [simulate_step_seconds(generate(chosen.schedule, 2, m, chosen.chunks, chosen.recompute), costs)
             for _, m, costs in groups]
    assert max(steps) == pytest.approx(chosen.predicted_step_seconds, rel=1e-9)


def test_devices_and_a_pinned_d_bound_a_split_and_its_count_is_in_the_morph_table():
    # local-mixed: one CPU rank and one emulated twice as slow (2 devices in all).
    from pipectl.errors import UserInputError

    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2, 4], device="cpu")
    cluster = load_cluster("local-mixed")
    with pytest.raises(UserInputError, match="--devices 3 is more than the cluster's 2 devices"):
        plan(profile, cluster, PlanRequest(global_batch=16, devices=3))
    assert plan(profile, cluster, PlanRequest(global_batch=16, devices=1, morph=False)).chosen.devices == 1  # was 2
    pinned = plan(profile, cluster, PlanRequest(global_batch=16, data_parallel=2, morph=False)).chosen
    assert pinned.device == "mixed" and pinned.data_parallel == 2  # was refused: "need more than the 1 device"
    whole = plan(profile, cluster, PlanRequest(global_batch=16))
    entry = whole.for_devices(2)
    assert entry is not None and entry.candidate == whole.chosen  # was missing: the table stopped at 1
