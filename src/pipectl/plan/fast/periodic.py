"""What the fast paths share: skipping a step's repeating or steadily drifting stretch exactly.

Every micro-batch of a stage costs the same, so in the steady part of a step one period of the
schedule (a wave of 1F1B, p·v waves of interleaved, a cycle of Varuna's order) maps the state the
rest of the step reads (the ends of the ranks' latest actions) to the next by the same max-plus
linear map x ↦ A ⊗ x. Two facts then let a fast path skip periods without changing the figures:

1. **Repeat.** Such a map commutes with adding a constant to every entry, so once
   x(k) = x(k − c) + λ in every entry it stays so, and the remaining periods add λ each
   (Baccelli, Cohen, Olsder, Quadrat, "Synchronization and Linearity", 1992, ch. 3: eventual
   periodicity of max-plus linear recurrences).
2. **Linear stretch.** Before that, while every max keeps choosing the same operand, the state
   grows by a fixed vector per period (`LinearRegime`), up to the period where a margin could
   change sides.

"Repeats" and "fixed" allow `PERIOD_ULPS` units in the last place of the largest entry: a few
roundings per period, far below any difference between candidates. That, and closed forms that
add in another order, is why the fast paths equal the simulation to ~1e-14 relative rather than
bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["PERIOD_ULPS", "LinearRegime", "cycles_keeping_sides", "skip_repeats"]

# Deviation from an exact period tolerated, in units of the largest end time's spacing
# (np.spacing): a few roundings per wave, far below any difference between candidates.
PERIOD_ULPS = 16.0


class LinearRegime:
    """A stretch where every entry of the state grows at its own constant rate per cycle.

    Before the slowest stage's chain dominates, ranks upstream of it may still run on the head
    start they took in the warm-up: their ends grow by a different amount per cycle than the
    others', so the state never repeats shifted by one constant until that head start is used
    up, which can take more waves than the step has. While every max in a wave keeps choosing
    the same operand, though, one cycle maps x to x + Δ with a fixed vector Δ, and every
    operand of every max grows by its own fixed amount per cycle: a margin a − b changes by
    the same drift each cycle. So after two checked cycles (the same Δ twice, every margin
    keeping its side), the next n cycles are skipped exactly, n being the last cycle before a
    margin that shrinks could change sides (kept below its zero by one more cycle and the
    rounding tolerance). Exposed time per cycle is a sum of such margins (or zeros), so it
    changes linearly and its total over n cycles is n·δ + dd·n(n+1)/2.

    A margin within rounding of zero that does not drift is a tie (both operands give the same
    value); one within rounding of zero that drifts is about to change sides: no skip.
    """

    def __init__(self, position: int, cycle: int, state: np.ndarray, exposed: np.ndarray, streams: int = 1) -> None:
        self.cycle = cycle
        self.start = position
        self.states = [state]
        self.exposed = [exposed]
        # Margins in evaluation order, per stream (the same count every cycle in each stream).
        self.margins: list[list] = [[] for _ in range(streams)]
        self.done = False

    def observe(self, position: int, state: np.ndarray, exposed: np.ndarray, last_position: int):
        """After each step (a wave, or a Varuna cycle): (cycles to skip, state advance, exposed
        advance) once two cycles are checked and a skip is safe, else None (`done` once checked)."""
        if (position - self.start) % self.cycle:
            return None
        self.states.append(state)
        self.exposed.append(exposed)
        if len(self.states) < 3:
            return None
        self.done = True
        first, second, third = self.states
        if not len(first) == len(second) == len(third):
            return None
        advance = third - second
        tolerance = PERIOD_ULPS * float(np.spacing(np.max(np.abs(third))))
        if np.max(np.abs(advance - (second - first))) > tolerance:
            return None
        halves = [_halves(stream) for stream in self.margins]
        earlier = np.concatenate([half for half, _ in halves])
        later = np.concatenate([half for _, half in halves])
        if earlier.shape != later.shape:
            return None
        cycles = min(cycles_keeping_sides(earlier, later, tolerance), (last_position - position) // self.cycle)
        if cycles < 1:
            return None
        per_cycle = self.exposed[2] - self.exposed[1]
        change = per_cycle - (self.exposed[1] - self.exposed[0])
        # Waits within rounding of zero come and go with rounding: no trend to extrapolate.
        change = np.where(np.abs(change) > tolerance, change, 0.0)
        exposed_advance = cycles * per_cycle + (cycles * (cycles + 1) // 2) * change
        return cycles, cycles * advance, exposed_advance


def _halves(stream: list) -> tuple[np.ndarray, np.ndarray]:
    """A stream's margins of the first and of the second checked cycle, flat."""
    half = len(stream) // 2
    if stream and isinstance(stream[0], np.ndarray):
        return np.concatenate(stream[:half]), np.concatenate(stream[half: 2 * half])
    return np.asarray(stream[:half], dtype=float), np.asarray(stream[half: 2 * half], dtype=float)


def cycles_keeping_sides(earlier: np.ndarray, later: np.ndarray, tolerance: float) -> int:
    """Cycles after `later` for which every margin surely keeps its side (see `LinearRegime`).

    >>> cycles_keeping_sides(np.array([5.0, 1.0]), np.array([4.0, 1.0]), 1e-12)
    2
    """
    drift = later - earlier
    moving = np.abs(drift) > tolerance
    if not moving.any():
        return 1 << 62
    earlier, later, drift = earlier[moving], later[moving], drift[moving]
    one_side = ((earlier > tolerance) & (later > tolerance)) | ((earlier < -tolerance) & (later < -tolerance))
    if not one_side.all():
        return 0
    closing = (later > 0) != (drift > 0)
    if not closing.any():
        return 1 << 62
    # A drift known to within the tolerance closes a margin by at most |drift| + tolerance a cycle.
    room = (np.abs(later[closing]) - tolerance) / (np.abs(drift[closing]) + tolerance)
    return max(int(np.floor(np.min(room))) - 1, 0)


def skip_repeats(
    history: Any, regime: LinearRegime | None, index: int, state: np.ndarray, exposed: np.ndarray, final: int
) -> tuple[int, np.ndarray, np.ndarray, LinearRegime | None]:
    """One turn of the repeat detection that the wave loops share (`waves`, `twobw`): record
    `state` after wave `index`; on an exact cycle, jump whole cycles up to wave `final` and stop
    looking; when a linear regime holds, jump it and start looking again. `history` is a
    `waves._History`; returns (index, state, exposed, regime) to carry on from."""
    found = history.record(index, state, exposed)
    if found is not None and found[1] is not None:
        # Every later cycle repeats this one, shifted by `shift` (the `waves` module docstring).
        cycle, shift, exposed_per_cycle = found
        cycles = (final - index) // cycle
        history.disable()
        return index + cycles * cycle, state + cycles * shift, exposed + cycles * exposed_per_cycle, None
    if regime is not None:
        jump = regime.observe(index, state, exposed, final)
        if jump is not None:
            cycles, advance, exposed_advance = jump
            history.restart()
            return index + cycles * regime.cycle, state + advance, exposed + exposed_advance, None
        return index, state, exposed, None if regime.done else regime
    if found is not None:
        return index, state, exposed, LinearRegime(index, found[0], state, exposed)
    return index, state, exposed, None
