"""A model factory whose layer 3 ('exhaust') asks for more memory than any machine has.

`pipectl_oom_model:build` (run from this folder): a small residual MLP of 5 cuttable layers. The
'exhaust' layer allocates a 2**60-byte tensor on its input's device in every forward, so the rank
that holds it runs out of memory for real: torch's CPU allocator raises RuntimeError
"DefaultCPUAllocator: can't allocate memory", CUDA raises torch.OutOfMemoryError.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pipectl.models import LayerDef, ModelLayers

IMPOSSIBLE_BYTES = 2**60  # 1 EiB: above any machine's memory and a 64-bit process's address space


class Dense(nn.Module):
    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Exhaust(nn.Module):
    """A dense layer that first allocates IMPOSSIBLE_BYTES of scratch space."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = x.new_empty(IMPOSSIBLE_BYTES // x.element_size())
        return self.linear(x) + scratch[:1]


def gaussian_batch(features: int, classes: int, batch_size: int, generator: torch.Generator):
    inputs = torch.randn(batch_size, features, generator=generator)
    return inputs, inputs[:, :classes].argmax(dim=1)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def build(features: int = 8, hidden: int = 16, classes: int = 4) -> ModelLayers:
    layers = [
        LayerDef("input", "dense", Dense, (features, hidden)),
        LayerDef("block.0", "dense", Dense, (hidden, hidden)),
        LayerDef("block.1", "dense", Dense, (hidden, hidden)),
        LayerDef("exhaust", "dense", Exhaust, (hidden,)),
        LayerDef("head", "dense", nn.Linear, (hidden, classes)),
    ]
    return ModelLayers(
        name="oom-mlp", layers=layers, make_batch=partial(gaussian_batch, features, classes), loss_fn=cross_entropy
    )
