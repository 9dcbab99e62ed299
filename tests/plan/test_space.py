"""The search space's tensor-parallel degrees: inside a node, and tensor groups spanning whole nodes."""

from __future__ import annotations

import pytest

from pipectl.artifacts.plan import PlanRequest
from pipectl.catalog import get_device
from pipectl.cluster import load_cluster, local_cluster
from pipectl.errors import UserInputError
from pipectl.models.registry import load_model_config
from pipectl.plan.candidates import Rejection
from pipectl.plan.costs import hardware_for
from pipectl.plan.search import plan
from pipectl.plan.space import search_space
from pipectl.testing.profiles import synthetic_profile
from pipectl.profile.derive import derive_profile


def _degrees(cluster, profile, **request) -> tuple[int, ...]:
    return search_space(PlanRequest(global_batch=64, **request), profile, hardware_for(cluster, profile)).tensor_parallel


def test_the_default_search_adds_one_tensor_group_spanning_two_nodes():
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1], hidden=64)
    assert _degrees(load_cluster("a100-8x8"), profile) == (1, 2, 4, 8, 16)
    assert _degrees(load_cluster("a100-384x8"), profile) == (1, 2, 4, 8, 16)
    # --max-tensor-parallel opens more (24 does not tile the 64 devices), or keeps t in a node.
    assert _degrees(load_cluster("a100-8x8"), profile, max_tensor_parallel=32) == (1, 2, 4, 8, 16, 32)
    assert _degrees(load_cluster("a100-8x8"), profile, max_tensor_parallel=8) == (1, 2, 4, 8)
    # The model must split at t: hidden 40 splits 2, 4, 8 ways, not 16.
    assert _degrees(load_cluster("a100-8x8"), synthetic_profile(blocks=4, micro_batch_sizes=[1], hidden=40)) == (1, 2, 4, 8)
    # One node: no group can span nodes.
    assert _degrees(local_cluster(4), synthetic_profile(blocks=4, micro_batch_sizes=[1], device="cpu")) == (1, 2, 4)


@pytest.fixture(scope="module")
def gpt3():
    return derive_profile(load_model_config("gpt3-175b"), get_device("a100-80gb"), [1, 2])


@pytest.mark.parametrize("cluster_name", ["a100-8x8", "a100-384x8"])
def test_tensor_groups_inside_a_node_beat_two_nodes_on_the_shipped_a100_clusters(gpt3, cluster_name):
    cluster = load_cluster(cluster_name)
    request = PlanRequest(global_batch=512, devices=64, morph=False, workers=1)
    assert 16 in search_space(request, gpt3, hardware_for(cluster, gpt3)).tensor_parallel
    best = plan(gpt3, cluster, request)
    pinned = plan(gpt3, cluster, request.model_copy(update={"tensor_parallel": 16}))
    # The costs decide: 16-way blocks do half an 8-way rank's work, but their four all-reduces a
    # block wait on InfiniBand (8 x 25 GB/s a node) instead of NVLink (300 GB/s).
    assert best.chosen.tensor_parallel <= 8
    assert pinned.chosen.tensor_parallel == 16 and pinned.chosen.devices % 16 == 0
    assert best.chosen.predicted_step_seconds < pinned.chosen.predicted_step_seconds


def test_tensor_parallel_16_on_8_device_nodes_plans():
    profile = synthetic_profile(blocks=8, micro_batch_sizes=[1, 2], hidden=64)
    result = plan(profile, load_cluster("a100-8x8"), PlanRequest(global_batch=32, tensor_parallel=16, morph=False))
    assert {c.tensor_parallel for c in [result.chosen, *result.candidates]} == {16}


@pytest.mark.parametrize("t", [3, 12, 20])
def test_a_degree_neither_dividing_a_node_nor_spanning_whole_nodes_is_refused(t):
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1], hidden=240)
    with pytest.raises(UserInputError, match=f"tensor-parallel degree {t} neither divides the 8 devices of a node"):
        plan(profile, load_cluster("a100-8x8"), PlanRequest(global_batch=32, tensor_parallel=t))


def test_a_spanning_degree_the_profile_has_no_shards_for_is_a_counted_rejection():
    profile = derive_profile(load_model_config("gpt3-175b"), get_device("a100-80gb"), [1], tensor_parallel=(2, 4, 8))
    assert profile.shard_degrees() == [2, 4, 8]
    request = PlanRequest(global_batch=64, morph=False, workers=1)
    space = search_space(request, profile, hardware_for(load_cluster("a100-8x8"), profile))
    assert space.tensor_parallel == (1, 2, 4, 8) and space.unprofiled_tensor_parallel == (16,)
    result = plan(profile, load_cluster("a100-8x8"), request)
    assert result.infeasible[Rejection.TENSOR_PARALLEL_NOT_PROFILED.value] == 1
    with pytest.raises(UserInputError, match="tensor-parallel degree 16 has no shard costs in the profile"):
        plan(profile, load_cluster("a100-8x8"), request.model_copy(update={"tensor_parallel": 16}))
