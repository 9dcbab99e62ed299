"""Device datasheets (configs/devices.yaml): peak FLOP/s, memory, links, achievable efficiency.

A `DeviceSpec` is what the planner and the derived profiles know about an accelerator without
running anything on it. Figures come from vendor datasheets (cited per device in the YAML); the
achievable fraction of peak is data too: `efficiency_by_micro_batch` (whole-training MFU from
publications), and, where an entry has them, the compute constants `pipectl.profile.compute_model`
times layers with (SM count, sustained GEMM and attention efficiency, host time per kernel).

    >>> a100 = get_device("a100-80gb")
    >>> a100.peak_flops_per_second("bfloat16")
    312000000000000.0
    >>> a100.efficiency(8) > a100.efficiency(1)
    True
"""

from __future__ import annotations

import os
from bisect import bisect_left
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator

from pipectl.artifacts.base import Artifact, Strict
from pipectl.artifacts.cluster import MAX_GBYTES_PER_SECOND, MAX_LATENCY_US, MIN_GBYTES_PER_SECOND
from pipectl.errors import ArtifactError, UserInputError
from pipectl.io import read_mapping, validation_message
from pipectl.paths import configs_dir

GIB = 1024**3

# Bounds of a datasheet figure: far beyond any device (an H100 has 80 GiB, 989 dense bf16 TFLOP/s,
# 3.35 TB/s of memory bandwidth), close enough that the planner's sums stay finite and positive.
MAX_GIB = 2.0**20  # 1 PiB
MIN_TFLOPS, MAX_TFLOPS = 1e-6, 1e6
# A link's bounds (GB/s, µs) are artifacts.cluster's: a datasheet's figure and a cluster's override alike.

