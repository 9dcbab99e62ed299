"""Selective recomputation inside pipectl's transformer block: the attention core runs again in
the backward, the gradients are those of keeping it, and only its saved tensors are freed."""

from __future__ import annotations

import pytest
import torch

from pipectl.models import transformer
from pipectl.models.hf import HFDecoderLayer
from pipectl.models.tensor_parallel import TensorParallelBlock
from pipectl.models.transformer import TransformerBlock
from pipectl.runtime.engines.pipeline import _recomputes_selectively


@pytest.fixture
def core_calls(monkeypatch):
    """How often the attention core ran (forward and recomputation), counted around the real one."""
    calls = [0]
    real = transformer.attention_core

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(transformer, "attention_core", counted)
    return calls


def _saved_bytes(fn) -> int:
    """Bytes autograd saves while `fn` runs, each storage once."""
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return out, sum(seen.values())


@pytest.mark.parametrize("causal", [True, False])
def test_the_core_runs_again_in_the_backward_and_the_gradients_are_unchanged(causal, core_calls):
    torch.manual_seed(0)
    block = TransformerBlock(64, 4, causal=causal)
    x = torch.randn(2, 32, 64, requires_grad=True)
    results = {}
    for selective in (False, True):
        block.selective_recompute = selective
        block.zero_grad(set_to_none=True)
        x.grad = None
        core_calls[0] = 0
        y = block(x)
        y.square().mean().backward()
        grads = [x.grad.clone(), *(p.grad.clone() for p in block.parameters())]
        results[selective] = (y.detach(), grads, core_calls[0])
    (kept, kept_grads, kept_calls), (recomputed, recomputed_grads, recomputed_calls) = results[False], results[True]
    assert (kept_calls, recomputed_calls) == (1, 2)
    assert torch.equal(kept, recomputed)
    for a, b in zip(kept_grads, recomputed_grads):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)


def test_only_the_cores_own_saved_tensors_are_freed():
    torch.manual_seed(0)
    block = TransformerBlock(64, 4)
    x = torch.randn(2, 32, 64, requires_grad=True)
    _, kept = _saved_bytes(lambda: block(x))
    block.selective_recompute = True
    _, selective = _saved_bytes(lambda: block(x))
    # CPU flash attention keeps its fp32 log-sum-exp (b x heads x s); q, k, v (views of the QKV
    # output) and the output (which proj reads as a view) are kept by the block anyway.
    assert kept - selective == 2 * 4 * 32 * 4


def test_without_gradients_the_core_runs_once(core_calls):
    block = TransformerBlock(64, 4)
    block.selective_recompute = True
    with torch.no_grad():
        block(torch.randn(1, 8, 64))
    assert core_calls[0] == 1


def test_pipectls_blocks_recompute_selectively_and_hugging_face_blocks_do_not():
    assert _recomputes_selectively(TransformerBlock) and _recomputes_selectively(TensorParallelBlock)
    assert not _recomputes_selectively(HFDecoderLayer)


def test_a_tensor_parallel_shard_recomputes_its_local_heads_core_with_the_same_gradients(core_calls):
    from pipectl.models.tensor_parallel import TensorParallelGroup

    torch.manual_seed(0)
    shard = TensorParallelBlock(64, 4, 4, True, tensor_group=TensorParallelGroup.without_communication(2, rank=1))
    x = torch.randn(2, 16, 64, requires_grad=True)
    grads = {}
    for selective in (False, True):
        shard.selective_recompute = selective
        shard.zero_grad(set_to_none=True)
        x.grad = None
        core_calls[0] = 0
        shard(x).square().mean().backward()
        grads[selective] = ([x.grad.clone(), *(p.grad.clone() for p in shard.parameters())], core_calls[0])
    assert (grads[False][1], grads[True][1]) == (1, 2)
    for a, b in zip(grads[False][0], grads[True][0]):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)
