"""Megatron-style tensor parallelism: t=2 (alone and inside a 2-stage pipeline) gives the t=1
losses on the same global batch; the sharding keeps the layer list and refuses bad splits."""

from __future__ import annotations

import pytest
import torch

from pipectl.errors import UserInputError
from pipectl.models import build_model
from pipectl.models.tensor_parallel import (
    TensorParallelBlock,
    TensorParallelGroup,
    shard_model,
    shard_rows,
)
from pipectl.models.transformer import TransformerBlock
from pipectl.artifacts.layout import Layout
from pipectl.runtime.job import TrainingJob
from pipectl.runtime.worker import spawn_ranks
from pipectl.schedule.ir import ScheduleKind
from builders import training_config

STEPS = 8


def test_shard_rows_takes_the_ranks_block():
    weight = torch.arange(24.0).view(8, 3)
    assert torch.equal(torch.cat([shard_rows(weight, 4, r) for r in range(4)]), weight)
    with pytest.raises(UserInputError, match="dimension 8 is not divisible by tensor-parallel degree 3"):
        shard_rows(weight, 3, 0)


def test_shard_model_swaps_only_the_blocks_and_keeps_names_and_seeds_in_place():
    model = build_model("gpt-tiny")
    group = TensorParallelGroup(group=None, rank=0, size=2)
    sharded = shard_model(model, group)
    assert [layer.name for layer in sharded.layers] == [layer.name for layer in model.layers]
    kinds = [layer.module_cls for layer in sharded.layers]
    assert kinds.count(TensorParallelBlock) == 6 and TransformerBlock not in kinds
    assert shard_model(model, TensorParallelGroup(None, 0, 1)) is model
    with pytest.raises(UserInputError, match="has no transformer blocks"):
        shard_model(build_model("mlp-tiny"), group)


def test_heads_must_divide_over_the_group():
    with pytest.raises(UserInputError, match="4 attention heads are not divisible by tensor-parallel degree 3"):
        TensorParallelBlock(64, 4, 4, True, tensor_group=TensorParallelGroup(None, 0, 3))


def test_shards_are_slices_of_the_unsplit_block():
    torch.manual_seed(0)
    full = TransformerBlock(64, 4, 4, True)
    shards = []
    for rank in range(2):
        torch.manual_seed(0)
        shards.append(TensorParallelBlock(64, 4, 4, True, tensor_group=TensorParallelGroup(None, rank, 2)))
    assert torch.equal(torch.cat([s.fc_in.weight for s in shards]), full.fc_in.weight)
    assert torch.equal(torch.cat([s.proj.weight for s in shards], dim=1), full.proj.weight)
    q_rows = torch.cat([s.qkv.weight[:32] for s in shards])  # each shard: [q; k; v] of its 2 heads
    assert torch.equal(q_rows, full.qkv.weight[:64])
    assert all(getattr(s.fc_out.weight, "tensor_model_parallel", False) for s in shards)
    assert not getattr(shards[0].fc_out.bias, "tensor_model_parallel", False)


def _job(layout: Layout) -> TrainingJob:
    return TrainingJob("gpt-tiny", layout, training_config(layout), steps=STEPS, seed=1)


@pytest.mark.multiprocess
def test_t2_gives_the_t1_losses_alone_and_in_a_pipeline():
    reference = spawn_ranks(_job(Layout(1, 1, 2, 4, ((0, 9),))))[0].losses
    layouts = [
        Layout(1, 1, 2, 4, ((0, 9),), tensor_parallel=2),
        Layout(2, 1, 2, 4, ((0, 5), (5, 9)), ScheduleKind.GPIPE, tensor_parallel=2),
    ]
    for layout in layouts:
        outcomes = spawn_ranks(_job(layout), timeout_seconds=180)
        assert len(outcomes) == layout.world_size
        for rank, outcome in outcomes.items():
            for step, (got, want) in enumerate(zip(outcome.losses, reference, strict=True), start=1):
                assert abs(got - want) <= 1e-4 * want, f"{layout.label()} rank {rank} step {step}: {got} vs {want}"
    assert reference[-1] < reference[0]


def test_split_block_names_its_parameters_like_the_unsplit_block():
    full = TransformerBlock(64, 4, 4, True)
    split = TensorParallelBlock(64, 4, 4, True, tensor_group=TensorParallelGroup(None, 1, 2))
    assert list(dict(split.named_parameters())) == list(dict(full.named_parameters()))
    shapes = {name: tuple(p.shape) for name, p in split.named_parameters()}
    assert shapes["qkv.weight"] == (96, 64) and shapes["proj.weight"] == (64, 32)
    assert shapes["proj.bias"] == (64,) and shapes["ln_attn.weight"] == (64,)
