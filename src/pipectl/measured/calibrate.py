"""Fitting a cluster's terms to its measured runs: `pipectl calibrate MEASURED.csv --conditions C.yaml`.

The uncalibrated model prices a run from datasheets and from how the engines work; a cluster's own
log of jobs says how its GPUs, links and framework really behave. The fit adjusts the terms of the
model that the rows can tell apart (`CalibratedTerms`), never a row's own figure:

- GEMM efficiency (what large products sustain), the share of the modelled tile and wave
  quantization a product pays (the model prices whole waves of CUTLASS's large tiles; a GEMM
  library with smaller tiles, split-K or stream-K recovers part of that loss on small products),
  memory bandwidth (element-wise kernels: the unfused attention's s x s passes, the fp32 loss),
  and the host's time per kernel (what small shards are bound by): four device figures the kernel
  model (`profile.compute_model`) reads;
- the latency and bandwidth of the link inside a node and of the network between nodes
  (tensor-parallel all-reduces, pipeline transfers, gradient reductions): the network's stay as
  they are when every row ran on one node;
- the engine's time per micro-batch and stage, and per step.

Each row's prediction is a full plan of its pinned layout (`measured.predict`), so the terms act
through the same partitioner, schedule simulation and collectives as any plan. The fit minimises
the sum of squared relative errors ((predicted - measured) / measured) by Levenberg-Marquardt
(Marquardt 1963) on a finite-difference Jacobian: the eight rates as log multipliers of their
starting figures (they stay positive, and below what a device of the kind can have: `ceilings`),
the two overheads in milliseconds (at least 0). Each Jacobian is 10 independent predictions of every row: they run in
parallel (`plan.workers.share`).

k-fold cross-validation (rows dealt to folds in their file order, round robin) fits on k - 1
folds and predicts the held-out one: the error to expect on runs the fit has not seen. The
predictions at the starting terms (and their Jacobian) use no measured time, so the folds share
them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipectl.catalog import get_device
from pipectl.errors import UserInputError
from pipectl.io import sha256_file
from pipectl.artifacts.calibration import DEFAULT_FOLDS, CalibratedTerms, FitErrors, RunsCalibration
from pipectl.measured.predict import Calibrated, Predictor
from pipectl.measured.runs import MeasuredRun, RunConditions
from pipectl.measured.summary import error_summary, unit_suspicion
from pipectl.plan.workers import share

# Fitted as log multipliers of their starting figures; then the two overheads, in milliseconds.
RATES = (
    "gemm_efficiency",
    "wave_quantization",
    "memory_bandwidth_gbytes_per_second",
    "kernel_overhead_us",
    "intra_node_latency_us",
    "intra_node_bandwidth_gbytes_per_second",
    "inter_node_latency_us",
    "inter_node_bandwidth_gbytes_per_second",
)
OVERHEADS = ("micro_batch_overhead_seconds", "step_overhead_seconds")
TERMS = RATES + OVERHEADS
# Finite-difference steps: 5 % of a rate, 0.5 ms of an overhead.
RATE_STEP = math.log(1.05)
OVERHEAD_STEP_MS = 0.5
# A rate moves at most this far from its starting figure (x 4 either way): beyond it the model
# would explain the rows with a figure no device has; the fit stops there and the table shows it.
MOST_LOG_MULTIPLIER = math.log(4.0)
# The wave quantization share is an exponent, not a rate: any share down to none is a GEMM library
# some device has (stream-K leaves no partial wave), so it may go down to this floor, not only 4x.
LEAST_WAVE_QUANTIZATION = 0.01
ITERATIONS = 6
LAMBDA_START = 1e-2
# Stop when an iteration improves the sum of squares by less than this fraction.
CONVERGED = 1e-4
SMALLEST_FIT = 8  # rows: fewer say too little of a cluster to fit to (each fold of cross-validation too)


def starting_terms(conditions: RunConditions, device_name: str | None = None) -> CalibratedTerms:
    """Where the fit starts: the catalog's figures of the rows' device (`device_name`, default the
    conditions') and the conditions' links, as the uncalibrated model uses them, except inside a
    node, where one fitted figure stands for transfers and collectives alike and starts at the
    collectives' (they carry most of its bytes; the uncalibrated model times the few transfers at
    the conditions' link figure)."""
    device = get_device(device_name or conditions.device)
    if not device.has_compute_model():
        raise UserInputError(
            f"device '{device.name}' has no kernel-model figures in the catalog (GEMM efficiency, kernel "
            "overhead, memory bandwidth, SMs): nothing to calibrate",
        )
    links = conditions.cluster_links(device.name)
    # `cluster_links` sets the collectives' figure wherever the conditions state an in-node link.
    bandwidth = links.get("intra_node_allreduce_bandwidth_gbytes_per_second") or (
        device.intra_node_allreduce_bandwidth_gbytes_per_second or device.intra_node_bandwidth_gbytes_per_second
    )
    return CalibratedTerms(
        gemm_efficiency=float(device.gemm_efficiency),
        wave_quantization=device.gemm_wave_quantization,
        memory_bandwidth_gbytes_per_second=float(device.memory_bandwidth_gbytes_per_second),
        kernel_overhead_us=float(device.kernel_overhead_us),
        intra_node_latency_us=device.intra_node_latency_us,
        intra_node_bandwidth_gbytes_per_second=bandwidth,
        inter_node_latency_us=device.inter_node_latency_us,
        inter_node_bandwidth_gbytes_per_second=links.get(
            "inter_node_bandwidth_gbytes_per_second", device.inter_node_bandwidth_gbytes_per_second
        ),
        micro_batch_overhead_seconds=0.0,
        step_overhead_seconds=0.0,
    )


def ceilings(conditions: RunConditions, start: CalibratedTerms, device_name: str | None = None) -> dict[str, float]:
    """The most each rate may be fitted to: 4x its starting figure, and nothing a device of the kind
    cannot have. A fitted GEMM efficiency above the best shape's measured burst (the device's
    `gemm_efficiency_best`, else the peak), a memory bandwidth above the datasheet's, a collective
    or transfer inside a node faster than the link's line rate, or across nodes faster than the
    conditions' network, would explain the rows by a GPU or a link that does not exist: the fit
    would carry a cost the model misses on these rows into every other shape it is used for.
    `device_name`: the rows' device (default the conditions')."""
    device = get_device(device_name or conditions.device)
    most = {name: getattr(start, name) * math.exp(MOST_LOG_MULTIPLIER) for name in RATES}
    most["gemm_efficiency"] = min(device.gemm_efficiency_best or 1.0, 1.0)
    most["memory_bandwidth_gbytes_per_second"] = float(device.memory_bandwidth_gbytes_per_second)
    # Whole waves of the large tiles are the most a GEMM's shape can cost (`compute_model.wave_efficiency`).
    most["wave_quantization"] = 1.0
    # In a node, the fastest figure stated for it: a link's line rate, a collective's measured bus
    # bandwidth (on a fully connected part, above one peer link's), the conditions' own.
    links = conditions.cluster_links(device.name)
    most["intra_node_bandwidth_gbytes_per_second"] = min(most["intra_node_bandwidth_gbytes_per_second"], max(
        device.intra_node_bandwidth_gbytes_per_second, device.intra_node_allreduce_bandwidth_gbytes_per_second or 0.0,
        links.get("intra_node_bandwidth_gbytes_per_second") or 0.0,
        links.get("intra_node_allreduce_bandwidth_gbytes_per_second") or 0.0,
    ))  # fmt: skip
    most["inter_node_bandwidth_gbytes_per_second"] = start.inter_node_bandwidth_gbytes_per_second
    # A starting figure already beyond its ceiling (a catalog of the user's) stays where it is.
    return {name: max(value, getattr(start, name)) for name, value in most.items()}


def bounded_terms(
    conditions: RunConditions, start: CalibratedTerms, fitted: CalibratedTerms, device_name: str | None = None
) -> list[str]:
    """The rates a fit moved to a bound (up to its `ceilings`, or down to its floor, `_least_log_multiplier`): the rows ask for
    more of them than a device could have, or less than it plausibly has. (A rate that starts at its
    ceiling, the datasheet's memory bandwidth, is not seen pressing on it.)"""
    most = ceilings(conditions, start, device_name)
    return [
        name for name in RATES
        if getattr(start, name) > 0 and (
            getattr(start, name) < getattr(fitted, name) >= most[name] * (1 - 1e-6)
            or getattr(fitted, name) <= getattr(start, name) * math.exp(_least_log_multiplier(name, start)) * (1 + 1e-6)
        )
    ]  # fmt: skip


def _least_log_multiplier(name: str, start: CalibratedTerms) -> float:
    """How far below its starting figure a rate may be fitted, as a log multiplier (<= 0): 4x, or
    for the wave quantization share down to `LEAST_WAVE_QUANTIZATION`."""
    if name == "wave_quantization" and start.wave_quantization > LEAST_WAVE_QUANTIZATION:
        return math.log(LEAST_WAVE_QUANTIZATION / start.wave_quantization)
    return -MOST_LOG_MULTIPLIER


def terms_at(start: CalibratedTerms, x: Sequence[float]) -> CalibratedTerms:
    """The terms at fit coordinates `x` (log multipliers of the rates, then overheads in ms)."""
    values = {name: getattr(start, name) * math.exp(value) for name, value in zip(RATES, x)}
    values["gemm_efficiency"] = min(1.0, values["gemm_efficiency"])
    values["wave_quantization"] = min(1.0, values["wave_quantization"])
    for name, value in zip(OVERHEADS, x[len(RATES):]):
        values[name] = max(0.0, value) / 1e3
    return CalibratedTerms(**values)


def _bounded(x: np.ndarray, problem: "_Problem") -> np.ndarray:
    return np.clip(x, problem.low, problem.high)


@dataclass
class _Problem:
    """The rows and what predicting them at fit coordinates takes; predictions cached by coordinates."""

    runs: list[MeasuredRun]
    conditions: RunConditions
    start: CalibratedTerms
    workers: int
    device: str
    cache: dict[tuple[float, ...], np.ndarray]
    most: np.ndarray = field(init=False)  # the rates' `ceilings` as fit coordinates (log multipliers of their start)
    # Every term's bounds in fit coordinates: the rates' floors and ceilings, then the overheads' 0 and none.
    low: np.ndarray = field(init=False)
    high: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        most = ceilings(self.conditions, self.start, self.device)
        # A rate that starts at 0 (no kernel overhead, no latency) stays there: a multiple of 0.
        self.most = np.array([math.log(most[name] / getattr(self.start, name)) if getattr(self.start, name) > 0 else 0.0
                              for name in RATES])  # fmt: skip
        least = [_least_log_multiplier(name, self.start) for name in RATES]
        self.low = np.array([*least, *[0.0] * len(OVERHEADS)])
        self.high = np.array([*self.most, *[np.inf] * len(OVERHEADS)])

    def predict(self, x: Sequence[float]) -> np.ndarray:
        """Predicted seconds of every row at `x` (NaN where a row cannot be predicted)."""
        predictor = Predictor(self.conditions, self.runs, Calibrated(self.device, terms_at(self.start, x)))
        return np.array([_seconds(predictor.predict(run)) for run in self.runs])

    def predictions(self, points: Sequence[np.ndarray]) -> list[np.ndarray]:
        """`predict` at each point, those not cached computed in parallel."""
        keys = [tuple(float(v) for v in point) for point in points]
        missing = sorted({key for key in keys if key not in self.cache})
        if missing:
            outcomes = share(missing, [1.0] * len(missing), self.predict, lambda key: self.predict(key).tolist(),
                             workers=self.workers)  # fmt: skip
            for key, outcome in zip(missing, outcomes):
                self.cache[key] = outcome.local if outcome.local is not None else np.array(outcome.remote)
        return [self.cache[key] for key in keys]


def _seconds(prediction) -> float:
    return math.nan if prediction.predicted_seconds is None else prediction.predicted_seconds


def _pressing(x: np.ndarray, gradient: np.ndarray, problem: "_Problem") -> np.ndarray:
    """The terms at a bound whose descent direction (-gradient) points past it."""
    return ((x >= problem.high - 1e-9) & (gradient < 0)) | ((x <= problem.low + 1e-9) & (gradient > 0))


def _steps() -> np.ndarray:
    return np.array([RATE_STEP] * len(RATES) + [OVERHEAD_STEP_MS] * len(OVERHEADS))


def fit(problem: _Problem, rows: np.ndarray, measured: np.ndarray, progress: Callable[[str], None]) -> np.ndarray:
    """Fit coordinates minimising the squared relative errors of `rows` (indices into the runs)."""
    x = np.zeros(len(TERMS))
    steps = _steps()
    lam = LAMBDA_START

    def residuals(predicted: np.ndarray) -> np.ndarray:
        return predicted[rows] / measured[rows] - 1.0

    (current,) = problem.predictions([x])
    r = residuals(current)
    usable = np.isfinite(r)
    cost = float(np.sum(r[usable] ** 2))
    moving = np.ones(len(TERMS), dtype=bool)
    for iteration in range(ITERATIONS):
        terms = np.flatnonzero(moving)
        # A rate at its ceiling is differenced below it: a figure past the ceiling may not be one a
        # device can be given (a wave quantization share above 1).
        signed = np.where(x + steps > problem.high + 1e-12, -steps, steps)
        shifted = problem.predictions([x + signed[k] * np.eye(len(TERMS))[k] for k in terms])
        jacobian = np.zeros((len(r), len(TERMS)))
        for k, p in zip(terms, shifted):
            jacobian[:, k] = (residuals(p) - r) / signed[k]
        usable = np.isfinite(r) & np.all(np.isfinite(jacobian), axis=1)
        J, rr = jacobian[usable], r[usable]
        # A term no row depends on (the network between nodes, for rows of one node each) stays put,
        # and is not perturbed again.
        moving &= np.any(J != 0, axis=0)
        # A term at a bound that the descent would push past is held there for this step: solved
        # with the others and then clipped, it would bend their step away from the best one.
        free = moving & ~_pressing(x, J.T @ rr, problem)
        normal, gradient = J[:, free].T @ J[:, free], J[:, free].T @ rr
        accepted = False
        for _ in range(8):  # the damping grows until a step lowers the cost
            damped = normal + lam * np.diag(np.diag(normal)) + 1e-12 * np.eye(int(free.sum()))
            step = np.zeros(len(TERMS))
            step[free] = -np.linalg.solve(damped, gradient)
            trial = _bounded(x + step, problem)
            (predicted,) = problem.predictions([trial])
            r_trial = residuals(predicted)
            ok = np.isfinite(r_trial) & usable
            trial_cost = float(np.sum(r_trial[ok] ** 2)) if ok.sum() == usable.sum() else math.inf
            if trial_cost < cost:
                accepted = True
                break
            lam *= 4.0
        if not accepted:
            break
        improvement = (cost - trial_cost) / cost if cost > 0 else 0.0
        x, r, cost, lam = trial, r_trial, trial_cost, max(lam / 3.0, 1e-6)
        progress(f"iteration {iteration + 1}: RMS relative error {math.sqrt(cost / max(1, usable.sum())):.2%}")
        if improvement < CONVERGED:
            break
    return x


def errors_of(predicted: np.ndarray, measured: np.ndarray) -> FitErrors:
    """The error summary of predicted against measured seconds (NaN predictions left out)."""
    summary = error_summary([p / m - 1.0 for p, m in zip(predicted, measured) if math.isfinite(p)])
    if summary.rows == 0:
        return FitErrors(rows=0, median_abs_error=0, mape=0, max_abs_error=0, signed_median_error=0)
    return FitErrors(
        rows=summary.rows, median_abs_error=summary.median_abs_error, mape=summary.mape,
        max_abs_error=summary.max_abs_error, signed_median_error=summary.signed_median_error,
    )  # fmt: skip


def calibrate_runs(
    runs: list[MeasuredRun],
    conditions: RunConditions,
    *,
    rows_file: Path,
    conditions_file: Path,
    folds: int | None = DEFAULT_FOLDS,
    workers: int = 1,
    progress: Callable[[str], None] = lambda line: None,
    notice: Callable[[str], None] | None = None,
) -> RunsCalibration:
    """The rows' calibration (see the module docstring); `folds` None or 0: no cross-validation.
    `notice` hears what the fit leaves out (rows it cannot predict), `progress` by default."""
    devices = sorted({run.device or conditions.device for run in runs})
    if len(devices) > 1:
        raise UserInputError(
            f"the rows ran on {len(devices)} devices ({', '.join(devices)}): calibrate one device's rows at a time"
        )
    if len(runs) < SMALLEST_FIT:
        raise UserInputError(f"calibrate needs {SMALLEST_FIT} rows or more to fit to, not {len(runs)}")
    start = starting_terms(conditions, devices[0])
    uncalibrated = Predictor(conditions, runs)  # the catalog's and the conditions' figures as they are
    predictions = [uncalibrated.predict(run) for run in runs]
    predicted = [p for p in predictions if p.predicted_seconds is not None]
    if len(predicted) < SMALLEST_FIT:
        first = next((p for p in predictions if p.problem), None)
        raise UserInputError(
            f"only {len(predicted)} of {len(runs)} rows can be predicted: calibrate needs {SMALLEST_FIT} or more"
            + (f" (line {first.run.line}: {first.problem})" if first else ""),
            hint="pipectl validate MEASURED.csv --conditions CONDITIONS.yaml says why of each row",
        )
    suspicion = unit_suspicion(predicted)
    if suspicion is not None:  # terms fitted to times 1000x off would each go to a bound, and mean nothing
        raise UserInputError(suspicion, hint="pipectl validate MEASURED.csv --conditions CONDITIONS.yaml compares each row")
    for left_out in (p for p in predictions if p.predicted_seconds is None):  # fitted to the others, and said so
        (notice or progress)(f"line {left_out.run.line}: left out, not predicted: {left_out.problem}")
    runs, predictions = [p.run for p in predicted], predicted
    # Each fold fits to the rows the others hold: as many as a fit needs, like the whole.
    allowed = [f for f in range(2, len(runs) // 2 + 1) if len(runs) - -(-len(runs) // f) >= SMALLEST_FIT]
    if folds and folds not in allowed:
        raise UserInputError(
            f"--folds {folds}: each fold holds 2 rows or more and fits to the rows the other folds hold, "
            f"{SMALLEST_FIT} or more, of {len(runs)} predicted rows",
            hint=f"use {allowed[0]} to {allowed[-1]}, or 0 for none" if allowed else "use 0 (no cross-validation), or "
            "give more rows",
        )
    before = np.array([_seconds(p) for p in predictions])
    problem = _Problem(runs, conditions, start, workers, devices[0], {})
    measured = np.array([run.measured_seconds for run in runs])
    everything = np.arange(len(runs))
    # Fewer rows than terms: the fit is damped and bounded, so the terms the rows cannot tell apart
    # stay near their starting figures; said, not refused (a small job log is still worth fitting).
    fewer = " (fewer rows than terms: those the rows cannot tell apart stay near the device's figures)" \
        if len(runs) < len(TERMS) else ""
    progress(f"fitting {len(TERMS)} terms to {len(runs)} rows{fewer}")
    x = fit(problem, everything, measured, progress)
    (after,) = problem.predictions([x])
    cross_validated = None
    if folds:
        held_out = np.full(len(runs), math.nan)
        for fold in range(folds):
            test = everything[everything % folds == fold]
            progress(f"fold {fold + 1} of {folds}: fitting to {len(runs) - len(test)} rows, predicting {len(test)}")
            x_fold = fit(problem, everything[everything % folds != fold], measured, lambda line: None)
            (predicted,) = problem.predictions([x_fold])
            held_out[test] = predicted[test]
        cross_validated = errors_of(held_out, measured)
    return RunsCalibration(
        device=devices[0],
        framework=conditions.framework,
        rows_file=str(rows_file),
        rows_sha256=sha256_file(rows_file),
        conditions_sha256=sha256_file(conditions_file),
        rows=len(runs),
        uncalibrated=start,
        terms=terms_at(start, x),
        before=errors_of(before, measured),
        after=errors_of(after, measured),
        folds=folds or None,
        cross_validated=cross_validated,
    )
