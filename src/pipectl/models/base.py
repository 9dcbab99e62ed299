"""The layer-list contract shared by the profiler and the runtime.

A model is an ordered list of `LayerDef`s, the units a pipeline can cut between. Each maps 1:1 to
a DeepSpeed `LayerSpec` (or `TiedLayerSpec` when `tie_key` is set), so the profiler measures
exactly the modules the pipeline engine will run:

    embed -> block.0 -> ... -> block.{L-1} -> final_norm -> head(tied to embed)

Batches are made by `make_batch(batch_size, generator)` -> (inputs, labels); the first layer
consumes `inputs`, `loss_fn(last_output, labels)` gives the scalar loss.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from pipectl.artifacts.plan import ModelShape


@dataclass(frozen=True)
class LayerDef:
    """One cuttable layer: how to build it, and whether it shares weights with another layer."""

    name: str
    kind: str
    module_cls: type[nn.Module]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    tie_key: str | None = None
    # For a tied layer that is not the first holder: forward(module, x) using the shared module.
    tied_forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    tied_weight_attr: str = "weight"

    def build(self) -> nn.Module:
        return self.module_cls(*self.args, **self.kwargs)

    def forward(self, module: nn.Module, x: Any) -> Any:
        return self.tied_forward(module, x) if self.tied_forward is not None else module(x)

    def tied_weight(self, module: nn.Module) -> nn.Parameter:
        """The shared weight in the first holder's `module`: `tied_weight_attr`, dotted or not."""
        value: Any = module
        for part in self.tied_weight_attr.split("."):
            value = getattr(value, part)
        return value


@dataclass(frozen=True)
class ModelLayers:
    """A model as pipectl sees it: the layer list, how to make a batch, and the loss."""

    name: str
    layers: list[LayerDef]
    make_batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # Shape facts for profiles (None for user models).
    seq_len: int | None = None
    hidden: int | None = None
    vocab: int | None = None
    # A config too large to build whole here (`ModelConfig.shape_only`): only one layer at a time
    # may be built (the profiler's one-instance mode) or its shape counted on the meta device.
    shape_only: bool = False
    # A language model's own tokenizer (a Hugging Face tokenizer.json), for text data; None: bytes.
    tokenizer: str | None = None

    def __len__(self) -> int:
        return len(self.layers)


# `torch.nn.init`'s initialisers that draw from a normal distribution: on a meta tensor torch runs
# them through its Python reference kernels, whose first call imports torch._dynamo (1-2 s of a
# command's start, for a model with an embedding: `nn.Embedding` initialises with `normal_`).
_NORMAL_INITIALISERS = ("normal_", "xavier_normal_", "kaiming_normal_")


@contextmanager
def on_meta_device() -> Iterator[None]:
    """Modules built inside are on the meta device (shapes only, nothing allocated), and the
    normal initialisers of `torch.nn.init` leave meta tensors as they are: a meta tensor has no
    values to draw. Any other tensor, from any thread, is initialised as ever."""
    saved = {name: getattr(nn.init, name) for name in _NORMAL_INITIALISERS}
    for name, initialiser in saved.items():
        setattr(nn.init, name, _skipping_meta(initialiser))
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, initialiser in saved.items():
            setattr(nn.init, name, initialiser)


def _skipping_meta(initialiser: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(initialiser)
    def initialise(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor if tensor.is_meta else initialiser(tensor, *args, **kwargs)

    return initialise


def shape_of(model: ModelLayers) -> ModelShape:
    """The `ModelShape` a profile of `model` records (what launch checks a plan against): a tied
    layer after the first holder counts its copy of the shared weight, the model counts it once.
    Built on the meta device: nothing is allocated, so a model of any size is counted in well
    under a second."""
    counts: list[int] = []
    copies = 0
    holders: dict[str, nn.Module] = {}
    with on_meta_device():
        for layer in model.layers:
            if layer.tie_key is not None and layer.tie_key in holders:
                count = layer.tied_weight(holders[layer.tie_key]).numel()
                copies += count
            else:
                module = layer.build()
                if layer.tie_key is not None:
                    holders[layer.tie_key] = module
                count = sum(p.numel() for p in module.parameters())
            counts.append(count)
    return ModelShape(
        parameter_count=sum(counts) - copies,
        layer_parameter_counts=counts,
        seq_len=model.seq_len,
        hidden=model.hidden,
        vocab=model.vocab,
    )
