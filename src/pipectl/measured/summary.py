"""How well predictions match measured runs: errors over the rows, and per group how well they rank.

Each row's error is (predicted - measured) / measured. Over the rows: the median and the mean of
|error| (MAPE), the largest |error|, and the signed median (negative: predictions run fast).

A planner's purpose is to rank layouts, so the rows are also grouped by what makes their layouts
compete (one model shape on one GPU count at one global batch, `MeasuredRun.group`). Per group:

- Spearman's rank correlation ρ between predicted and measured step times (tied values take their
  mean rank; undefined below two rows or where either side is constant);
- the regret: the measured time of the layout pipectl predicts fastest over the group's measured
  best, less one (0: pipectl would have picked the best layout measured). Where several layouts
  tie for fastest, the slowest of them counts; the best is over every row of the group, those
  pipectl could not predict included.

    >>> spearman([1.0, 2.0, 3.0], [10.0, 30.0, 20.0])
    0.5
    >>> round(regret([1.0, 2.0, 3.0], [12.0, 10.0, 11.0]), 3)
    0.2
    >>> round(regret([1.0, 1.0, 2.0], [10.0, 11.0, 12.0]), 3)  # a tie for fastest: the slower counts
    0.1
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from pipectl.measured.predict import Prediction


@dataclass(frozen=True)
class ErrorSummary:
    rows: int  # rows with a prediction
    median_abs_error: float | None
    mape: float | None
    max_abs_error: float | None
    signed_median_error: float | None
    unpredicted: int = 0  # rows without one (each says why)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GroupSummary:
    key: str
    rows: int  # rows with a prediction
    spearman: float | None
    regret: float | None
    best_measured: str  # the layout measured fastest
    ranked_first: str  # the layout pipectl predicts fastest
    unpredicted: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarise_errors(predictions: Sequence[Prediction]) -> ErrorSummary:
    errors = [p.error for p in predictions if p.error is not None]
    return error_summary(errors, unpredicted=len(predictions) - len(errors))


def error_summary(errors: Sequence[float], unpredicted: int = 0) -> ErrorSummary:
    """Median and mean |error|, the largest, and the signed median of (predicted - measured) / measured."""
    if not errors:
        return ErrorSummary(0, None, None, None, None, unpredicted)
    absolute = [abs(e) for e in errors]
    return ErrorSummary(
        rows=len(errors),
        median_abs_error=statistics.median(absolute),
        mape=statistics.fmean(absolute),
        max_abs_error=max(absolute),
        signed_median_error=statistics.median(errors),
        unpredicted=unpredicted,
    )


def summarise_groups(predictions: Sequence[Prediction]) -> list[GroupSummary]:
    """One summary per group with a predicted row, in the order groups first appear."""
    groups: dict[str, list[Prediction]] = {}
    for p in predictions:
        groups.setdefault(p.run.group, []).append(p)
    out = []
    for key, members in groups.items():
        predicted_rows = [p for p in members if p.predicted_seconds is not None]
        if not predicted_rows:
            continue
        predicted = [p.predicted_seconds for p in predicted_rows]
        measured = [p.run.measured_seconds for p in predicted_rows]
        best = min(members, key=lambda p: p.run.measured_seconds)
        first = _fastest_predicted(predicted, measured)
        out.append(GroupSummary(
            key=key,
            rows=len(predicted_rows),
            spearman=spearman(predicted, measured),
            regret=measured[first] / best.run.measured_seconds - 1.0,
            best_measured=best.run.layout_label,
            ranked_first=predicted_rows[first].run.layout_label,
            unpredicted=len(members) - len(predicted_rows),
        ))  # fmt: skip
    return out


def _fastest_predicted(predicted: Sequence[float], measured: Sequence[float]) -> int:
    """The row predicted fastest; of several tied, the one measured slowest (ties do not flatter)."""
    fastest = min(predicted)
    return max((i for i, value in enumerate(predicted) if value == fastest), key=lambda i: measured[i])


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            out[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return out


def spearman(predicted: Sequence[float], measured: Sequence[float]) -> float | None:
    """Pearson's correlation of the ranks; None below two rows or where a side is constant."""
    if len(predicted) < 2:
        return None
    a, b = ranks(predicted), ranks(measured)
    mean_a, mean_b = statistics.fmean(a), statistics.fmean(b)
    covariance = sum((x - mean_a) * (y - mean_b) for x, y in zip(a, b))
    spread = (sum((x - mean_a) ** 2 for x in a) * sum((y - mean_b) ** 2 for y in b)) ** 0.5
    return None if spread == 0 else covariance / spread


