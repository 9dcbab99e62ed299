"""PipeDream-2BW's steady state for the planner: `two_bw_steady_state`'s figure, from waves.

`pipectl.plan.twobw_steady_state.two_bw_steady_state` defines the figure: the run of T + K + 1 updates
in `two_bw_order`'s order (1F1B across updates, no flush, stage s's update U j right after its
backward of micro-batch jm − 1), the mean interval between updates T and T + K, the largest over
stages, with (T, K) from `steady_state_window`. Its event simulation walks every operation in
Python (about 10 µs each: seconds for one candidate of p = 38, m = 308), too slow for a search
that times dozens of 2BW candidates. This module computes the same update ends from the same
order and the same timing rules, in waves as `pipectl.plan.fast.waves` times 1F1B:

* **Waves.** That order is 1F1B's warm-up (stage s: p − s − 1 forwards) and then one pair per
  wave on every stage: in wave n, stage s runs F(n + p − s − 1), R(n) (with recomputation, not on
  the last stage), B(n), and U(j) after it when n = jm − 1. F's input comes from the stage before
  in wave n − 1, B's from the stage after in the same wave: the chain over the stages of
  `waves._backward_chain`. Every wave up to the last update measured is such a full wave when
  m ≥ p − 1 (the run's final drain comes after it), so one wave is a handful of vector operations.
* **Skips.** Between two updates the waves are the same max-plus map; once the state (each
  stage's clock and last forward's end) repeats shifted by a constant, the remaining waves before
  the next update are skipped (the repeat as in `waves._History`). Each update is the same map of
  the state at its start, so once the state after an update repeats shifted, every later update
  follows, and the ends of updates T and T + K are read off the repeat.

Exposed communication is counted as in `pipectl.plan.simulate`: the part of an operation's wait
for its input that lies after its producer had finished. Tests (tests/plan/test_twobw_pricing.py)
hold the update time equal to `two_bw_steady_state` to 1e-12 relative on random costs.

    >>> from pipectl.plan.stage_costs import uniform_costs
    >>> state = steady_state(4, 8, False, uniform_costs(4, 1, 1.0, 2.0), (8, 12))
    >>> state.update_seconds  # m (t_f + t_b) with uniform stages and free communication
    24.0
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipectl.plan.fast.periodic import PERIOD_ULPS, LinearRegime, skip_repeats
from pipectl.plan.fast.waves import _backward_chain, _backward_suffix, _chain_warmup, _History, _start_after_input

__all__ = ["SteadyState", "steady_state"]

_MAX_UPDATE_CYCLE = 8  # updates compared when looking for a repeat across updates


@dataclass(frozen=True)
class SteadyState:
    """2BW's steady state over the window: the time per update and, per stage, the exposed waiting
    for transfers per update (all-reduce not included)."""

    update_seconds: float
    exposed_seconds: np.ndarray


def steady_state(pipeline_parallel: int, micro_batches: int, recompute: bool, costs,
                 window: tuple[int, int]) -> SteadyState:
    """`two_bw_steady_state`'s update time for `costs` (a `StageCosts`, one chunk; jitter and
    blocking transfers ignored, as there) over `window` = (T, K), with m ≥ p − 1.

    The update U is the stage's all-reduce plus its optimizer step.
    """
    p, m = pipeline_parallel, micro_batches
    transient, averaged = window
    last_update = transient + averaged
    forward = np.asarray(costs.forward_seconds, dtype=float)
    backward = np.asarray(costs.backward_seconds, dtype=float)
    recomputes = np.zeros(p)
    if recompute and p > 1:
        recomputes[: p - 1] = np.asarray(costs.recompute_seconds, dtype=float)[: p - 1]
    send_forward = np.asarray(costs.send_forward_seconds, dtype=float)
    send_backward = np.append(np.asarray(costs.send_backward_seconds, dtype=float), 0.0)
    update = np.asarray(costs.allreduce_seconds, dtype=float) + np.asarray(costs.optimizer_seconds, dtype=float)
    ranks = np.arange(p)
    forward_in = np.concatenate(([0.0], send_forward))  # rank k's input transfer from k − 1
    forward_fed = ranks > 0
    backward_fed = ranks < p - 1
    suffix = _backward_suffix(backward, send_backward)
    tail = np.zeros(1)

    def wave(last, forward_end, exposed, margins=None):
        """One wave on every stage: F, R, B (with each max's margins appended to `margins`)."""
        produced = np.concatenate((tail, forward_end[:-1]))
        start, exposed = _start_after_input(last, produced, forward_in, forward_fed, exposed, margins)
        forward_end = start + forward
        free = forward_end + recomputes
        backward_end = _backward_chain(free, backward, suffix, margins)
        produced = np.concatenate((backward_end[1:], tail))
        _, exposed = _start_after_input(free, produced, send_backward, backward_fed, exposed, margins)
        return backward_end, forward_end, exposed

    # Before wave 0 each stage runs its warm-up forwards only (the forward grid, in closed form).
    last, exposed = _chain_warmup(p, (last_update + 1) * m, forward, send_forward)
    forward_end = last.copy()
    ends: list[np.ndarray] = []  # ends[j - 1]: per stage, when its update j ends
    exposed_after: list[np.ndarray] = []
    states: list[np.ndarray] = []
    for j in range(1, last_update + 1):
        last, forward_end, exposed = _between_updates(wave, m - 1, p, last, forward_end, exposed)
        last, forward_end, exposed = wave(last, forward_end, exposed)
        last = last + update
        ends.append(last)
        exposed_after.append(exposed)
        states.append(np.concatenate((last, forward_end)))
        cycle = _repeat(states)
        if cycle is not None:
            ends, exposed_after = _extended(ends, exposed_after, cycle, last_update)
            break
    spans = ends[last_update - 1] - ends[transient - 1]
    return SteadyState(
        update_seconds=float(np.max(spans)) / averaged,
        exposed_seconds=(exposed_after[last_update - 1] - exposed_after[transient - 1]) / averaged,
    )


def _between_updates(wave, waves: int, ranks: int, last, forward_end, exposed):
    """`waves` waves without an update, skipping as `waves.pair_schedule_ends` skips the steady
    waves of a step: whole repeats once the state repeats shifted, and linear stretches
    (`LinearRegime`) before that."""
    if waves <= 0:
        return last, forward_end, exposed
    final = waves - 1  # the last wave (0-based) a skip may land on
    history = _History(ranks, 1, 0, final)
    regime: LinearRegime | None = None
    index = 0
    while index < waves:
        margins = regime.margins[0] if regime is not None else None
        last, forward_end, exposed = wave(last, forward_end, exposed, margins)
        if history.enabled:
            state = np.concatenate((last, forward_end, last))  # `_History` keeps three entries per rank
            index, state, exposed, regime = skip_repeats(history, regime, index, state, exposed, final)
            last, forward_end, _ = state.reshape(3, -1)  # views, as np.split's
        if index >= final:
            regime = None
        index += 1
    return last, forward_end, exposed


def _repeat(states: list[np.ndarray]) -> tuple[int, float] | None:
    """(c, shift) when the state after the latest update is the one c updates before, shifted."""
    latest = states[-1]
    tolerance = PERIOD_ULPS * float(np.spacing(np.max(np.abs(latest))))
    for lag in range(1, min(len(states) - 1, _MAX_UPDATE_CYCLE) + 1):
        difference = latest - states[-1 - lag]
        if np.max(np.abs(difference - difference[0])) <= tolerance:
            return lag, float(difference[0])
    return None


def _extended(ends: list, exposed_after: list, cycle: tuple[int, float], last_update: int):
    """The update ends and exposed times up to `last_update`, the later ones from the repeat."""
    lag, shift = cycle
    base = len(ends) - lag  # update `base` (1-based) starts the repeating stretch
    per_cycle = exposed_after[-1] - exposed_after[base - 1]
    ends, exposed_after = list(ends), list(exposed_after)
    for j in range(len(ends) + 1, last_update + 1):
        cycles, offset = divmod(j - base, lag)
        ends.append(ends[base + offset - 1] + cycles * shift)
        exposed_after.append(exposed_after[base + offset - 1] + cycles * per_cycle)
    return ends, exposed_after
