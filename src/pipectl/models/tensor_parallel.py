"""Megatron-style tensor parallelism for the built-in transformer blocks (and, through `ColumnSlice`
and `RowSlice`, for a Hugging Face decoder's own layers: `models.hf`).

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

Checkpoints do not depend on t either: the split block names its parameters like the unsplit one
(`qkv.weight` holds this rank's [q_r; k_r; v_r] rows), and each slice carries its `TensorSplit`,
which a checkpoint records to join the slices into the unsplit tensors and cut them again for
another t (`pipectl.runtime.checkpoint.shards`).

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
from pipectl.models.transformer import TransformerBlock, run_attention_core


@dataclass(frozen=True)
class TensorParallelGroup:
    """This rank's tensor-parallel group: the process group handle, its rank in it and its size.

    `communicate=False` (`without_communication`): a group of `size` ranks that exists only on
    paper. A block built with it holds rank `rank`'s shard and runs its compute, but its
    all-reduces are identities, so one process can time what one rank of a t-way group computes
    (`pipectl profile --tensor-parallel`); its outputs are partial sums, not the layer's. The
    planner prices the all-reduces from the links.
    """

    group: Any
    rank: int
    size: int
    communicate: bool = True

    @classmethod
    def without_communication(cls, size: int, rank: int = 0) -> "TensorParallelGroup":
        """Rank `rank` of a `size`-way group whose all-reduces are skipped (compute only)."""
        if size < 1 or not 0 <= rank < size:
            raise UserInputError(f"no rank {rank} in a tensor-parallel group of {size}")
        return cls(group=None, rank=rank, size=size, communicate=False)


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
        raise UserInputError("the topology has no 'model' axis: build it with runtime.engines.pipeline.planned_topology(p, d, t), t > 1")
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


@dataclass(frozen=True)
class TensorSplit:
    """How tensor parallelism splits a parameter: along `dim`, into t blocks of each of its `parts`
    sub-parameters (a fused QKV is 3 parts: rank r holds [q_r; k_r; v_r], not a third of [q; k; v]).
    Checkpoints record it per slice (`pipectl.runtime.checkpoint.shards`): `join` makes the unsplit tensor of
    the t slices a run wrote, `cut` the slice a rank of another t loads.

    >>> qkv = TensorSplit(dim=0, parts=3)
    >>> whole = torch.arange(12).view(6, 2)              # rows: q0 q1 k0 k1 v0 v1
    >>> qkv.cut(whole, tensor_parallel=2, rank=1)[:, 0].tolist()
    [2, 6, 10]
    >>> torch.equal(qkv.join([qkv.cut(whole, 2, r) for r in range(2)]), whole)
    True
    """

    dim: int
    parts: int = 1

    def cut(self, whole: torch.Tensor, tensor_parallel: int, rank: int) -> torch.Tensor:
        if tensor_parallel == 1:
            return whole
        size = whole.shape[self.dim]
        if size % (self.parts * tensor_parallel):
            raise UserInputError(
                f"a dimension of {size} does not split into {self.parts} x {tensor_parallel} tensor-parallel blocks"
            )
        blocks = [part.chunk(tensor_parallel, dim=self.dim)[rank] for part in whole.chunk(self.parts, dim=self.dim)]
        return torch.cat(blocks, dim=self.dim)

    def join(self, slices: list[torch.Tensor]) -> torch.Tensor:
        if len(slices) == 1:
            return slices[0]
        pieces = [piece.chunk(self.parts, dim=self.dim) for piece in slices]
        return torch.cat([pieces[r][part] for part in range(self.parts) for r in range(len(slices))], dim=self.dim)


COLUMNS = TensorSplit(dim=0)  # column-parallel: output features (weight rows, bias)
ROWS = TensorSplit(dim=1)  # row-parallel: input features (weight columns)
QKV = TensorSplit(dim=0, parts=3)  # q, k and v, each split by heads


def shard_rows(tensor: torch.Tensor, parts: int, rank: int) -> torch.Tensor:
    """Rank's contiguous block of rows (dim 0) out of `parts` equal blocks."""
    if tensor.shape[0] % parts:
        raise UserInputError(f"dimension {tensor.shape[0]} is not divisible by tensor-parallel degree {parts}")
    size = tensor.shape[0] // parts
    return tensor[rank * size : (rank + 1) * size]


def _sharded(tensor: torch.Tensor, split: TensorSplit) -> nn.Parameter:
    parameter = nn.Parameter(tensor.detach().clone().contiguous())
    # DeepSpeed counts such a parameter on every tensor rank in the gradient norm.
    parameter.tensor_model_parallel = True
    parameter.tensor_parallel_split = split  # how a checkpoint joins the slices and cuts them again
    return parameter


def _replicated(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.detach().clone())


