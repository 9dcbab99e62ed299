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
