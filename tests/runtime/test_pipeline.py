"""Cutting the model at the plan's ranges, and initialisation that does not depend on the cut."""

from __future__ import annotations

import pytest
import torch

from pipectl.errors import UserInputError
from pipectl.models import build_model
from pipectl.runtime.pipeline import SeededTiedLayerSpec, layer_specs, stage_boundaries


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
    import pipectl.runtime.pipeline

    for module in (pipectl.runtime.pipeline, pipectl.runtime.data, pipectl.models.tensor_parallel):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
