"""Megatron-style tensor parallelism for the built-in transformer blocks.

Shoeybi et al., "Megatron-LM" (2019), §3, and Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM" (PTD-P, 2021), §2.3: inside a transformer block
the attention heads and the first MLP matrix are split by columns (each of the t ranks holds
heads/t heads and 4h/t MLP columns), the attention output projection and the second MLP matrix
by rows. Each of the two halves then needs one all-reduce in the forward pass (after the
row-parallel matrix: `_ReduceFromTensorGroup`) and one in the backward pass (at the input of the
column-parallel matrix: `_CopyToTensorGroup`) -- two and two per block.

    x ──f──► [LN → QKV(col) → attention(heads/t) → proj(row)] ──g──► + x ──f──► [LN → fc_in(col)
    → GeLU → fc_out(row)] ──g──► + x          f: identity fwd / all-reduce bwd
                                              g: all-reduce fwd / identity bwd

Embeddings, the final LayerNorm and the head stay replicated on every tensor rank (their inputs
and gradients are identical there, so they need no extra synchronisation).

Initialisation does not depend on t: a `TensorParallelBlock` builds the full `TransformerBlock`
from the RNG state its layer spec seeded, then keeps its rank's slices. So t=2 starts from the
t=1 weights and gives the t=1 losses (up to summation order).

    >>> shard_rows(torch.arange(12.).view(6, 2), parts=3, rank=1).tolist()
    [[4.0, 5.0], [6.0, 7.0]]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipectl.errors import UserInputError
from pipectl.models.base import ModelLayers
from pipectl.models.transformer import TransformerBlock


@dataclass(frozen=True)
class TensorParallelGroup:
    """This rank's tensor-parallel group: the process group handle, its rank in it and its size."""

    group: Any
    rank: int
    size: int


def new_tensor_parallel_groups(topology) -> TensorParallelGroup:
    """Create one process group per tensor-parallel slice of a DeepSpeed topology (axis 'model').

    Collective: every rank must call it, in the same order (torch.distributed.new_group).
    """
    mine = None
    me = dist.get_rank()
    for ranks in topology.get_axis_comm_lists("model"):
        group = dist.new_group(ranks=ranks)
        if me in ranks:
            mine = TensorParallelGroup(group, ranks.index(me), len(ranks))
    if mine is None:
        raise UserInputError("the topology has no 'model' axis: build it with PipeModelDataParallelTopology")
    return mine


class _CopyToTensorGroup(torch.autograd.Function):
    """f: identity forward; all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorGroup(torch.autograd.Function):
    """g: all-reduce of the partial outputs forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def shard_rows(tensor: torch.Tensor, parts: int, rank: int) -> torch.Tensor:
    """Rank's contiguous block of rows (dim 0) out of `parts` equal blocks."""
    if tensor.shape[0] % parts:
        raise UserInputError(f"dimension {tensor.shape[0]} is not divisible by tensor-parallel degree {parts}")
    size = tensor.shape[0] // parts
    return tensor[rank * size : (rank + 1) * size]


def _sharded(tensor: torch.Tensor) -> nn.Parameter:
    parameter = nn.Parameter(tensor.detach().clone().contiguous())
    # DeepSpeed counts such a parameter on every tensor rank in the gradient norm.
    parameter.tensor_model_parallel = True
    return parameter


class TensorParallelBlock(nn.Module):
    """A pre-LN transformer block split over a tensor-parallel group (same maths as TransformerBlock)."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        ffn_multiplier: int = 4,
        causal: bool = True,
        tensor_group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        if tensor_group is None:
            raise UserInputError("TensorParallelBlock needs its tensor-parallel group")
        t, rank = tensor_group.size, tensor_group.rank
        if heads % t:
            raise UserInputError(f"{heads} attention heads are not divisible by tensor-parallel degree {t}")
        full = TransformerBlock(hidden, heads, ffn_multiplier, causal)  # the t=1 initialisation
        self.group = tensor_group.group
        self.causal = causal
        self.local_heads = heads // t
        self.head_dim = hidden // heads
        self.ln_attn = full.ln_attn
        self.ln_mlp = full.ln_mlp
        # QKV rows are [q; k; v], each head-major: take this rank's heads from each of the three.
        q, k, v = full.qkv.weight.split(hidden)
        qb, kb, vb = full.qkv.bias.split(hidden)
        self.qkv_weight = _sharded(torch.cat([shard_rows(w, t, rank) for w in (q, k, v)]))
        self.qkv_bias = _sharded(torch.cat([shard_rows(b, t, rank) for b in (qb, kb, vb)]))
        self.proj_weight = _sharded(shard_rows(full.proj.weight.t(), t, rank).t())
        self.proj_bias = nn.Parameter(full.proj.bias.detach().clone())  # added once, after the reduce
        self.fc_in_weight = _sharded(shard_rows(full.fc_in.weight, t, rank))
        self.fc_in_bias = _sharded(shard_rows(full.fc_in.bias, t, rank))
        self.fc_out_weight = _sharded(shard_rows(full.fc_out.weight.t(), t, rank).t())
        self.fc_out_bias = nn.Parameter(full.fc_out.bias.detach().clone())

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        x = _CopyToTensorGroup.apply(x, self.group)
        local = self.local_heads * self.head_dim
        q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split(local, dim=-1)
        shape = (b, s, self.local_heads, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        partial = F.linear(out.transpose(1, 2).reshape(b, s, local), self.proj_weight)
        return _ReduceFromTensorGroup.apply(partial, self.group) + self.proj_bias

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTensorGroup.apply(x, self.group)
        partial = F.linear(F.gelu(F.linear(x, self.fc_in_weight, self.fc_in_bias)), self.fc_out_weight)
        return _ReduceFromTensorGroup.apply(partial, self.group) + self.fc_out_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


def shard_model(model: ModelLayers, tensor_group: TensorParallelGroup) -> ModelLayers:
    """The same layer list with every transformer block replaced by its tensor-parallel version.

    Layer names, order and count are unchanged, so the plan's cut and the per-layer seeds apply.
    """
    if tensor_group.size == 1:
        return model
    layers = []
    for layer in model.layers:
        if layer.module_cls is TransformerBlock:
            layer = replace(
                layer,
                module_cls=TensorParallelBlock,
                kwargs={**layer.kwargs, "tensor_group": tensor_group},
            )
        layers.append(layer)
    if not any(layer.module_cls is TensorParallelBlock for layer in layers):
        raise UserInputError(f"model {model.name} has no transformer blocks to split over {tensor_group.size} ranks")
    return replace(model, layers=layers)
