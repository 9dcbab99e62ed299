"""benchmarks/memory_kernels.py's what-if: the ratios it reads from a GPU's kernel timings, and that
it slows the named kernels only, and only while it looks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from pipectl.catalog import get_device
from pipectl.profile import compute_model
from pipectl.profile.compute_model import Attention, BlockShape, ComputeDevice, block_forward_kernels

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("memory_kernels", ROOT / "benchmarks" / "memory_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory_kernels"] = module
    spec.loader.exec_module(module)
    return module


def test_the_ratios_are_the_gpus_medians_without_launch_bound_kernels(bench):
    ratios = bench.measured_ratios(bench.KERNEL_TIMES)
    assert 1.9 <= ratios["layer norm"] <= 2.2  # four timings on the H200: 1.93-2.14
    assert ratios["attention dropout backward"] < 1.1  # a streaming kernel reaches the model's bandwidth
    # Gradient accumulation of a bias (kilobytes) is timed at the launch floor: thousands of times its bytes' time.
    assert ratios["gradient accumulation"] < 3


def test_only_the_named_kernels_slow_and_only_inside_the_block(bench):
    device = ComputeDevice.of(get_device("a100-80gb"), "float16")
    shape = BlockShape(hidden=2048, heads=16, seq_len=2048, micro_batch_size=4, attention=Attention.UNFUSED, fused=True)
    before = {k.name: k.seconds for k in block_forward_kernels(shape, device)}
    with bench.memory_kernels_scaled({"layer norm": 2.0}):
        inside = {k.name: k.seconds for k in block_forward_kernels(shape, device)}
    after = {k.name: k.seconds for k in block_forward_kernels(shape, device)}
    assert inside["layer norm"] == pytest.approx(2 * before["layer norm"])
    assert all(inside[name] == seconds for name, seconds in before.items() if name != "layer norm")
    assert after == before and compute_model.memory_kernel.__name__ == "memory_kernel"


def test_the_kernels_outside_the_blocks_slow_too(bench):
    """The final layer norm, embeddings, head and loss are priced in profile/layer_shapes.py, which
    holds memory_kernel under its own name."""
    from pipectl.profile import layer_shapes

    device = ComputeDevice.of(get_device("a100-80gb"), "float16")
    before = layer_shapes.memory_kernel("layer norm", 1e9, device).seconds
    with bench.memory_kernels_scaled({"layer norm": 2.0}):
        assert layer_shapes.memory_kernel("layer norm", 1e9, device).seconds == pytest.approx(2 * before)
    assert layer_shapes.memory_kernel is compute_model.memory_kernel
