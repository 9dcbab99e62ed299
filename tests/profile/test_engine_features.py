"""Another engine's features in the compute model and in derived profiles (`EngineFeatures`):
sequence parallelism, fused element-wise kernels, vocabulary-parallel embedding and head."""

from __future__ import annotations

import pytest

from pipectl.artifacts.model import ModelConfig
from pipectl.artifacts.profile import EngineFeatures
from pipectl.catalog import get_device
from pipectl.profile.compute_model import (
    BlockShape,
    ComputeDevice,
    block_backward_kernels,
    block_forward_kernels,
)
from pipectl.profile.block_memory import block_saved_bytes
from pipectl.profile.derive import derive_profile

H100 = ComputeDevice.of(get_device("h100-80gb"), "bfloat16")
MEGATRON = EngineFeatures(name="megatron-core", sequence_parallel=True, vocab_parallel=True, fused_elementwise=True)
GPT = ModelConfig(name="g", family="gpt", shape_only=True, layers=2, hidden=4096, heads=32, seq_len=4096,
                  vocab=131072, tied_embeddings=False)
LLAMA = ModelConfig(name="l", family="gpt", shape_only=True, layers=2, hidden=4096, heads=32, kv_heads=8,
                    ffn_hidden=14336, activation="swiglu", norm="rms", linear_bias=False, rotary=True,
                    seq_len=4096, vocab=128256, tied_embeddings=False)


def _seconds(kernels, name):
    return sum(k.seconds for k in kernels if k.name == name)


def test_sequence_parallel_divides_the_norms_saved_bytes_by_t():
    # Korthikanti et al. 2022: the whole 4 b s h 16-bit tensors and the fp32 statistics of the
    # two LayerNorms become 1/t of the sequence; the split tensors are unchanged.
    plain = BlockShape(4096, 32, 4096, 1, tensor_parallel=8)
    sp = BlockShape(4096, 32, 4096, 1, tensor_parallel=8, sequence_parallel=True)
    T, h = 4096, 4096
    whole = 4 * T * h * 2 + 2 * 2 * T * 4
    assert block_saved_bytes(plain, 2) - block_saved_bytes(sp, 2) == whole - whole // 8
    assert sp.norm_tokens == T // 8
    # At t = 1 sequence parallelism changes nothing.
    assert block_saved_bytes(BlockShape(4096, 32, 4096, 1, sequence_parallel=True), 2) == block_saved_bytes(
        BlockShape(4096, 32, 4096, 1), 2)


def test_sequence_parallel_runs_the_norms_and_residual_adds_on_s_over_t_tokens():
    plain = block_forward_kernels(BlockShape(4096, 32, 4096, 1, tensor_parallel=8), H100)
    sp = block_forward_kernels(BlockShape(4096, 32, 4096, 1, tensor_parallel=8, sequence_parallel=True), H100)
    for name in ("layer norm", "residual add"):
        assert _seconds(sp, name) == pytest.approx(_seconds(plain, name) / 8)
    # The GEMMs and attention see the whole sequence either way.
    assert _seconds(sp, "fc1") == _seconds(plain, "fc1")


def test_fused_kernels_replace_eager_rms_norm_rotary_swiglu_and_gradient_accumulation():
    shape = dict(hidden=4096, heads=32, seq_len=4096, micro_batch_size=1, tensor_parallel=8, kv_heads=8,
                 ffn_hidden=14336, activation="swiglu", rms_norm=True, bias=False, rotary=True)
    eager = BlockShape(**shape)
    fused = BlockShape(**shape, fused=True, accumulation_fused=True)
    eager_names = {k.name for k in block_forward_kernels(eager, H100) + block_backward_kernels(eager, H100)}
    fused_kernels = block_forward_kernels(fused, H100) + block_backward_kernels(fused, H100)
    fused_names = {k.name for k in fused_kernels}
    assert "rms norm: to fp32" in eager_names and "rms norm: to fp32" not in fused_names
    assert "gradient accumulation" in eager_names and "gradient accumulation" not in fused_names
    assert {"swiglu", "gate, up", "qkv"} <= fused_names
    # One RMSNorm kernel reads and writes b s h in 16-bit.
    assert _seconds(fused_kernels, "rms norm") == pytest.approx(2 * 2 * (4096 * 4096 * 2) / H100.memory_bytes_per_second)
    # The same GEMM FLOPs, less element-wise time.
    assert sum(k.flops for k in fused_kernels) == pytest.approx(
        sum(k.flops for k in block_forward_kernels(eager, H100) + block_backward_kernels(eager, H100)))
    assert sum(k.seconds for k in fused_kernels) < sum(
        k.seconds for k in block_forward_kernels(eager, H100) + block_backward_kernels(eager, H100))


def test_vocab_parallel_profile_splits_embedding_and_head_by_vocabulary():
    plain = derive_profile(GPT, "h100-80gb", [1, 2])
    megatron = derive_profile(GPT, "h100-80gb", [1, 2], engine=MEGATRON)
    assert plain.engine is None and megatron.engine == MEGATRON
    embed, head = megatron.layers[0], megatron.layers[-1]
    assert [layer.shards for layer in (plain.layers[0], plain.layers[-1])] == [[], []]
    V, h, s = 131072, 4096, 4096
    for t in (2, 4, 8):
        assert embed.shard(t).parameter_count == V // t * h + s * h  # learned positions stay whole
        assert head.shard(t).parameter_count == V // t * h
        # The head's logits and its fp32 log-softmax are 1/t per rank.
        assert head.shard(t).costs[0].output_activation_bytes == s * V // t * 2
        assert head.shard(t).costs[0].forward_seconds < head.costs[0].forward_seconds / t * 1.1


def test_sequence_parallel_profile_sends_s_over_t_and_splits_the_final_norm():
    megatron = derive_profile(GPT, "h100-80gb", [1], engine=MEGATRON)
    plain = derive_profile(GPT, "h100-80gb", [1])
    block, norm = megatron.layers[1], megatron.layers[-2]
    assert block.shard(8).costs[0].output_activation_bytes == 4096 * 4096 * 2 // 8
    assert plain.layers[1].shard(8).costs[0].output_activation_bytes == 4096 * 4096 * 2
    assert norm.shard(8).costs[0].forward_seconds < norm.costs[0].forward_seconds
    assert block.shard(8).costs[0].saved_activation_bytes < plain.layers[1].shard(8).costs[0].saved_activation_bytes


def test_fused_llama_block_is_faster_than_eager_and_runnable_flag():
    eager = derive_profile(LLAMA, "h100-80gb", [1])
    fused = derive_profile(LLAMA, "h100-80gb", [1], engine=EngineFeatures(name="e", fused_elementwise=True))
    assert fused.layers[1].costs[0].forward_seconds < eager.layers[1].costs[0].forward_seconds
    assert not fused.engine.runnable_by_pipectl
    assert EngineFeatures(name="nothing").runnable_by_pipectl
