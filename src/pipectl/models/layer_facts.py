"""What the profiler and the launcher need to know about a model's layers before building any of
them for real: which layers are identical (measured once), and which tensor-parallel degrees its
transformer blocks accept. Both are checked on the meta device: nothing is allocated."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from pipectl.errors import UserInputError
from pipectl.models.base import LayerDef, ModelLayers, on_meta_device
from pipectl.models.tensor_parallel import TensorParallelBlock, TensorParallelGroup, shard_model, splits_itself
from pipectl.models.transformer import TransformerBlock


def plain_value(value: Any) -> Any:
    """A comparable stand-in for a constructor argument: numbers, strings, booleans, None, types and
    dtypes by value and type (1, 1.0 and True differ), tuples, lists and dicts element by element,
    anything else by identity (only the same object is the same argument)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, type, torch.dtype)):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(plain_value(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(key), plain_value(item)) for key, item in value.items())))
    return ("object", id(value))


def tied_holders(model: ModelLayers) -> list[int | None]:
    """For each layer, the index of the first holder of its tie key when it is a later holder, else None."""
    first: dict[str, int] = {}
    holder_of: list[int | None] = []
    for index, layer in enumerate(model.layers):
        if layer.tie_key is not None and layer.tie_key in first:
            holder_of.append(first[layer.tie_key])
        else:
            holder_of.append(None)
            if layer.tie_key is not None:
                first[layer.tie_key] = index
    return holder_of


def layer_signature(layer: LayerDef, holder: LayerDef | None) -> tuple:
    """What a layer computes, as far as its definition says: a tied layer runs its holder's module."""
    source = holder if holder is not None else layer
    tied = layer.tie_key is not None
    return (
        layer.kind, source.module_cls, plain_value(source.args), plain_value(source.kwargs), tied, holder is not None,
        layer.tied_forward, layer.tied_weight_attr if tied else None,
    )


def parameter_shapes(module: nn.Module) -> tuple:
    return tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters())


def identical_layers(model: ModelLayers) -> list[int]:
    """For each layer, the index of the first layer identical to it (itself when none is earlier).

    Two layers are identical when they have the same `kind`, build the same module class from
    equal constructor arguments (`plain_value`: plain values by value, other objects by identity),
    play the same part in weight tying (a tied layer after the first holder runs its holder's
    module, so the holders must be identical) and their modules have the same parameter names,
    shapes and dtypes (checked on the meta device, nothing allocated). The profiler also requires
    the same input (shapes and dtypes) and treats the last layer apart (its backward includes the
    loss); those are known only while it runs. Weights differ (each layer is initialised on its
    own): a layer's cost is taken not to depend on its weights' values.

        >>> from pipectl.models import build_model
        >>> identical_layers(build_model("gpt-tiny"))   # embed, 6 blocks, final_norm, head
        [0, 1, 1, 1, 1, 1, 1, 7, 8]
    """
    holder_of = tied_holders(model)
    layers = model.layers
    same_as = list(range(len(layers)))
    groups: dict[tuple, list[int]] = {}
    for index, layer in enumerate(layers):
        if holder_of[index] is None:
            groups.setdefault(layer_signature(layer, None), []).append(index)
    with torch.random.fork_rng(devices=[]), on_meta_device():
        for members in groups.values():
            if len(members) < 2:  # nothing to compare: not even built on meta (a factory's layers)
                continue
            first_with: dict[tuple, int] = {}
            for index in members:
                same_as[index] = first_with.setdefault(parameter_shapes(layers[index].build()), index)
    followers: dict[tuple, int] = {}
    for index, holder in enumerate(holder_of):
        if holder is not None:
            key = (layer_signature(layers[index], layers[holder]), same_as[holder])
            same_as[index] = followers.setdefault(key, index)
    return same_as


def check_tensor_parallel(model: ModelLayers, degrees: Sequence[int]) -> list[int]:
    """The distinct degrees t > 1 to measure shards for (t = 1 is the layers themselves), each
    checked against every transformer block on the meta device: t must divide its heads and its
    hidden size. A model without transformer blocks has nothing to split."""
    bad = [t for t in degrees if isinstance(t, bool) or not isinstance(t, int) or t < 1]
    if bad:
        raise UserInputError(f"tensor-parallel degree {bad[0]!r} is not a positive integer")
    shard_degrees = sorted({t for t in degrees if t > 1})
    if not shard_degrees:
        return []
    for t in shard_degrees:
        sharded = shard_model(model, TensorParallelGroup.without_communication(t))  # no blocks: a UserInputError
        same_as = identical_layers(sharded)
        with torch.random.fork_rng(devices=[]), on_meta_device():
            for index in block_indices(sharded):
                if same_as[index] == index:
                    sharded.layers[index].build()  # refuses heads (or a hidden size) t does not divide
    return shard_degrees


def block_indices(model: ModelLayers) -> list[int]:
    """The layers that split over a tensor group: transformer blocks (plain or already split)."""
    return [
        i for i, layer in enumerate(model.layers)
        if layer.module_cls in (TransformerBlock, TensorParallelBlock) or splits_itself(layer.module_cls)
    ]  # fmt: skip
