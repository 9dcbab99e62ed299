"""calibration.json: a cluster's device, link and engine terms fitted to runs it measured.

`pipectl calibrate MEASURED.csv --conditions CONDITIONS.yaml` fits these terms to a log of measured
step times (`pipectl.measured.calibrate`); `validate`, `profile --derive`, `plan` and `simulate`
take the file with `--calibration`. Every term keeps its meaning in the model, so a calibration
predicts layouts, shapes and batch sizes the log does not hold:

- the device (its catalog entry's figures: `DeviceSpec`): the fraction of the 16-bit peak large
  GEMMs sustain, how much of the modelled tile and wave quantization smaller GEMMs pay, the memory
  bandwidth element-wise kernels reach, the host's time to issue one kernel;
- the links inside a node and between nodes (as a cluster YAML's `links:` sets them): latency
  and bandwidth of point-to-point transfers and collectives alike;
- the engine (`EngineFeatures`): its time per micro-batch and stage, and per step, beyond the
  kernels and the collectives.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from pipectl.artifacts.base import Artifact, Seconds, Sha256, Strict
from pipectl.artifacts.cluster import MAX_GBYTES_PER_SECOND, MAX_LATENCY_US, MIN_GBYTES_PER_SECOND
from pipectl.artifacts.profile import EngineFeatures

if TYPE_CHECKING:
    from pipectl.catalog import DeviceSpec

# k of the k-fold cross-validation `pipectl calibrate MEASURED.csv` reports by default.
DEFAULT_FOLDS = 5


class CalibratedTerms(Strict):
    """The fitted figures, in the units of the catalog and of a cluster YAML."""

    # Under 1 % of the peak is no GEMM a fit finds (it moves a rate 4x at most): a hand-edited file's slip.
    gemm_efficiency: float = Field(ge=0.01, le=1, description="Fraction of the dense 16-bit peak a large GEMM sustains.")
    wave_quantization: float = Field(
        default=1.0, gt=0, le=1,
        description="Share of the modelled tile and wave quantization a GEMM pays (an exponent on its useful wave "
        "fraction): 1 as modelled, below 1 where the GEMM library recovers part of it.",
    )
    memory_bandwidth_gbytes_per_second: float = Field(
        ge=MIN_GBYTES_PER_SECOND, le=MAX_GBYTES_PER_SECOND,
        description="Device memory bandwidth, GB/s, as the catalog states it (element-wise kernels reach "
        "`compute_model.MEMORY_EFFICIENCY` of it).",
    )  # fmt: skip
    kernel_overhead_us: float = Field(ge=0, le=MAX_LATENCY_US, description="Host time to issue one kernel, µs.")
    intra_node_latency_us: float = Field(ge=0, le=MAX_LATENCY_US, description="Latency of a link inside a node, µs.")
    intra_node_bandwidth_gbytes_per_second: float = Field(
        ge=MIN_GBYTES_PER_SECOND, le=MAX_GBYTES_PER_SECOND,
        description="Bandwidth of a link inside a node, GB/s: point-to-point transfers and collectives' bus bandwidth.",
    )  # fmt: skip
    inter_node_latency_us: float = Field(ge=0, le=MAX_LATENCY_US, description="Latency of the network between nodes, µs.")
    inter_node_bandwidth_gbytes_per_second: float = Field(
        ge=MIN_GBYTES_PER_SECOND, le=MAX_GBYTES_PER_SECOND,
        description="A GPU's share of its node's network, GB/s (as the catalog and a cluster YAML state it).",
    )  # fmt: skip
    micro_batch_overhead_seconds: Seconds = Field(
        description="The engine's time per micro-batch and stage beyond its kernels (EngineFeatures)."
    )
    step_overhead_seconds: Seconds = Field(description="The engine's time per step and rank beyond the optimizer's traffic.")

    def device_spec(self, device: DeviceSpec) -> DeviceSpec:
        """`device` with the fitted device figures (its name kept: a catalog device, calibrated)."""
        return device.model_copy(update={
            "gemm_efficiency": self.gemm_efficiency,
            "gemm_wave_quantization": self.wave_quantization,
            "memory_bandwidth_gbytes_per_second": self.memory_bandwidth_gbytes_per_second,
            "kernel_overhead_us": self.kernel_overhead_us,
        })  # fmt: skip

    def links(self) -> dict[str, float]:
        """The fitted links, in the node and between nodes, as a cluster YAML's node type states them."""
        return {
            "intra_node_latency_us": self.intra_node_latency_us,
            "intra_node_bandwidth_gbytes_per_second": self.intra_node_bandwidth_gbytes_per_second,
            "intra_node_allreduce_bandwidth_gbytes_per_second": self.intra_node_bandwidth_gbytes_per_second,
            "inter_node_latency_us": self.inter_node_latency_us,
            "inter_node_bandwidth_gbytes_per_second": self.inter_node_bandwidth_gbytes_per_second,
        }

    def engine(self, engine: EngineFeatures | None, framework: str) -> EngineFeatures:
        """`engine` (None: `framework`'s name alone) with the fitted per-micro-batch and per-step costs."""
        base = engine if engine is not None else EngineFeatures(name=framework)
        return base.model_copy(update={
            "micro_batch_overhead_seconds": self.micro_batch_overhead_seconds,
            "step_overhead_seconds": self.step_overhead_seconds,
        })  # fmt: skip


class FitErrors(Strict):
    """How far predictions lie from the rows: (predicted - measured) / measured over the rows."""

    rows: int = Field(ge=0)
    median_abs_error: float = Field(ge=0)
    mape: float = Field(ge=0)
    max_abs_error: float = Field(ge=0)
    signed_median_error: float


class RunsCalibration(Artifact):
    """calibration.json (see the module docstring)."""

    schema_version: Literal[1] = 1
    device: str = Field(description="Catalog name of the device the rows ran on: the terms are of it.")
    framework: str = Field(description="The framework that ran the rows: the engine terms are of it.")
    rows_file: str = Field(description="The measured CSV, as given.")
    rows_sha256: Sha256
    conditions_sha256: Sha256
    rows: int = Field(gt=0, description="Rows the terms were fitted to.")
    uncalibrated: CalibratedTerms = Field(description="The terms before fitting: the catalog's and the conditions'.")
    terms: CalibratedTerms = Field(description="The fitted terms.")
    before: FitErrors = Field(description="Errors over the rows with the uncalibrated terms.")
    after: FitErrors = Field(description="Errors over the rows with the fitted terms (the rows fitted on).")
    folds: int | None = Field(default=None, ge=2, description="Folds of the cross-validation; None: not run.")
    cross_validated: FitErrors | None = Field(
        default=None,
        description="Errors of each row predicted with terms fitted to the other folds' rows: what to expect of "
        "runs the fit has not seen.",
    )

    def device_note(self, path: str | os.PathLike[str]) -> str:
        """What a profile derived with the calibrated device says of it."""
        t = self.terms
        return (
            f"device figures calibrated by {path} (fitted to {self.rows} {self.framework} runs): GEMM efficiency "
            f"{t.gemm_efficiency:.3g}, wave quantization {t.wave_quantization:.3g}, memory bandwidth "
            f"{t.memory_bandwidth_gbytes_per_second:.4g} GB/s, kernel overhead {t.kernel_overhead_us:.3g} µs"
        )
