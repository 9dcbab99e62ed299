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

Checkpoints do not depend on t either: the split block names its parameters like the unsplit one
(`qkv.weight` holds this rank's [q_r; k_r; v_r] rows), and `universal_checkpoint_patterns` /
`regroup_rank_slices` tell the universal checkpoint how to join the slices into the unsplit
tensors and cut them again for another t (`pipectl.runtime.checkpoint`).

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
        self.local_heads = heads // t
        self.head_dim = hidden // heads
        # Parameter names and order are those of TransformerBlock (`qkv.weight`, `proj.bias`, ...):
        # a universal checkpoint stores one folder per name, so the same folder serves every t.
        self.ln_attn = full.ln_attn
        # QKV rows are [q; k; v], each head-major: take this rank's heads from each of the three.
        q, k, v = full.qkv.weight.split(hidden)
        qb, kb, vb = full.qkv.bias.split(hidden)
        self.qkv = LinearSlice(
            _sharded(torch.cat([shard_rows(w, t, rank) for w in (q, k, v)])),
            _sharded(torch.cat([shard_rows(b, t, rank) for b in (qb, kb, vb)])),
        )
        # Row-parallel: the bias is added once, after the reduce, so it stays whole and replicated.
        self.proj = LinearSlice(
            _sharded(shard_rows(full.proj.weight.t(), t, rank).t()), _replicated(full.proj.bias)
        )
        self.ln_mlp = full.ln_mlp
        self.fc_in = LinearSlice(
            _sharded(shard_rows(full.fc_in.weight, t, rank)), _sharded(shard_rows(full.fc_in.bias, t, rank))
        )
        self.fc_out = LinearSlice(
            _sharded(shard_rows(full.fc_out.weight.t(), t, rank).t()), _replicated(full.fc_out.bias)
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
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
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
        layers.append(layer)
    if not any(layer.module_cls is TensorParallelBlock for layer in layers):
        raise UserInputError(f"model {model.name} has no transformer blocks to split over {tensor_group.size} ranks")
    return replace(model, layers=layers)


def block_layer_indices(layer_specs) -> list[int]:
    """Layer indices of the transformer blocks (plain or tensor-parallel) in a spec list.

    Reads the specs (DeepSpeed LayerSpec `typename`), not built modules, so any stage can describe
    the whole model.
    """
    return [
        index
        for index, spec in enumerate(layer_specs)
        if getattr(spec, "typename", None) in (TransformerBlock, TensorParallelBlock)
    ]


def universal_checkpoint_patterns(block_indices) -> dict[str, Any]:
    """How DeepSpeed's universal checkpoint merges (at save) and slices (at load) each parameter.

    Keys are DeepSpeed's `universal_checkpoint_info` entries (deepspeed/checkpoint/constants.py),
    read by `ds_to_universal.merge_tp_slices` when it joins the t slices of a parameter into one
    tensor and recorded in each merged file (`cat_dim`), which
    `universal_checkpoint.load_hp_checkpoint_state` reads to cut rank r's slice for the loading t.
    The same patterns are declared at every t (t=1 included), so any checkpoint can be re-cut:

    - column-parallel `fc_in.weight`/`fc_in.bias`: DeepSpeed's default (concatenate on dim 0);
    - row-parallel `proj.weight`, `fc_out.weight`: concatenate on dim 1;
    - fused `qkv.weight`/`qkv.bias`: the default too, which gives the ranks' [q_r; k_r; v_r] one
      after the other; `regroup_rank_slices` then reorders them to [q; k; v] (see there);
    - everything else (LayerNorms, the row-parallel biases added after the reduce, embeddings, the
      head) is whole on every tensor rank: averaged over the t copies. The copies are bitwise
      equal in our runs; the average keeps a save from failing if they ever differ by rounding.

    >>> import re
    >>> info = universal_checkpoint_patterns([1, 2])
    >>> row, = info["parameter_with_row_parallelism_patterns"]
    >>> [bool(re.match(row, name)) for name in ("2.proj.weight", "2.proj.bias", "3.proj.weight")]
    [True, False, False]
    """
    # DeepSpeed only when a checkpoint is saved: profiling and planning never import it
    from deepspeed.checkpoint.constants import PARAMETER_TO_AVERAGE_PATTERNS, PARAMETER_WITH_ROW_PARALLELISM_PATTERNS

    if not block_indices:
        return {}
    every_block = "|".join(str(index) for index in sorted(block_indices))
    split = r"(?:qkv|fc_in)\.(?:weight|bias)|(?:proj|fc_out)\.weight"
    return {
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [rf"^(?:{every_block})\.(?:proj|fc_out)\.weight$"],
        PARAMETER_TO_AVERAGE_PATTERNS: [rf"^(?!(?:{every_block})\.(?:{split})$)"],
    }


QKV_SUB_PARAMETERS = 3  # q, k, v


def qkv_parameter_names(block_indices) -> list[str]:
    """The fused QKV parameters of the blocks at these layer indices (universal checkpoint names)."""
    return [f"{index}.qkv.{kind}" for index in sorted(block_indices) for kind in ("weight", "bias")]


def regroup_rank_slices(joined: torch.Tensor, tensor_parallel: int) -> torch.Tensor:
    """Rank slices of a fused QKV joined one after the other -> the unsplit [q; k; v] order.

    Rank r holds [q_r; k_r; v_r] (its heads of each of the three); DeepSpeed's converter joins the
    ranks' slices on dim 0. Its loader can cut [q; k; v] for any t when the file says the tensor
    holds 3 sub-parameters (`param_n_sub_params`: each third is cut into t blocks), but its
    converter builds that order only for 2 sub-parameters, and the general sub-parameter record it
    offers for more is a pickled class that `torch.load(weights_only=True)` refuses. So pipectl
    reorders the joined tensor itself. Two ranks, one row per q/k/v head block:

    >>> regroup_rank_slices(torch.tensor([0, 10, 20, 1, 11, 21]), tensor_parallel=2).tolist()
    [0, 1, 10, 11, 20, 21]
    """
    rows = joined.shape[0]
    if rows % (tensor_parallel * QKV_SUB_PARAMETERS):
        raise UserInputError(f"{rows} QKV rows do not split into 3 x {tensor_parallel} blocks")
    blocks = joined.reshape(tensor_parallel, QKV_SUB_PARAMETERS, rows // (tensor_parallel * QKV_SUB_PARAMETERS), -1)
    return blocks.transpose(0, 1).reshape(joined.shape)
