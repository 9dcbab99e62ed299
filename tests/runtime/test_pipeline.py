"""Cutting the model at the plan's ranges, and initialisation that does not depend on the cut."""

from __future__ import annotations

import pytest
import torch

from pipectl.errors import UserInputError
from pipectl.models import build_model
from pipectl.plan.placement import ranks_share_node, replicas_share_node
from pipectl.runtime.engines.pipeline import SeededTiedLayerSpec, layer_specs, planned_topology, stage_boundaries


def test_boundaries_are_the_range_starts_plus_the_layer_count():
    assert stage_boundaries([(0, 9)], 9) == [0, 9]
    assert stage_boundaries([[0, 2], [2, 5], [5, 9]], 9) == [0, 2, 5, 9]


@pytest.mark.parametrize(
    "ranges,message",
    [
        ([], "stage_layers is empty"),
        ([(0, 4), (5, 9)], "stage 0 ends at layer 4 but stage 1 starts at 5"),
        ([(1, 9)], "must start at layer 0, got 1"),
        ([(0, 4), (4, 8)], "ends at layer 8 but the model has 9 layers"),
        ([(0, 4), (4, 4), (4, 9)], r"stage 1 range \[4, 4\) holds no layer"),
        ([(0, 4, 9)], "is not a \\[start, end\\) pair"),
    ],
)
def test_bad_ranges_are_named(ranges, message):
    with pytest.raises(UserInputError, match=message):
        stage_boundaries(ranges, 9)


def test_each_layer_is_built_from_its_own_seed_whatever_was_built_before():
    model = build_model("gpt-tiny")
    specs = layer_specs(model, seed=3)
    alone = specs[5].build()  # as a stage starting at layer 5 would
    for spec in specs[:5]:
        spec.build()  # as a stage holding layers 0..4 first would
    after_others = specs[5].build()
    for a, b in zip(alone.parameters(), after_others.parameters()):
        assert torch.equal(a, b)
    other_seed = layer_specs(model, seed=4)[5].build()
    assert not torch.equal(alone.qkv.weight, other_seed.qkv.weight)


def test_global_rng_is_left_untouched():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    for spec in layer_specs(build_model("gpt-tiny"), seed=0):
        spec.build()
    assert torch.equal(torch.rand(3), expected)


def test_tied_layers_share_the_first_holders_seed():
    specs = layer_specs(build_model("gpt-tiny"), seed=0)
    tied = [s for s in specs if isinstance(s, SeededTiedLayerSpec)]
    assert [s.key for s in tied] == ["embed", "embed"]
    assert tied[0].seed == tied[1].seed == 0
    assert torch.equal(tied[0].build().weight, tied[1].build().weight)


def test_docstring_examples_hold():
    import doctest

    import pipectl.models.tensor_parallel
    import pipectl.runtime.data
    import pipectl.runtime.engines.pipeline

    for module in (pipectl.runtime.engines.pipeline, pipectl.runtime.data, pipectl.models.tensor_parallel):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


@pytest.mark.parametrize("p, d, t", [(2, 2, 1), (4, 3, 1), (2, 2, 2), (3, 4, 2), (1, 8, 1), (8, 1, 1), (2, 2, 16), (3, 2, 8)])
@pytest.mark.parametrize("devices_per_node", [1, 2, 4, 8])
def test_ranks_sit_where_the_planner_priced_them(p, d, t, devices_per_node):
    """Ranks numbered node by node (every launcher): the nodes the runtime's topology gives each
    (replica, stage) agree with the planner's placement of pipeline neighbours and of a stage's ring."""
    topology = planned_topology(p, d, t)

    def node(replica: int, stage: int) -> int:
        coords = {"data": replica, "pipe": stage} | ({"model": 0} if t > 1 else {})
        return topology.get_rank(**coords) // devices_per_node

    for a in range(p):
        for b in range(p):
            runtime = all(node(r, a) == node(r, b) for r in range(d))
            assert runtime == ranks_share_node(a, b, p, t, d, devices_per_node), (a, b)
        ring = {node(r, a) for r in range(d)}
        assert (len(ring) == 1) == replicas_share_node(a, p, t, d, devices_per_node), a


def test_a_tensor_group_spanning_nodes_takes_whole_nodes():
    # t = 16 on 8-device nodes (the planner's `tensor_parallel_placeable`): each group is two nodes.
    topology = planned_topology(pipeline_parallel=2, data_parallel=2, tensor_parallel=16)
    groups = topology.get_axis_comm_lists("model")
    assert sorted(sorted({rank // 8 for rank in group}) for group in groups) == [[2 * i, 2 * i + 1] for i in range(4)]


def test_a_replicas_ranks_are_consecutive_and_its_tensor_groups_inside():
    topology = planned_topology(pipeline_parallel=2, data_parallel=3, tensor_parallel=2)
    for replica in range(3):
        ranks = sorted(topology.filter_match(data=replica))
        assert ranks == list(range(replica * 4, replica * 4 + 4))
    assert topology.get_axis_comm_lists("model") == [[2 * i, 2 * i + 1] for i in range(6)]


def test_skipping_random_init_leaves_draws_out_and_keeps_everything_else():
    import torch

    from pipectl.runtime.engines.pipeline import SkipRandomInit

    tensor = torch.full((4, 4), 7.0)
    with SkipRandomInit():
        torch.nn.init.normal_(tensor, std=0.02)
        torch.nn.init.kaiming_uniform_(tensor)
        tensor.uniform_()
        assert torch.equal(tensor, torch.full((4, 4), 7.0))  # no draw happened
        torch.nn.init.zeros_(tensor[0])  # deterministic initialisers still run
        linear = torch.nn.Linear(4, 4)  # reset_parameters draws nothing, and nothing fails
    assert torch.equal(tensor[0], torch.zeros(4)) and linear.weight.shape == (4, 4)
    drawn = torch.empty(3).normal_()  # outside the mode, draws as usual
    assert not torch.equal(drawn, torch.zeros(3))
