"""The shortest user model: a factory that returns an `nn.Sequential`.

    pipectl profile examples.sequential_model:build -o profile.json

Each child of the Sequential is one cuttable layer. Because plain modules carry no batch maker
or loss, this module also defines `make_batch(batch_size, generator) -> (inputs, labels)` and
`loss_fn(output, labels) -> scalar`. Every pipeline rank calls `build()` itself (under a fixed
seed), so it must be deterministic and cheap to call.

`build_lazily` is the same model as DeepSpeed layer specs (a class and its arguments per layer):
then each rank builds only the layers of its own stage, so a model larger than one process's
memory can be launched:

    pipectl profile examples.sequential_model:build_lazily -o profile.json
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, HIDDEN, CLASSES = 32, 64, 4


def build() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def build_lazily() -> list:
    from deepspeed.pipe import LayerSpec

    return [
        LayerSpec(nn.Linear, FEATURES, HIDDEN),
        LayerSpec(nn.ReLU),
        LayerSpec(nn.Linear, HIDDEN, HIDDEN),
        LayerSpec(nn.ReLU),
        LayerSpec(nn.Linear, HIDDEN, CLASSES),
    ]


def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.randn(batch_size, FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (batch_size,), generator=generator)
    return inputs, labels


def loss_fn(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, labels)
