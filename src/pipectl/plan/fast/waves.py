"""Step time of the synchronous schedules without building them: waves and a periodic jump.

The planner times schedules of up to thousands of micro-batches on up to a hundred stages, many
times over (the ranking and the morph table). The event-driven simulator (`simulate.py`) walks every
action; this module gives the same step time (to rounding: the test holds it to 1e-12 relative on
random non-uniform costs) from the structure of GPipe, 1F1B (and PipeDream-2BW, same order) and
interleaved 1F1B, in far fewer operations. It relies on two facts:

1. **Waves.** 1F1B-like orders are "warm-up forwards, then forward/backward pairs, then drain
   backwards" on every rank. Number rank k's forwards j = 0, 1, ... and backwards i = 0, 1, ... in
   its own order and put forward j in wave j + α_k and backward i in wave i + β_k, with
   α_k = β_k − W_k (W_k = the rank's warm-up forwards), so a pair's forward and backward share a
   wave and a rank's actions come in wave order, forward before backward. The offsets are chosen
   so that every cross-stage input comes from the previous wave, except in plain 1F1B where a
   backward's input comes from the next rank in the same wave (a chain over the ranks, solved as
   one running maximum). One wave is a handful of vector operations over the ranks.

2. **Periodicity.** In the steady part of the step one wave (a period of p·v waves for
   interleaved) maps the ranks' state (end of the last action, of the last forward, of the last
   backward) to the next by the same max-plus linear map, so once the state repeats shifted by
   a constant the remaining steady waves are skipped by adding that constant per period, and
   stretches where each group of ranks grows at its own rate (nearly equal stages using up the
   head start the upstream ranks took in the warm-up) are skipped up to the wave where some max
   could change its choice (`pipectl.plan.fast.periodic`). The warm-up and the drain are
   simulated.

GPipe needs no simulation at all: with constant per-stage costs the longest path through its
forward grid (and its backward grid) puts every extra micro-batch on the slowest stage, which gives
the closed form in `gpipe_compute_ends`.

Communication is an edge delay, as in the simulator; jitter (random per-transfer delays) is not
periodic, so callers use the event-driven simulator when `jitter_seconds > 0`. Varuna's
rule-based order has no wave structure: `pipectl.plan.fast.varuna` times it.

    >>> from pipectl.plan.stage_costs import uniform_costs
    >>> from pipectl.schedule import ScheduleKind
    >>> step_seconds(ScheduleKind.ONE_F_ONE_B, 4, 1000, 1, False, uniform_costs(4, 1, 1.0, 2.0))
    3009.0
    >>> (1000 + 4 - 1) * (1.0 + 2.0)
    3009.0
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipectl.plan.fast.periodic import PERIOD_ULPS, LinearRegime, skip_repeats
from pipectl.plan.simulate import StepSummary
from pipectl.schedule.ir import ScheduleKind

__all__ = ["gpipe_compute_ends", "pair_schedule_ends", "step_seconds", "summary", "supported"]

_CHECK_EVERY = 4  # steady waves between two searches for a repeat
_ZERO = np.zeros(1)


def supported(kind: ScheduleKind, jitter_seconds: float) -> bool:
    """Whether this module handles the schedule kind (Varuna and jitter: simulate instead)."""
    return jitter_seconds == 0 and kind in (
        ScheduleKind.GPIPE,
        ScheduleKind.ONE_F_ONE_B,
        ScheduleKind.PIPEDREAM_2BW,
        ScheduleKind.INTERLEAVED,
    )


@dataclass(frozen=True)
class _Tables:
    forward: np.ndarray
    backward: np.ndarray
    recomputes: np.ndarray  # 0 where the stage does not recompute
    send_forward: np.ndarray  # padded with a trailing 0 (index -1 and the last stage read it)
    send_backward: np.ndarray
    allreduce: np.ndarray
    optimizer: np.ndarray


def _tables(stages: int, recompute: bool, costs) -> _Tables:
    recomputes = np.zeros(stages)
    if recompute and stages > 1:
        recomputes[: stages - 1] = np.asarray(costs.recompute_seconds, dtype=float)[: stages - 1]
    return _Tables(
        forward=np.asarray(costs.forward_seconds, dtype=float),
        backward=np.asarray(costs.backward_seconds, dtype=float),
        recomputes=recomputes,
        send_forward=np.append(np.asarray(costs.send_forward_seconds, dtype=float), 0.0),
        send_backward=np.append(np.asarray(costs.send_backward_seconds, dtype=float), 0.0),
        allreduce=np.asarray(costs.allreduce_seconds, dtype=float),
        optimizer=np.asarray(costs.optimizer_seconds, dtype=float),
    )


def _warmup(kind: ScheduleKind, p: int, m: int, v: int) -> np.ndarray:
    """Forwards each rank runs before its first backward (as the generators order them)."""
    ranks = np.arange(p)
    if kind is ScheduleKind.GPIPE:
        return np.full(p, m)
    if kind is ScheduleKind.INTERLEAVED and v > 1:
        if m == p:
            return np.full(p, m * v)
        return np.minimum(2 * (p - 1 - ranks) + (v - 1) * p, m * v)
    return np.minimum(p - 1 - ranks, m)


def step_seconds(kind: ScheduleKind, pipeline_parallel: int, micro_batches: int, chunks: int,
                 recompute: bool, costs) -> float:
    """The step time the event-driven simulator gives for `generate(kind, p, m, v, recompute)`.

    `costs` is a `pipectl.plan.stage_costs.StageCosts` (already checked by the caller) with no jitter.
    """
    p, m, v = pipeline_parallel, micro_batches, chunks
    t = _tables(p * v, recompute, costs)
    if kind is ScheduleKind.GPIPE:
        ends = gpipe_compute_ends(m, t.forward, t.backward, t.recomputes, t.send_forward, t.send_backward)
    else:
        ends, _ = pair_schedule_ends(kind, p, m, v, t)
    # The all-reduce follows the rank's last compute action, the optimizer step follows it.
    return float(np.max((ends + t.allreduce) + t.optimizer))


def summary(kind: ScheduleKind, pipeline_parallel: int, micro_batches: int, chunks: int,
            recompute: bool, costs) -> StepSummary:
    """Step time, idle fraction and exposed communication per rank, as `simulate` reports them."""
    p, m, v = pipeline_parallel, micro_batches, chunks
    t = _tables(p * v, recompute, costs)
    ends, exposed = pair_schedule_ends(kind, p, m, v, t)
    if kind is ScheduleKind.GPIPE:
        # The same figure `step_seconds` gives (the closed form), so rankings and records agree.
        ends = gpipe_compute_ends(m, t.forward, t.backward, t.recomputes, t.send_forward, t.send_backward)
    step = float(np.max((ends + t.allreduce) + t.optimizer))
    per_stage = m * (t.forward + t.backward + t.recomputes)
    busy = per_stage.reshape(v, p).sum(axis=0) + t.allreduce + t.optimizer
    idle = np.maximum(step - busy, 0.0)
    exposed = exposed + t.allreduce
    return StepSummary(
        step_seconds=step,
        bubble_fraction=tuple((idle / step).tolist()) if step > 0 else (0.0,) * p,
        communication_seconds=float(np.max(exposed)),
        communication_seconds_per_rank=tuple(exposed.tolist()),
    )


def gpipe_compute_ends(m, forward, backward, recomputes, send_forward, send_backward) -> np.ndarray:
    """Per rank: the end of its last backward under GPipe (all forwards, then all backwards).

    Forward grid: F(s, i) ends at max(F(s, i−1), F(s−1, i) + c_{s−1}) + f_s. Its longest path
    from F(0, 0) to F(s, m−1) crosses every stage up to s once and spends the other m − 1
    micro-batches on the slowest of them:

        E_s = Σ_{s'≤s} f_{s'} + Σ_{s'<s} c_{s'} + (m − 1) · max_{s'≤s} f_{s'}.

    Backward grid (R(s, i) before B(s, i) when recomputing, never on the last stage):
    B(s, i) ends at max(B(s, i−1) + r_s, B(s+1, i) + c'_s) + b_s, with B(s, −1) = E_s. A longest
    path enters at some stage s0 ≥ s after its forwards and climbs to s, so

        B(s, m−1) = max_{s0≥s} [E_{s0} + r_{s0} + b_{s0} + Σ_{s≤s'<s0} (c'_{s'} + b_{s'})
                                 + (m − 1) · max_{s≤s'≤s0} (r_{s'} + b_{s'})].
    """
    p = len(forward)
    extra = m - 1
    forward_ends = np.cumsum(forward) + np.concatenate(([0.0], np.cumsum(send_forward[:-1]))) \
        + extra * np.maximum.accumulate(forward)
    # climb[s, s0] = Σ_{s≤s'<s0} (c'_{s'} + b_{s'}) for s0 ≥ s
    hop = np.concatenate(([0.0], np.cumsum(send_backward[:-1] + backward[:-1])))
    climb = hop[None, :] - hop[:, None]
    per_micro_batch = recomputes + backward
    upper = np.triu(np.ones((p, p), dtype=bool))
    range_max = np.maximum.accumulate(np.where(upper, per_micro_batch[None, :], 0.0), axis=1)  # costs >= 0
    entry = (forward_ends + recomputes + backward)[None, :]
    paths = np.where(upper, entry + climb + extra * range_max, -np.inf)
    return paths.max(axis=1)


def _start_after_input(free, produced, send, has_input, exposed, margins):
    """Per rank: when an action starts (its rank free, its input, where it has one, arrived) and
    the exposed communication with its wait added; with a `margins` list, each max's margins.

    As in `simulate`, the wait after the producer had finished counts as exposed communication.
    """
    ready = np.where(has_input, produced + send, 0.0)
    start = np.maximum(free, ready)
    waited_from = np.maximum(free, produced)
    exposed = exposed + np.where(has_input, np.maximum(start - waited_from, 0.0), 0.0)
    if margins is not None:
        margins.extend(np.where(has_input, margin, 1.0) for margin in (free - ready, free - produced, start - waited_from))
    return start, exposed


def pair_schedule_ends(kind: ScheduleKind, p: int, m: int, v: int, t: _Tables) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: the end of its last compute action, and its exposed p2p waiting time.

    Rank k runs forwards j = 0..W_k−1, then pairs (forward W_k + i, backward i), then the
    remaining backwards (GPipe: W_k = m, no pairs). Forward j of rank k is virtual stage c·p + k
    with chunk c = (j mod p·v) // p, on micro-batch (j // (p·v))·p + j mod p; backwards visit the
    chunks in reverse (Megatron-LM's interleaved order; with v = 1 it is 1F1B).

    Waiting counts as exposed communication as in `simulate`: the part of an action's wait that
    lies after its producer had finished (the transfer not hidden behind the rank's own work).
    """
    warmup = _warmup(kind, p, m, v)
    ranks = np.arange(p)
    total = m * v  # forwards (and backwards) per rank
    group = p * v
    last_stage = p * v - 1
    # 1F1B (pairs right after a warm-up of p - k - 1) numbers backwards so that a backward's
    # input comes from the next rank in the same wave: solved as a chain over the ranks.
    chain = bool(np.all(warmup == np.minimum(p - 1 - ranks, m))) and v == 1 and p > 1
    if chain:
        backward_offset = np.zeros(p, dtype=np.int64)
        forward_offset = -(p - 1 - ranks)
    elif np.all(warmup == total):
        # Everything is warm-up: all forwards, then all backwards (GPipe; interleaved with m == p).
        forward_offset = ranks.copy()
        backward_offset = (total + 2 * p - 2) - ranks
    else:
        backward_offset = -ranks
        forward_offset = backward_offset - warmup
    first_wave = int(min(forward_offset.min(), backward_offset.min()))
    last_wave = int(max(forward_offset.max(), backward_offset.max())) + total - 1
    period = 1 if v == 1 else group
    previous_rank = (ranks - 1) % p
    next_rank = (ranks + 1) % p
    backward, send_backward = t.backward, t.send_backward
    # Per wave phase (wave mod p·v; one phase without chunks), each rank's stage and the costs it
    # reads; looked up instead of recomputed every wave.
    phases = np.arange(group)[:, None]
    forward_stage = (((phases - forward_offset[None, :]) % group) // p) * p + ranks[None, :]
    backward_stage = (v - 1 - ((phases - backward_offset[None, :]) % group) // p) * p + ranks[None, :]
    forward_cost = t.forward[forward_stage]
    forward_send = t.send_forward[forward_stage - 1]  # stage 0 reads the padding
    forward_fed = forward_stage > 0
    backward_cost = backward[backward_stage]
    backward_send = send_backward[backward_stage]
    backward_fed = backward_stage < last_stage
    recompute_cost = t.recomputes[backward_stage]
    forward_waves = _Active(forward_offset, total)
    suffix = _backward_suffix(backward, send_backward) if chain else None
    backward_waves = _Active(backward_offset, total)

    def run_wave(wave, last, forward_end, backward_end, exposed, margins):
        """One wave over all ranks; with a `margins` list, append every max's two-sided margin."""
        phase = wave % group
        has_forward = forward_waves.at(wave)
        if has_forward is not False:
            produced = forward_end[previous_rank]
            has_input = forward_fed[phase] if has_forward is True else has_forward & forward_fed[phase]
            start, exposed = _start_after_input(last, produced, forward_send[phase], has_input, exposed, margins)
            new_forward = start + forward_cost[phase]
            if has_forward is True:
                last = forward_end = new_forward
            else:
                last = np.where(has_forward, new_forward, last)
                forward_end = np.where(has_forward, new_forward, forward_end)
        has_backward = backward_waves.at(wave)
        if has_backward is not False:
            free = last + recompute_cost[phase]  # the recompute (if any) runs before the backward
            has_input = backward_fed[phase] if has_backward is True else has_backward & backward_fed[phase]
            if chain:
                new_backward = _backward_chain(free, backward, suffix, margins)
                produced = np.concatenate((new_backward[1:], _ZERO))
            else:
                produced = backward_end[next_rank]
            start, exposed = _start_after_input(free, produced, backward_send[phase], has_input, exposed, margins)
            if not chain:
                new_backward = start + backward_cost[phase]
            if has_backward is True:
                last = backward_end = new_backward
            else:
                last = np.where(has_backward, new_backward, last)
                backward_end = np.where(has_backward, new_backward, backward_end)
        return last, forward_end, backward_end, exposed

    last = np.zeros(p)  # end of the rank's latest action
    forward_end = np.zeros(p)  # end of the rank's forward in the latest wave that had one
    backward_end = np.zeros(p)
    exposed = np.zeros(p)
    steady_from, steady_to = _steady_waves(forward_offset, backward_offset, total)
    history = _History(p, period, steady_from, steady_to)
    regime: LinearRegime | None = None  # a per-rank-rate regime being checked
    wave = first_wave
    if chain and wave < 0:
        # Before wave 0 each rank only runs its warm-up forwards: a forward grid, in closed form.
        last, exposed = _chain_warmup(p, m, t.forward, t.send_forward)
        forward_end = last
        wave = 0
    while wave <= last_wave:
        margins = regime.margins[0] if regime is not None else None
        last, forward_end, backward_end, exposed = run_wave(wave, last, forward_end, backward_end, exposed, margins)
        if steady_from <= wave <= steady_to and history.enabled:
            state = np.concatenate((last, forward_end, backward_end))
            wave, state, exposed, regime = skip_repeats(history, regime, wave, state, exposed, steady_to)
            last, forward_end, backward_end = state.reshape(3, -1)  # views, as np.split's
        if wave >= steady_to:
            regime = None  # no steady wave left to check it on
        wave += 1
    return last, exposed


class _Active:
    """Which ranks run their n-th action of a kind in wave n + offset (0 <= n < total)."""

    def __init__(self, offsets: np.ndarray, total: int) -> None:
        self.offsets = offsets
        self.total = total
        self.any_from = int(offsets.min())
        self.any_to = int(offsets.max()) + total - 1
        self.all_from = int(offsets.max())
        self.all_to = int(offsets.min()) + total - 1

    def at(self, wave: int) -> np.ndarray | bool:
        """True (every rank), False (none) or the per-rank mask."""
        if self.all_from <= wave <= self.all_to:
            return True
        if wave < self.any_from or wave > self.any_to:
            return False
        n = wave - self.offsets
        return (n >= 0) & (n < self.total)


def _steady_waves(forward_offset, backward_offset, total) -> tuple[int, int]:
    """Waves in which every rank runs a forward and a backward (the repeating part), as a range.

    A period-aligned jump must land inside it; outside it nothing is skipped.
    """
    start = int(max(forward_offset.max(), backward_offset.max()))
    end = int(min(forward_offset.min(), backward_offset.min())) + total - 1
    return start, end


class _History:
    """The steady waves' states, to find x(k) = x(k − c) + λ (c a multiple of the period).

    A max-plus system may repeat itself only after several periods (its cyclicity: e.g. a
    critical loop through j ranks takes j waves), so every `_CHECK_EVERY` waves the state is
    compared with each of the last `depth` states at a multiple of the period. Where no such
    repeat exists yet, it also looks for a per-entry linear stretch, x(k) − x(k − c) =
    x(k − c) − x(k − 2c) (see `LinearRegime`).
    """

    def __init__(self, ranks: int, period: int, steady_from: int, steady_to: int) -> None:
        self.period = period
        self.depth = min(max(4 * ranks, 2 * period, 16) // period * period, max(steady_to - steady_from, 0))
        self.states = np.zeros((self.depth, 3 * ranks))
        self.exposed = np.zeros((self.depth, ranks))
        self.stored = 0
        self.enabled = self.depth >= period and steady_to - steady_from > 2 * period
        self.steady_to = steady_to

    def disable(self) -> None:
        self.enabled = False

    def restart(self) -> None:
        """Forget the stored states (the waves after a skip do not follow them)."""
        self.stored = 0

    def record(self, wave: int, state: np.ndarray, exposed: np.ndarray) -> tuple[int, float | None, np.ndarray | None] | None:
        """(cycle length in waves, shift per cycle, exposed time per cycle) once one repeats;
        (cycle length, None, None) for a per-entry linear stretch (no repeat yet)."""
        if not self.enabled:
            return None
        slot = self.stored % self.depth
        found = None
        if self.stored >= self.period and self.stored % _CHECK_EVERY == 0:
            found = self._repeat(slot, state, exposed)
        self.states[slot] = state
        self.exposed[slot] = exposed
        self.stored += 1
        if found is not None and (self.steady_to - wave) // found[0] == 0:
            return None
        return found

    def _repeat(self, slot: int, state: np.ndarray, exposed: np.ndarray):
        available = min(self.stored, self.depth)
        lags = np.arange(self.period, available + 1, self.period)
        rows = (slot - lags) % self.depth
        differences = state[None, :] - self.states[rows]
        shifts = differences[:, 0]
        tolerance = PERIOD_ULPS * float(np.spacing(np.max(np.abs(state))))
        uniform = np.max(np.abs(differences - shifts[:, None]), axis=1) <= tolerance
        if uniform.any():
            first = int(np.argmax(uniform))
            return int(lags[first]), float(shifts[first]), exposed - self.exposed[rows[first]]
        # Lag c at index i, lag 2c at index 2i + 1: x(k) − x(k−c) against x(k−c) − x(k−2c).
        halves = np.arange(len(lags) // 2)
        if not len(halves):
            return None
        linear = np.max(np.abs(2 * differences[halves] - differences[2 * halves + 1]), axis=1) <= 2 * tolerance
        if not linear.any():
            return None
        return int(lags[int(np.argmax(linear))]), None, None


def _chain_warmup(p: int, m: int, forward, send_forward) -> tuple[np.ndarray, np.ndarray]:
    """1F1B's warm-up (the waves before 0): per rank, the end of its last warm-up forward and its
    exposed waiting so far.

    Rank k runs forwards j < n_k = min(p − 1 − k, m) before its first backward, so these waves
    hold only the forward grid F(k, j) = max(F(k, j − 1), F(k − 1, j) + c_{k−1}) + f_k from time
    0. Its longest path (as in `gpipe_compute_ends`) gives F(k, j) = Σ_{s≤k} f_s + Σ_{s<k} c_s
    + j · max_{s≤k} f_s: by induction, F(k, j − 1) + f_k wins exactly when f_k is the largest
    so far. Each forward's wait is then read off its two inputs as in the wave pass.

    >>> last, exposed = _chain_warmup(3, 8, np.array([1.0, 2.0, 1.0]), np.array([0.5, 0.5, 0.0]))
    >>> last.tolist(), exposed.tolist()  # rank 0: F0, F1; rank 1: F0 at 1 + 0.5 + 2
    ([2.0, 3.5, 0.0], [0.0, 0.5, 0.0])
    """
    ranks = np.arange(p)
    counts = np.minimum(p - 1 - ranks, m)
    width = int(counts.max()) if p else 0
    if width <= 0:
        return np.zeros(p), np.zeros(p)
    chain_to = np.cumsum(forward) + np.concatenate(([0.0], np.cumsum(send_forward[: p - 1])))
    slowest = np.maximum.accumulate(forward)
    ends = chain_to[:, None] + np.arange(width)[None, :] * slowest[:, None]  # ends[k, j] = F(k, j)
    last = np.where(counts > 0, ends[ranks, np.maximum(counts - 1, 0)], 0.0)
    # Waits of F(k, j), k ≥ 1: own = F(k, j − 1) (0 for j = 0), produced = F(k − 1, j).
    own = np.concatenate((np.zeros((p - 1, 1)), ends[1:, :-1]), axis=1)
    produced = ends[:-1]
    start = np.maximum(own, produced + send_forward[: p - 1, None])
    waits = np.maximum(start - np.maximum(own, produced), 0.0)
    valid = np.arange(width)[None, :] < counts[1:, None]
    exposed = np.concatenate(([0.0], np.where(valid, waits, 0.0).sum(axis=1)))
    return last, exposed


def _backward_suffix(backward, send_backward) -> np.ndarray:
    """H_k = Σ_{k'≥k} b_{k'} + Σ_{k≤k'<p−1} c'_{k'} of `_backward_chain` (send_backward padded)."""
    return np.cumsum((backward + send_backward)[::-1])[::-1] - send_backward[-1]


def _backward_chain(after_recompute, backward, suffix, margins=None) -> np.ndarray:
    """1F1B: B(k, i) = max(own rank ready, B(k+1, i) + c'_k) + b_k, from the last rank down.

    As a running maximum: B(k) = H_k + max_{k0≥k} (A_{k0} + b_{k0} − H_{k0}) with
    H_k = Σ_{k'≥k} b_{k'} + Σ_{k≤k'<p−1} c'_{k'} (`_backward_suffix`; every rank has a backward
    in these waves). With a `margins` list, appends each rank's term minus the best term after it.
    """
    candidates = after_recompute + backward - suffix
    best = np.maximum.accumulate(candidates[::-1])[::-1]
    if margins is not None:
        margins.append(candidates[:-1] - best[1:])
    return suffix + best
