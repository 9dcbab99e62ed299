"""A dataset of your own: `--data examples.dataset:build` (for `mlp-tiny`: 784 features, 10 classes).

The contract: a function taking no arguments returns an object with `__len__` and
`__getitem__(index) -> sample`. A sample is an `(inputs, labels)` pair of tensors, stacked into a
micro-batch; or the object defines `collate(samples) -> (inputs, labels)` to batch them its own way.
pipectl decides the order: the samples of step s are a function of (seed, s, global batch) only,
each sample once per epoch, whatever the layout or a resize does. Like a model factory, the module
is code that every rank imports (from the folder `pipectl launch` ran in).

    pipectl profile mlp-tiny -o mlp.json
    pipectl plan --profile mlp.json --cluster local --devices 2 --global-batch 32 -o mlp-plan.json
    pipectl launch mlp-plan.json --run-dir runs/mlp --data examples.dataset:build --steps 20
"""

from __future__ import annotations

import torch


class Prototypes:
    """4,096 noisy copies of 10 fixed 784-dimensional prototypes; the label is the prototype."""

    def __init__(self, size: int = 4096, classes: int = 10, features: int = 784) -> None:
        generator = torch.Generator().manual_seed(0)
        self.prototypes = torch.randn(classes, features, generator=generator)
        self.size, self.classes = size, classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        label = index % self.classes
        noise = torch.randn(self.prototypes.shape[1], generator=torch.Generator().manual_seed(index))
        return self.prototypes[label] + 0.5 * noise, torch.tensor(label)


def build() -> Prototypes:
    return Prototypes()
