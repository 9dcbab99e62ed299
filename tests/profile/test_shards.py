"""Tensor-parallel shard costs in profiles: the schema, measured shards (CPU, gpt-tiny) and derived
shards (the kernel model's `BlockShape(tensor_parallel=t)`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipectl.artifacts.profile import ModelProfile
from pipectl.catalog import get_device
from pipectl.errors import UserInputError
from pipectl.io import load_model, write_json_atomic
from pipectl.models import build_model
from pipectl.models.registry import load_model_config
from pipectl.models.tensor_parallel import TensorParallelBlock, TensorParallelGroup
from pipectl.models.transformer import TransformerBlock
from pipectl.profile.compute_model import (
    BlockShape,
    ComputeDevice,
    block_backward_kernels,
    block_forward_kernels,
    phase_seconds,
)
from pipectl.profile.block_memory import block_saved_bytes
from pipectl.profile.derive import derive_profile
from pipectl.profile.measure import profile_model

UNSHARDED = Path(__file__).parents[1] / "plan" / "data" / "gpt2-2.5b-a100-unsharded.profile.json"
# The parameters TensorParallelBlock splits over the group; the others it keeps whole on each rank.
SPLIT = {"qkv.weight", "qkv.bias", "proj.weight", "fc_in.weight", "fc_in.bias", "fc_out.weight"}


@pytest.fixture(scope="module")
def measured() -> ModelProfile:
    # gpt-tiny's blocks are tiny: the whole sweep, shards included, takes about a second on CPU.
    return profile_model(build_model("gpt-tiny"), [1, 2], warmup=1, repeats=2, runtime=False, tensor_parallel=[1, 2])


def test_a_profile_written_before_shards_loads_and_writes_back_byte_for_byte(tmp_path):
    profile = load_model(ModelProfile, UNSHARDED)
    assert not profile.has_shards and profile.shard_degrees() == []
    write_json_atomic(tmp_path / "again.json", profile)
    assert (tmp_path / "again.json").read_bytes() == UNSHARDED.read_bytes()


def test_shards_round_trip_through_the_file(tmp_path, measured):
    write_json_atomic(tmp_path / "profile.json", measured)
    again = load_model(ModelProfile, tmp_path / "profile.json")
    assert again == measured
    assert again.layers[1].shard(2) == measured.layers[1].shard(2) is not None


def test_measured_shards_hold_what_a_tensor_parallel_block_holds(measured):
    config = load_model_config("gpt-tiny")
    full = TransformerBlock(config.hidden, config.heads)
    expected = sum(p.numel() // 2 if name in SPLIT else p.numel() for name, p in full.named_parameters())
    rank = TensorParallelBlock(config.hidden, config.heads, tensor_group=TensorParallelGroup.without_communication(2))
    assert expected == sum(p.numel() for p in rank.parameters())
    for layer in measured.layers:
        if layer.kind != "transformer_block":
            assert layer.shards == []  # embeddings, final norm, head: replicated over the tensor group
            continue
        assert [s.tensor_parallel for s in layer.shards] == [2]  # t = 1 is the layer itself
        shard = layer.shard(2)
        assert shard.parameter_count == expected
        assert shard.parameter_bytes == 4 * expected  # float32
        assert shard.parameter_count > layer.parameter_count / 2  # LayerNorms and row biases whole


def test_measured_shard_costs_are_a_ranks_compute(measured):
    config = load_model_config("gpt-tiny")
    blocks = [layer for layer in measured.layers if layer.kind == "transformer_block"]
    for b in (1, 2):
        block, shard = blocks[0].cost(b), blocks[0].shard(2).cost(b)
        assert shard.output_activation_bytes == block.output_activation_bytes  # a whole b x s x h on every rank
        assert shard.forward_flops == block.forward_flops / 2  # every product splits in two
        # Saved bytes: the block's input and LayerNorm inputs whole, the rest halved; the kernel
        # model counts them tensor by tensor (fp32 here) and agrees to the byte.
        for t, cost in ((1, block), (2, shard)):
            shape = BlockShape(config.hidden, config.heads, config.seq_len, b, tensor_parallel=t)
            assert cost.saved_activation_bytes == block_saved_bytes(shape, 4), (t, b)
        assert block.saved_activation_bytes / 2 < shard.saved_activation_bytes < block.saved_activation_bytes
    # One instance of each distinct block is measured per t: the others carry its costs.
    assert all(layer.shard(2) == blocks[0].shard(2) for layer in blocks[1:])
    assert any("tensor-parallel shards (t = 2)" in note for note in measured.notes)


def test_no_shards_unless_asked():
    profile = profile_model(build_model("gpt-tiny"), [1], warmup=0, repeats=1, runtime=False)
    assert not profile.has_shards


@pytest.mark.parametrize(
    ("model", "degrees", "message"),
    [
        ("gpt-tiny", [1, 3], "4 attention heads are not divisible by tensor-parallel degree 3"),
        ("gpt-tiny", [0], "tensor-parallel degree 0 is not a positive integer"),
        ("mlp-tiny", [2], "has no transformer blocks to split"),
    ],
)
def test_bad_degrees_are_refused_before_measuring(model, degrees, message):
    with pytest.raises(UserInputError, match=message):
        profile_model(build_model(model), [1], warmup=0, repeats=1, runtime=False, tensor_parallel=degrees)


def test_no_communication_shards_sum_to_the_unsplit_halves():
    # Without communication a rank's attention and MLP return its partial sum (+ the whole bias):
    # the t ranks' partials add up to the unsplit block's, and no process group is needed.
    torch.manual_seed(0)
    full = TransformerBlock(64, 4)
    ranks = []
    for rank in range(2):
        torch.manual_seed(0)
        ranks.append(TensorParallelBlock(64, 4, tensor_group=TensorParallelGroup.without_communication(2, rank)))
    for module in (full, *ranks):  # biases start at zero: make them count
        for name in ("proj", "fc_out"):
            getattr(module, name).bias.data.fill_(0.5)
    x = torch.randn(2, 8, 64)
    unsplit = {"attention": full.attention, "mlp": lambda y: full.fc_out(torch.nn.functional.gelu(full.fc_in(y)))}
    for half, bias in (("attention", "proj"), ("mlp", "fc_out")):
        partials = sum(getattr(r, half)(x) for r in ranks) - getattr(full, bias).bias
        torch.testing.assert_close(partials, unsplit[half](x))
    with pytest.raises(UserInputError, match="no rank 2"):
        TensorParallelGroup.without_communication(2, rank=2)


def test_derived_shards_are_the_compute_models_block_shards():
    config = load_model_config("gpt-small")  # 12 heads: shards at t = 2 and 4, not 8
    profile = derive_profile(config, "h100-80gb", [1, 4])
    device = ComputeDevice.of(get_device("h100-80gb"), "bfloat16")
    block = profile.layers[1]
    assert [s.tensor_parallel for s in block.shards] == [2, 4]
    assert all(layer.shards == [] for layer in profile.layers if layer.kind != "transformer_block")
    for shard in block.shards:
        t = shard.tensor_parallel
        shape = BlockShape(config.hidden, config.heads, config.seq_len, 1, tensor_parallel=t)
        assert shard.parameter_count == sum(shape.parameter_tensors())
        for cost in shard.costs:
            shape = BlockShape(config.hidden, config.heads, config.seq_len, cost.micro_batch_size, tensor_parallel=t)
            assert cost.forward_seconds == phase_seconds(block_forward_kernels(shape, device), device)
            assert cost.backward_seconds == phase_seconds(block_backward_kernels(shape, device), device)
            assert cost.saved_activation_bytes == block_saved_bytes(shape, 2)
            assert cost.output_activation_bytes == block.cost(cost.micro_batch_size).output_activation_bytes
            # 16-bit: about 8 + 24/t bytes per token and hidden unit, not 32/t (a few fp32 statistics on top).
            per_unit = cost.saved_activation_bytes / (cost.micro_batch_size * config.seq_len * config.hidden)
            assert 8 + 24 / t <= per_unit < 8 + 24 / t + 0.1
    # A small shard is launch-bound: halving the work does not halve the time.
    t4 = block.shard(4).cost(1).forward_seconds
    assert t4 > block.cost(1).forward_seconds / 4


def test_derive_takes_the_degrees_asked_for():
    config = load_model_config("gpt-small")
    assert derive_profile(config, "h100-80gb", [1], tensor_parallel=()).has_shards is False
    assert derive_profile(config, "h100-80gb", [1], tensor_parallel=[1, 3, 4]).shard_degrees() == [3, 4]
