"""benchmarks/gemm_shapes.py's what-if: it changes how GEMMs are priced only while it looks, and
only as it says (a fixed k-loop cost per tile; more tiles to choose from)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from pipectl.catalog import get_device
from pipectl.profile import compute_model, layer_shapes
from pipectl.profile.compute_model import Attention, BlockShape, ComputeDevice, block_forward_kernels

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gemm_shapes", ROOT / "benchmarks" / "gemm_shapes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gemm_shapes"] = module
    spec.loader.exec_module(module)
    return module


def _times(shape: BlockShape, device: ComputeDevice) -> dict[str, float]:
    return {k.name: k.seconds for k in block_forward_kernels(shape, device)}


def test_a_k_prologue_slows_each_gemm_by_its_share_of_the_k_loop_and_nothing_else(bench):
    device = ComputeDevice.of(get_device("a100-80gb"), "float16")
    shape = BlockShape(hidden=2048, heads=16, seq_len=1024, micro_batch_size=2, tensor_parallel=4,
                       attention=Attention.UNFUSED, fused=True)  # fmt: skip
    before = _times(shape, device)
    with bench.gemm_shapes(k_prologue=64):
        inside = _times(shape, device)
        assert layer_shapes.gemm_kernel is compute_model.gemm_kernel  # the head's GEMMs too
    assert _times(shape, device) == before and layer_shapes.gemm_kernel is compute_model.gemm_kernel
    # proj: k = h / t = 512; fc1: k = h = 2048; the softmax is no GEMM.
    assert inside["proj"] == pytest.approx(before["proj"] * (512 + 64) / 512)
    assert inside["fc1"] == pytest.approx(before["fc1"] * (2048 + 64) / 2048)
    assert inside["scale, mask and softmax"] == before["scale, mask and softmax"]


def test_smaller_tiles_fill_the_waves_of_a_small_product_and_leave_after(bench):
    tiles = compute_model.GEMM_TILES
    small = compute_model.wave_efficiency(1024, 768, 108)  # 48 tiles of 128x128 on 108 SMs: one wave, 44 %
    with bench.gemm_shapes(tiles=bench.SMALLER_TILES):
        assert compute_model.wave_efficiency(1024, 768, 108) > small  # 96 tiles of 128x64: 89 %
    assert compute_model.GEMM_TILES == tiles and compute_model.wave_efficiency(1024, 768, 108) == small