def regret(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """The measured time of the row predicted fastest over the measured best, less one."""
    return measured[_fastest_predicted(predicted, measured)] / min(measured) - 1.0


@dataclass(frozen=True)
class StepParts:
    """A step's time by what repeats it (seconds): per block and micro-batch (forward, recomputed
    forward and backward of one block on one micro-batch), per micro-batch outside the blocks
    (embedding, head, loss and the framework's own work), per block and step and per step, the
    last two for each number of replicas d (the optimizer's share and the gradient reduction)."""

    block_micro_batch: float
    micro_batch: float
    block_step: dict[int, float]
    step: dict[int, float]

    def to_dict(self) -> dict[str, Any]:
        return {"block_micro_batch_seconds": self.block_micro_batch, "micro_batch_seconds": self.micro_batch,
                "block_step_seconds": {f"d{d}": v for d, v in self.block_step.items()},
                "step_seconds": {f"d{d}": v for d, v in self.step.items()}}  # fmt: skip


@dataclass(frozen=True)
class TimeSplit:
    """Where the steps of one shape, t and b without a pipeline go, measured and predicted."""

    key: str
    rows: int
    measured: StepParts
    predicted: StepParts
    largest_residual: float  # of the measured steps against their parts, relative
    zero_stage: int | None = None  # the rows' own ZeRO stage (None: the conditions')

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "rows": self.rows, "measured": self.measured.to_dict(),
                "predicted": self.predicted.to_dict(), "largest_residual": self.largest_residual}  # fmt: skip


