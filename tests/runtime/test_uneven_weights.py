"""Uneven replicas' arithmetic, for random batches, replica counts and shares: the shares cover the
global batch, and the loss weights the worker gives each replica (`weighted_replica`) turn
DeepSpeed's averaging (each replica's micro-batch losses divided by its own accumulation count,
then the mean over the d replicas) into the gradient of the mean loss over all B samples — the
single-device gradient. Per-sample gradients are random vectors; no processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.artifacts.layout import Layout
from pipectl.artifacts.plan import balanced_shares
from pipectl.runtime.engines.build import weighted_replica


@dataclass(frozen=True)
class Model:
    loss_fn: Callable


def deepspeed_gradient(layout: Layout, per_sample: np.ndarray) -> np.ndarray:
    """What DeepSpeed's engines compute together: on replica r, the sum over its micro-batches of
    grad(loss_fn(micro-batch)) / gradient_accumulation_steps; then the mean over replicas. The
    loss of a micro-batch is its samples' mean (the gradient of a weighted loss is weighted)."""
    replicas = []
    start = 0
    for replica in range(layout.data_parallel):
        model, config = weighted_replica(Model(lambda outputs, labels: outputs), {}, layout, replica)
        b, m = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
        total = np.zeros(per_sample.shape[1])
        for _ in range(m):
            total += model.loss_fn(per_sample[start:start + b].mean(axis=0), None) / m
            start += b
        replicas.append(total)
    assert start == len(per_sample)  # every sample exactly once
    return np.mean(replicas, axis=0)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 512), st.integers(1, 64), st.sampled_from([1, 2, 4]), st.integers(0, 2**32 - 1))
def test_balanced_shares_cover_the_batch_and_weigh_to_the_single_device_gradient(batch, d, b, seed):
    B = batch * b
    d = min(d, batch)
    shares = balanced_shares(B, d, b)
    assert sum(shares) * b == B and max(shares) - min(shares) <= 1 and len(shares) == d
    layout = Layout(1, d, b, max(shares), ((0, 1),), replica_shares=tuple((b, m) for m in shares))
    per_sample = np.random.default_rng(seed).normal(size=(B, 3))
    np.testing.assert_allclose(deepspeed_gradient(layout, per_sample), per_sample.mean(axis=0), rtol=1e-9, atol=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2, 3, 4]), st.integers(1, 9)), min_size=1, max_size=8),
       st.integers(0, 2**32 - 1))
def test_any_shares_of_any_micro_batch_sizes_weigh_to_the_single_device_gradient(shares, seed):
    # Heterogeneous replicas: each its own micro-batch size and count (the planner's water-filling).
    B = sum(b * m for b, m in shares)
    layout = Layout(1, len(shares), shares[0][0], max(m for _, m in shares), ((0, 1),), replica_shares=tuple(shares))
    assert layout.global_batch == B
    per_sample = np.random.default_rng(seed).normal(size=(B, 3))
    np.testing.assert_allclose(deepspeed_gradient(layout, per_sample), per_sample.mean(axis=0), rtol=1e-9, atol=1e-12)