# Bytes per element of the dtypes a profile can be made for.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class DeviceSpec(Strict):
    """One accelerator kind (or one CPU rank), as its datasheet describes it.

    Link figures are per device and per direction: what one device can push to one peer while
    its neighbours do the same (a node's NICs are shared out among its devices).
    """

    name: str = Field(description="Catalog key, e.g. 'a100-80gb'.")
    description: str = Field(default="", description="What the device is, in words.")
    source: str = Field(default="", description="Where the figures come from (datasheet, measurement).")
    accelerator: Literal["cuda", "cpu"] = Field(
        default="cuda", description="What a rank runs on: a CUDA GPU, or a CPU core (DeepSpeed's CPU accelerator, gloo)."
    )
    bf16: bool = Field(
        default=True, description="Trains in bfloat16; False (before Ampere: V100, P100, T4, K80): 16-bit training is fp16."
    )
    memory_gib: float = Field(gt=0, le=MAX_GIB, description="Device memory by the datasheet, GiB (CPU: what one rank may use).")
    reported_memory_gib: float | None = Field(
        default=None, gt=0, le=MAX_GIB,
        description="Total memory the device's runtime reports (CUDA: torch.cuda.get_device_properties().total_memory), "
        "GiB, where measured (ECC and firmware take some of the datasheet's); None: the datasheet figure is used.",
    )
    outside_allocator_gib: float = Field(
        default=0.0, ge=0, le=MAX_GIB,
        description="Memory a training rank uses outside PyTorch's allocator (CUDA context, NCCL and cuBLAS "
        "buffers), GiB.",
    )
    allocator_overhead: float = Field(
        default=0.0, ge=0, le=10,
        description="What PyTorch's caching allocator reserves beyond the bytes allocated at a rank's peak, as a "
        "fraction of them (fragmentation); 0 for CPU ranks.",
    )
    peak_tflops_bf16: float = Field(
        ge=MIN_TFLOPS, le=MAX_TFLOPS, description="Dense peak for 16-bit training (bf16, or fp16 where bf16 is absent), TFLOP/s."
    )
    peak_tflops_fp32: float = Field(ge=MIN_TFLOPS, le=MAX_TFLOPS, description="Dense fp32 peak (no TF32), TFLOP/s.")
    memory_bandwidth_gbytes_per_second: float | None = Field(
        default=None, ge=MIN_GBYTES_PER_SECOND, le=MAX_GBYTES_PER_SECOND, description="Device memory bandwidth, GB/s; bounds element-wise layers."
    )
    intra_node_bandwidth_gbytes_per_second: float = Field(
        ge=MIN_GBYTES_PER_SECOND, le=MAX_GBYTES_PER_SECOND, description="Per-direction bandwidth to a peer in the same node (NVLink, PCIe), GB/s."
    )
    intra_node_allreduce_bandwidth_gbytes_per_second: float | None = Field(
        default=None, ge=MIN_GBYTES_PER_SECOND, le=MAX_GBYTES_PER_SECOND,
        description="The bus bandwidth NCCL's ring all-reduce measures among the devices of one node (nccl-tests' "
        "busbw at large messages), GB/s: the link's rate less the protocol's overhead. The catalog's figure for "
        "collectives inside a node (tensor-parallel and in-node data-parallel rings); None: the link's "
        "datasheet rate (intra_node_bandwidth_gbytes_per_second). Point-to-point transfers keep the datasheet rate.",
    )
    intra_node_latency_us: float = Field(ge=0, le=MAX_LATENCY_US, description="Point-to-point latency within a node, µs.")
    inter_node_bandwidth_gbytes_per_second: float = Field(
        ge=MIN_GBYTES_PER_SECOND, le=MAX_GBYTES_PER_SECOND, description="Per-device share of the node's network bandwidth (InfiniBand, Ethernet), GB/s."
    )
    inter_node_allreduce_bandwidth_gbytes_per_second: float | None = Field(
        default=None, ge=MIN_GBYTES_PER_SECOND, le=MAX_GBYTES_PER_SECOND,
        description="The bus bandwidth NCCL's ring all-reduce reaches per device across nodes (per NIC where each "
        "device has its own), GB/s: the catalog's figure for collectives between nodes; None: the per-device share "
        "above. Point-to-point transfers keep that share.",
    )
    inter_node_latency_us: float = Field(ge=0, le=MAX_LATENCY_US, description="Point-to-point latency across nodes, µs.")
    efficiency_by_micro_batch: list[tuple[int, float]] = Field(
        min_length=1,
        description="[micro_batch_size, achievable fraction of peak] points, micro-batch ascending.",
    )
    multiprocessors: int | None = Field(
        default=None, gt=0, le=1_000_000, description="Streaming multiprocessors (compute units), datasheet; GEMM wave quantization."
    )
    gemm_efficiency: float | None = Field(
        default=None, gt=0, le=1,
        description="Fraction of the dense peak a large 16-bit GEMM sustains (the clock held at the power limit).",
    )
    gemm_efficiency_best: float | None = Field(
        default=None, gt=0, le=1,
        description="Fraction of the dense peak the best-shaped GEMM reaches in a burst, measured: the most a "
        "calibration may fit `gemm_efficiency` to (default: the peak).",
    )
    gemm_wave_quantization: float = Field(
        default=1.0, gt=0, le=1,
        description="The share of the modelled tile and wave quantization a GEMM pays, as an exponent on the "
        "useful fraction of its waves: 1 as modelled (whole waves of large tiles); below 1 where the GEMM "
        "library recovers part of it (smaller tiles, split-K, stream-K). Fitted by a calibration.",
    )
    attention_efficiency: float | None = Field(
        default=None, gt=0, le=1, description="Fraction of the dense peak fused (flash) attention reaches."
    )
    kernel_overhead_us: float | None = Field(
        default=None, ge=0, le=MAX_LATENCY_US, description="Host time to issue one kernel from eager PyTorch (dispatch + launch), µs."
    )
    blocking_p2p: bool = Field(
        default=False,
        description="Whether a point-to-point send returns only once the peer's receive runs (gloo, the CPU "
        "backend); the simulator then times sends and receives as rendezvous.",
    )

    @field_validator("efficiency_by_micro_batch")
    @classmethod
    def _curve_is_sane(cls, points: list[tuple[int, float]]) -> list[tuple[int, float]]:
        sizes = [size for size, _ in points]
        if any(size <= 0 for size in sizes) or sizes != sorted(set(sizes)):
            raise ValueError(f"micro-batch sizes must be positive and strictly ascending, got {sizes}")
        fractions = [fraction for _, fraction in points]
        if any(not 0 < fraction <= 1 for fraction in fractions):
            raise ValueError(f"efficiency fractions must lie in (0, 1], got {fractions}")
        return points

    @property
    def memory_bytes(self) -> int:
        """The device's total memory: as its runtime reports it where measured, else the datasheet's."""
        return int((self.reported_memory_gib or self.memory_gib) * GIB)

    def efficiency(self, micro_batch_size: float) -> float:
        """Achievable fraction of peak at this micro-batch size.

        Linear between the catalog's points, flat beyond the first and the last:

            points [(1, 0.3), (4, 0.5)] -> efficiency(2) = 0.3 + (2-1)/(4-1) * 0.2 = 0.3667
        """
        points = self.efficiency_by_micro_batch
        sizes = [size for size, _ in points]
        if micro_batch_size <= sizes[0]:
            return points[0][1]
        if micro_batch_size >= sizes[-1]:
            return points[-1][1]
        upper = bisect_left(sizes, micro_batch_size)
        (low_size, low_fraction), (high_size, high_fraction) = points[upper - 1], points[upper]
        weight = (micro_batch_size - low_size) / (high_size - low_size)
        return low_fraction + weight * (high_fraction - low_fraction)

    def has_compute_model(self) -> bool:
        """Whether the entry carries what `pipectl.profile.compute_model` needs (else: the curve)."""
        return None not in (
            self.multiprocessors,
            self.gemm_efficiency,
            self.attention_efficiency,
            self.kernel_overhead_us,
            self.memory_bandwidth_gbytes_per_second,
        )

    def peak_flops_per_second(self, dtype: str) -> float:
        """Dense peak FLOP/s for training in `dtype` (float32 -> fp32 peak; 16-bit -> bf16/fp16 peak)."""
        if dtype not in DTYPE_BYTES:
            raise UserInputError(f"unknown dtype '{dtype}'", hint=f"known dtypes: {', '.join(DTYPE_BYTES)}")
        tflops = self.peak_tflops_fp32 if dtype == "float32" else self.peak_tflops_bf16
        return tflops * 1e12

    def achievable_flops_per_second(self, dtype: str, micro_batch_size: float) -> float:
        """Peak x efficiency(b): what a large transformer layer reaches at micro-batch b."""
        return self.peak_flops_per_second(dtype) * self.efficiency(micro_batch_size)