class LinearSlice(nn.Module):
    """This rank's slice of an `nn.Linear`: holds `weight` and `bias` under nn.Linear's names.

    The block applies them itself (with F.linear, around the group's reductions); the module only
    gives the parameters the names `TransformerBlock` uses.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias


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
        self.communicate = tensor_group.communicate
        self.causal = causal
        self.selective_recompute = False  # as TransformerBlock's
        self.local_heads = heads // t
        self.head_dim = hidden // heads
        # Parameter names and order are those of TransformerBlock (`qkv.weight`, `proj.bias`, ...):
        # a checkpoint indexes parameters by name, so the same entry serves every t.
        self.ln_attn = full.ln_attn
        # QKV rows are [q; k; v], each head-major: take this rank's heads from each of the three.
        q, k, v = full.qkv.weight.split(hidden)
        qb, kb, vb = full.qkv.bias.split(hidden)
        self.qkv = LinearSlice(
            _sharded(torch.cat([shard_rows(w, t, rank) for w in (q, k, v)]), QKV),
            _sharded(torch.cat([shard_rows(b, t, rank) for b in (qb, kb, vb)]), QKV),
        )
        # Row-parallel: the bias is added once, after the reduce, so it stays whole and replicated.
        self.proj = LinearSlice(
            _sharded(shard_rows(full.proj.weight.t(), t, rank).t(), ROWS), _replicated(full.proj.bias)
        )
        self.ln_mlp = full.ln_mlp
        self.fc_in = LinearSlice(
            _sharded(shard_rows(full.fc_in.weight, t, rank), COLUMNS),
            _sharded(shard_rows(full.fc_in.bias, t, rank), COLUMNS),
        )
        self.fc_out = LinearSlice(
            _sharded(shard_rows(full.fc_out.weight.t(), t, rank).t(), ROWS), _replicated(full.fc_out.bias)
        )

    def _copy(self, x: torch.Tensor) -> torch.Tensor:
        """f: identity forward, all-reduce backward (identity both ways without communication)."""
        return _CopyToTensorGroup.apply(x, self.group) if self.communicate else x

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """g: all-reduce forward, identity backward (identity both ways without communication)."""
        return _ReduceFromTensorGroup.apply(x, self.group) if self.communicate else x

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        x = self._copy(x)
        local = self.local_heads * self.head_dim
        q, k, v = F.linear(x, self.qkv.weight, self.qkv.bias).split(local, dim=-1)
        shape = (b, s, self.local_heads, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        out = run_attention_core(q, k, v, self.causal, self.selective_recompute)
        partial = F.linear(out.transpose(1, 2).reshape(b, s, local), self.proj.weight)
        return self._reduce(partial) + self.proj.bias

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        x = self._copy(x)
        partial = F.linear(F.gelu(F.linear(x, self.fc_in.weight, self.fc_in.bias)), self.fc_out.weight)
        return self._reduce(partial) + self.fc_out.bias

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
        elif splits_itself(layer.module_cls):
            layer = replace(layer, kwargs={**layer.kwargs, "tensor_group": tensor_group})
        layers.append(layer)
    if not any(layer.module_cls is TensorParallelBlock or splits_itself(layer.module_cls) for layer in layers):
        raise UserInputError(f"model {model.name} has no transformer blocks to split over {tensor_group.size} ranks")
    return replace(model, layers=layers)


def splits_itself(module_cls: type) -> bool:
    """A block class that takes a `tensor_group` and keeps its own rank's slices (a Hugging Face
    decoder layer, `models.hf.HFDecoderLayer`, with `ColumnSlice` and `RowSlice`)."""
    return bool(getattr(module_cls, "splits_over_tensor_group", False))

class ColumnSlice(nn.Module):
    """This rank's output columns of a linear map (`nn.Linear`, or transformers' `Conv1D`, which
    stores its weight transposed): the input is whole, the output this rank's part. Parameters keep
    the original's names (`weight`, `bias`) and carry their `TensorSplit`."""

    def __init__(self, module: nn.Module, tensor_group: TensorParallelGroup, parts: int = 1) -> None:
        super().__init__()
        t, rank = tensor_group.size, tensor_group.rank
        self.transposed = not isinstance(module, nn.Linear)  # Conv1D: weight (in, out)
        dim = 1 if self.transposed else 0
        split = TensorSplit(dim=dim, parts=parts)
        self.weight = _sharded(split.cut(module.weight.detach(), t, rank), split)
        bias_split = TensorSplit(dim=0, parts=parts)
        self.bias = None if module.bias is None else _sharded(bias_split.cut(module.bias.detach(), t, rank), bias_split)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        return F.linear(x, weight, self.bias)


class RowSlice(nn.Module):
    """This rank's input rows of a linear map: its partial output is all-reduced over the group
    (g), then the whole bias added once."""

    def __init__(self, module: nn.Module, tensor_group: TensorParallelGroup) -> None:
        super().__init__()
        t, rank = tensor_group.size, tensor_group.rank
        self.transposed = not isinstance(module, nn.Linear)
        split = TensorSplit(dim=0 if self.transposed else 1)
        self.weight = _sharded(split.cut(module.weight.detach(), t, rank), split)
        self.bias = None if module.bias is None else _replicated(module.bias)
        self.group, self.communicate = tensor_group.group, tensor_group.communicate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        partial = F.linear(x, weight)
        out = _ReduceFromTensorGroup.apply(partial, self.group) if self.communicate else partial
        return out if self.bias is None else out + self.bias


def copy_to_tensor_group(module: nn.Module, tensor_group: TensorParallelGroup) -> None:
    """f on `module`'s output (identity forward, all-reduce of the gradient backward): put on the
    norm whose output feeds column-parallel maps, once for all of them."""
    if tensor_group.communicate:
        module.register_forward_hook(lambda _m, _inputs, output: _CopyToTensorGroup.apply(output, tensor_group.group))
