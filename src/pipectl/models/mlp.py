"""A plain MLP stack: input projection, `layers` hidden layers, classifier."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DenseReLU(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.linear(x))


class Classifier(nn.Linear):
    """The last layer: logits over classes."""


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)