class DeviceCatalog(Artifact):
    """configs/devices.yaml: the device datasheets."""

    schema_version: Literal[1] = 1
    devices: list[DeviceSpec] = Field(min_length=1, description="One entry per device kind.")

    @field_validator("devices")
    @classmethod
    def _unique_names(cls, devices: list[DeviceSpec]) -> list[DeviceSpec]:
        names = [device.name for device in devices]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"device names must be unique, repeated: {', '.join(repeated)}")
        return devices


def catalog_path() -> Path:
    """configs/devices.yaml (follows `$PIPECTL_CONFIGS`)."""
    return configs_dir() / "devices.yaml"


@lru_cache(maxsize=8)
def _load_catalog_file(path: str, modified_ns: int) -> dict[str, DeviceSpec]:
    # Cached by path and modification time: the planner looks devices up many times.
    data = read_mapping(path)
    try:
        catalog = DeviceCatalog.model_validate(data)
    except ValidationError as exc:
        raise ArtifactError(f"{path}: {validation_message(exc)}") from exc
    return {device.name: device for device in catalog.devices}


def load_catalog(path: str | os.PathLike[str] | None = None) -> dict[str, DeviceSpec]:
    """Every device of the catalog by name (configs/devices.yaml unless `path` is given)."""
    path = Path(path) if path is not None else catalog_path()
    if not path.is_file():
        raise UserInputError(f"device catalog not found: {path}")
    return dict(_load_catalog_file(str(path.resolve()), path.stat().st_mtime_ns))


def get_device(name: str, catalog: dict[str, DeviceSpec] | None = None) -> DeviceSpec:
    """One device by catalog name; an unknown name is a user error that lists the known ones."""
    devices = catalog if catalog is not None else load_catalog()
    if name not in devices:
        raise UserInputError(
            f"unknown device kind '{name}'", hint=f"known device kinds: {', '.join(sorted(devices))}"
        )
    return devices[name]


def known_devices() -> list[str]:
    return sorted(load_catalog())