def time_split(predictions: Sequence[Prediction]) -> list[TimeSplit]:
    """Where a step's time goes, measured and predicted alike, for rows without a pipeline (p = 1).

    Rows of one shape, t and b (and device, ZeRO stage, recomputation and schedule, where rows give
    them) differ in layers l, micro-batches m (B / (b d), rounded up) and replicas d; such a step is m l x a block's work on one micro-batch, m x a micro-batch's work
    outside the blocks, l x a block's share of the end of the step at its d, and a fixed part at its
    d. Least squares of the steps on those counts gives the parts from the measured times and, the
    same way, from the predicted ones: a model that misses one part shows it there, whatever the
    others do. Groups whose rows cannot tell the parts apart (one m, one l, or fewer independent rows
    than parts) are left out.

        >>> from pipectl.measured.runs import MeasuredRun
        >>> def step(m, l, d): return m * l * 3e-3 + m * 7e-3 + l * (0.4e-3 + 0.1e-3 * d) + 2e-3
        >>> runs = [MeasuredRun(line=0, gpus=d, global_batch=m * d, micro_batch=1, hidden=1024, heads=16,
        ...                     layers=l, seq_len=1024, tensor_parallel=1, data_parallel=d, pipeline_parallel=1,
        ...                     measured_seconds=step(m, l, d))
        ...         for m in (2, 4) for l in (12, 24) for d in (2, 4)]
        >>> (split,) = time_split([Prediction(run, run.measured_seconds * 0.9) for run in runs])
        >>> round(split.measured.block_micro_batch * 1e3, 3), round(split.measured.block_step[4] * 1e3, 3)
        (3.0, 0.8)
        >>> round(split.predicted.micro_batch * 1e3, 3)
        6.3
    """
    import numpy as np

    groups: dict[tuple, list[Prediction]] = {}
    for p in predictions:
        r = p.run
        if r.pipeline_parallel == 1 and p.predicted_seconds is not None:
            key = (r.hidden, r.heads, r.seq_len, r.tensor_parallel, r.micro_batch,
                   r.device, r.zero_stage, r.recompute, r.schedule)  # fmt: skip
            groups.setdefault(key, []).append(p)
    out = []
    ordered = sorted(groups.items(), key=lambda item: (item[0][:5], str(item[0][5:])))  # numbers, then the rest
    for (h, a, s, t, b, device, zero_stage, *_), rows in ordered:
        ms = [-(-p.run.global_batch // (b * p.run.data_parallel)) for p in rows]
        ds = sorted({p.run.data_parallel for p in rows})
        if len(set(ms)) < 2 or len({p.run.layers for p in rows}) < 2:
            continue  # the per-micro-batch and per-step parts cannot be told apart
        counts = np.array([
            [m * p.run.layers, m] + [p.run.layers * (p.run.data_parallel == d) for d in ds]
            + [float(p.run.data_parallel == d) for d in ds]
            for m, p in zip(ms, rows)
        ])  # fmt: skip
        if np.linalg.matrix_rank(counts) < counts.shape[1]:
            continue  # fewer independent rows than parts (two rows, one d): any split would be one of many
        parts = []
        for times in ([p.run.measured_seconds for p in rows], [p.predicted_seconds for p in rows]):
            times = np.array(times)
            fitted, *_ = np.linalg.lstsq(counts, times, rcond=None)
            parts.append((StepParts(
                block_micro_batch=float(fitted[0]), micro_batch=float(fitted[1]),
                block_step={d: float(v) for d, v in zip(ds, fitted[2:2 + len(ds)])},
                step={d: float(v) for d, v in zip(ds, fitted[2 + len(ds):])},
            ), float(np.max(np.abs(times - counts @ fitted) / times))))  # fmt: skip
        (measured, residual), (predicted, _) = parts
        label = f"h{h} a{a} s{s} t{t} b{b}" + (f" {device}" if device else "")
        out.append(TimeSplit(label, len(rows), measured, predicted, residual, zero_stage))
    return out


# How far a block's share of the end of the step must fall from the fewest replicas to the most
# (relative) to say that the optimizer state is split over them: a threshold, not a fit; below the
# 4-5 % fall of vTrain's A100 rows (`benchmarks/measured_runs.py`, `zero_stage_readings`).
SHARDED_FALL = 0.03


def split_optimizer_evidence(splits: Sequence[TimeSplit], stated_zero_stage: int) -> str | None:
    """Where rows priced with ZeRO stage 0 behave as if the optimizer state were split over the
    replicas, the first such group in words; else None.

    Under stage 0 every replica runs the whole optimizer step and the gradient reduction only grows
    with d, so a block's share of the end of the step cannot fall as d grows; under stage 1 or more
    the optimizer's part is 1/d and it can.

        >>> parts = lambda shares: StepParts(3e-3, 9e-3, shares, {d: 1e-3 for d in shares})
        >>> falling = TimeSplit("h2048 a16 s1024 t1 b1", 48, parts({2: 1.49e-3, 4: 1.44e-3, 8: 1.42e-3}),
        ...                     parts({2: 2.3e-3, 4: 2.6e-3, 8: 2.8e-3}), 0.0)
        >>> split_optimizer_evidence([falling], 0)
        'h2048 a16 s1024 t1 b1: 1.49 ms at d = 2, 1.42 ms at d = 8'
        >>> split_optimizer_evidence([falling], 1) is None
        True
    """
    for split in splits:
        stage = stated_zero_stage if split.zero_stage is None else split.zero_stage
        shares = split.measured.block_step
        if stage != 0 or len(shares) < 2:
            continue
        fewest, most = min(shares), max(shares)
        if shares[most] < shares[fewest] * (1 - SHARDED_FALL):
            return (f"{split.key}: {shares[fewest] * 1e3:.2f} ms at d = {fewest}, "
                    f"{shares[most] * 1e3:.2f} ms at d = {most}")  # fmt: skip
    return None


# Predictions miss by tens of percent, not by a factor of 30: a median that far off is a unit.
UNIT_SUSPECT_RATIO = 30.0


def unit_suspicion(predictions: Sequence[Prediction]) -> str | None:
    """What to ask when the measured times are all a factor of ~1000 from their predictions (most
    likely written in seconds, or microseconds, under the header that says milliseconds); None else."""
    ratios = [p.predicted_seconds / p.run.measured_seconds for p in predictions if p.error is not None]
    if not ratios:
        return None
    ratio = statistics.median(ratios)
    if 1 / UNIT_SUSPECT_RATIO < ratio < UNIT_SUSPECT_RATIO:
        return None
    side = f"{ratio:.0f}x below" if ratio > 1 else f"{1 / ratio:.0f}x above"
    return f"the measured times are a median {side} their predictions: is the column 'iteration time (ms)' in milliseconds?"
