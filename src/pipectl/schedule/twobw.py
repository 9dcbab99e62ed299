"""PipeDream-2BW across steps: no flush, two weight versions per stage (Narayanan et al.,
"Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021, §3.1).

`generators.pipedream_2bw` gives one step's order, which is 1F1B's. What makes 2BW different happens
*between* steps, and this module describes it:

* **Order.** Each stage runs 1F1B over the whole run without a flush: stage s warms up with
  w_s = p − s − 1 forwards once, at the start of the run, then alternates one forward and one
  backward, across step boundaries, and drains only at the end of the run. Micro-batches are
  numbered over the whole run (index i = k − 1 for the paper's 1-based k).
* **Updates.** After its backward of the last micro-batch of each group of m (B(jm − 1)), stage s
  applies update j (`U j`): the m accumulated gradients (and, with data parallelism, the
  all-reduce) make weight version j. No stage waits for another one to do so.
* **Versions.** Micro-batch k (1-based) runs forward *and* backward with version
  max(⌊(k−1)/m⌋ − 1, 0) on every stage (`weight_version`), so update j applies gradients computed
  on version j − 2: W(t+1) = W(t) − ν ∇f(W(t−1)), 1-stale. Each stage keeps two buffers: update j
  overwrites the one holding version j − 2, whose last micro-batch has just run its backward.
  `plan.twobw_steady_state.simulate_two_bw_run` plays this double buffer in each stage's order and records, per micro-batch, the
  version its forward found and the one its backward found in the same buffer.
* **Requirement.** Batch j's first forward on stage s needs version j − 1, made by update j − 1
  after B(s, (j−1)m − 1), which the order puts before F(s, jm) only when m ≥ w_s. So 2BW with two
  versions needs m ≥ p − 1; with fewer, stage 0 would need a version it has not made yet
  (`check_micro_batches` says so).

Worked example, p = 2 stages, m = 2 micro-batches per update, a run of three updates:

    >>> order = two_bw_order(2, 2, 3)
    >>> print(order_text(order))
    0: F0 F1 B0 F2 B1 U1 F3 B2 F4 B3 U2 F5 B4 B5 U3
    1: F0 B0 F1 B1 U1 F2 B2 F3 B3 U2 F4 B4 F5 B5 U3

Its timing and memory (the double buffer played in this order) are `plan.twobw_steady_state`.
"""

from __future__ import annotations

from typing import NamedTuple

from pipectl.errors import ScheduleError
from pipectl.schedule.generators import _check_degrees

FORWARD, RECOMPUTE, BACKWARD, UPDATE = "F", "R", "B", "U"


class TwoBWOp(NamedTuple):
    """One operation of a stage: F/R/B of micro-batch `index` (0-based over the run), or U of update
    `index` (1-based: update j makes weight version j)."""

    kind: str
    index: int

    def __str__(self) -> str:
        return f"{self.kind}{self.index}"


def check_micro_batches(pipeline_parallel: int, micro_batches: int) -> None:
    """2BW with two weight versions needs m ≥ p − 1 micro-batches per update (module docstring).

    >>> check_micro_batches(4, 2)
    Traceback (most recent call last):
    ...
    pipectl.errors.ScheduleError: PipeDream-2BW with two weight versions needs at least p - 1 = 3 micro-batches per update, got m=2: stage 0 would start the micro-batches that make update j + 1, which use weight version j - 1, before its update j - 1 has made it
    """
    _check_degrees(pipeline_parallel, micro_batches)
    if micro_batches < pipeline_parallel - 1:
        raise ScheduleError(
            f"PipeDream-2BW with two weight versions needs at least p - 1 = {pipeline_parallel - 1} "
            f"micro-batches per update, got m={micro_batches}: stage 0 would start the micro-batches that "
            "make update j + 1, which use weight version j - 1, before its update j - 1 has made it",
            hint=f"use m >= {pipeline_parallel - 1} micro-batches per update, or fewer pipeline stages",
        )


def two_bw_order(
    pipeline_parallel: int, micro_batches: int, updates: int, recompute: bool = False
) -> dict[int, tuple[TwoBWOp, ...]]:
    """Each stage's operations over a run of `updates` updates of m micro-batches, no flush.

    1F1B over all `updates` × m micro-batches (warm-up once, drain once, at the end of the run),
    with U j right after the stage's backward of micro-batch jm − 1. With `recompute`, R(i) comes
    right before B(i) on every stage but the last (as `generators.pipedream_2bw`).
    """
    p, m = pipeline_parallel, micro_batches
    check_micro_batches(p, m)
    if not isinstance(updates, int) or isinstance(updates, bool) or updates < 1:
        raise ScheduleError(f"updates must be a whole number >= 1, got {updates!r}")
    total = updates * m
    orders: dict[int, tuple[TwoBWOp, ...]] = {}
    for s in range(p):
        warmup = min(p - s - 1, total)
        # 1F1B: forward warmup + i, then backward i (in the final drain, no forward is left)
        order = [TwoBWOp(FORWARD, i) for i in range(warmup)]
        for i in range(total):
            if warmup + i < total:
                order.append(TwoBWOp(FORWARD, warmup + i))
            if recompute and s != p - 1:
                order.append(TwoBWOp(RECOMPUTE, i))
            order.append(TwoBWOp(BACKWARD, i))
            if (i + 1) % m == 0:
                order.append(TwoBWOp(UPDATE, (i + 1) // m))
        orders[s] = tuple(order)
    return orders


def order_text(orders: dict[int, tuple[TwoBWOp, ...]]) -> str:
    """One line per stage: `stage: op op ...`."""
    return "\n".join(f"{s}: " + " ".join(str(op) for op in ops) for s, ops in sorted(orders.items()))


__all__ = ["BACKWARD", "FORWARD", "RECOMPUTE", "UPDATE", "TwoBWOp", "check_micro_batches", "order_text", "two_bw_order"]
