"""A user model for pipectl: `pipectl profile examples.custom_model:build` (run from the repo root).

The contract of a model factory `package.module:function`
----------------------------------------------------------
`function()` is called with no arguments and returns a `pipectl.models.ModelLayers`:

- `layers`: the ordered `LayerDef`s, the units a pipeline may cut between. Each becomes one
  DeepSpeed `LayerSpec` (a `TiedLayerSpec` when `tie_key` is set), so:
  * `module_cls` is a top-level `nn.Module` class and `args`/`kwargs` are plain values: every
    pipeline rank builds its own layers from them (nothing is pickled from this process);
  * layer i's output is layer i+1's input: a tensor (or a tuple of tensors) crosses each cut;
  * layers that share weights name the same `tie_key`; the later holders give `tied_forward`
    (how they use the first holder's module) and `tied_weight_attr` (the shared tensor).
- `make_batch(batch_size, generator) -> (inputs, labels)`: a deterministic batch for profiling
  and synthetic runs; the first layer consumes `inputs`.
- `loss_fn(last_output, labels) -> scalar tensor`: the loss the last stage computes.
- `seq_len`, `hidden`, `vocab`: optional shape facts, recorded in the profile when given.

This example is a residual MLP classifier: an input projection, `depth` residual blocks and a
classifier head, on synthetic Gaussian data.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pipectl.models import LayerDef, ModelLayers


class InputProjection(nn.Module):
    """features -> hidden."""

    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class ResidualBlock(nn.Module):
    """x + W2 gelu(W1 layernorm(x)): a transformer's MLP half on its own."""

    def __init__(self, hidden: int, expansion: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc_in = nn.Linear(hidden, expansion * hidden)
        self.fc_out = nn.Linear(expansion * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(F.gelu(self.fc_in(self.norm(x))))


class ClassifierHead(nn.Module):
    """hidden -> class logits."""

    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.linear = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


def gaussian_batch(features: int, classes: int, batch_size: int, generator: torch.Generator):
    """Random inputs; labels from a fixed rule so that the task is learnable."""
    inputs = torch.randn(batch_size, features, generator=generator)
    labels = (inputs[:, :classes].argmax(dim=1)) % classes
    return inputs, labels


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def build(features: int = 128, hidden: int = 256, depth: int = 6, classes: int = 10) -> ModelLayers:
    """The factory pipectl calls: a residual MLP as `depth + 2` cuttable layers."""
    layers = [LayerDef("input", "dense", InputProjection, (features, hidden))]
    layers += [LayerDef(f"block.{i}", "residual_mlp", ResidualBlock, (hidden,)) for i in range(depth)]
    layers.append(LayerDef("classifier", "classifier", ClassifierHead, (hidden, classes)))
    return ModelLayers(
        name="residual-mlp",
        layers=layers,
        make_batch=partial(gaussian_batch, features, classes),
        loss_fn=cross_entropy,
        hidden=hidden,
    )
