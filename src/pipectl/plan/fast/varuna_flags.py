"""Varuna's order, fast: per stage, compact flags cut from the order's periodic form.

The definition is `pipectl.schedule.varuna_order` (the rules, derived action by action). The
planner needs the order for many micro-batch counts m of the same p, up to thousands each, so
this module keeps it compactly and derives it once per (p, T_f, T_b):

- **Flags.** Forwards and backwards each run in micro-batch order, and every backward of a stage
  other than the last is preceded by its recompute (rules 1-2), so a stage's order is fixed by
  which of "next forward" (True) and "next recompute + backward" (False) comes next.
- **Cut.** A stage's choices up to its m-th forward are the same for every number of micro-batches
  M ≥ m (a choice depends on fewer than m forwards of the previous stage, and on backwards of the
  next stage, which differ only once that stage has run its m-th forward, later); after it only
  backwards are left. So the order for m is the order for M cut after each stage's m-th forward,
  then the backwards still owed.
- **Period.** With whole-number stage times every time in the derivation is an exact float, and
  the derivation is deterministic, so once its state (relative to now and to stage 0's progress)
  repeats, it cycles: every stage's order is its order so far, then the choices since the
  state's first visit, repeated (`_PeriodicOrder`). The derivation runs with more micro-batches
  than the cycle needs to show (`_cycle_search_micro_batches`) and every m is then cut from the
  periodic order by arithmetic.

Every answer is a function of its arguments alone (`lru_cache`): which m were asked for before
changes nothing. Tests (tests/plan/fast/test_varuna_flags.py) hold `forward_flags` equal to the
definition for every m, `cycle`'s claim about it, and `order_ends` (how many forwards each stage
runs before its first backward, and backwards after its last forward; the Varuna bound of
`pipectl.plan.fast.bounds` reads them) equal to what the flags show.

    >>> [''.join('F' if f else 'B' for f in flags) for flags in forward_flags(2, 3)]
    ['FFFBBB', 'FBFBFB']
"""

from __future__ import annotations

import math
from bisect import bisect_right
from functools import lru_cache
from heapq import heappop, heappush
from itertools import compress, count

from pipectl.errors import ScheduleError

__all__ = ["cycle", "forward_flags", "order_ends"]


@lru_cache(maxsize=256)
def forward_flags(p: int, m: int, tf: float = 1.0, tb: float = 2.0) -> tuple[tuple[bool, ...], ...]:
    """Varuna's order for (p, m) per stage: True for the next forward, False for the next
    (recompute and) backward (see the module docstring). Cached and shared: do not mutate."""
    periodic = _periodic_order(p, tf, tb)
    if periodic is not None:
        return periodic.flags(m)
    flags, _ = _derive(p, m, tf, tb, watch=False)
    return flags


@lru_cache(maxsize=1024)
def order_ends(p: int, m: int, tf: float = 1.0, tb: float = 2.0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per stage of `forward_flags(p, m)`: (forwards before its first backward, backwards after its
    last forward), from the periodic order by arithmetic when there is one (no flags built).

    >>> order_ends(2, 3)  # 'FFFBBB', 'FBFBFB'
    ((3, 1), (3, 1))
    """
    periodic = _periodic_order(p, tf, tb)
    if periodic is not None:
        return periodic.ends(m)
    flags = forward_flags(p, m, tf, tb)
    return tuple(order.index(False) for order in flags), tuple(2 * m - _cut(order) for order in flags)


def _cut(order) -> int:
    """The position right after an order's last forward."""
    return len(order) - order[::-1].index(True)


def cycle(p: int, tf: float = 1.0, tb: float = 2.0) -> tuple[tuple[int, ...], int] | None:
    """Where Varuna's order for p stages turns periodic, or None when its derivation found no cycle.

    (starts, q): from position starts[s] of `forward_flags(p, m)` on, stage s repeats a cycle of
    q forwards and q backwards (2q flags) for as long as it has forwards left; cycle k of every
    stage only needs actions of cycles up to k (they are the choices between two moments of the
    derivation).
    """
    periodic = _periodic_order(p, tf, tb)
    return None if periodic is None else (periodic.cycle_starts, periodic.forwards_per_cycle)


@lru_cache(maxsize=256)
def _periodic_order(p: int, tf: float, tb: float) -> _PeriodicOrder | None:
    """The periodic form of Varuna's order for p stages, if its derivation finds the cycle."""
    if not (float(tf).is_integer() and float(tb).is_integer()):
        return None  # times that are not exact floats: no state ever repeats exactly
    _, periodic = _derive(p, _cycle_search_micro_batches(p, tf, tb), tf, tb, watch=True)
    return periodic


def _cycle_search_micro_batches(p: int, tf: float, tb: float) -> int:
    """Micro-batches the cycle search derives. The state first repeats once the pipeline is
    full, after about (1 + T_b/T_f)·p forwards of stage 0: twice that, and a margin."""
    return 2 * (p + 8) * (1 + math.ceil(tb / tf))


class _PeriodicOrder:
    """Every stage's order for unboundedly many micro-batches: the choices a derivation made up to
    its first repeated state, then the choices since the state's first visit, repeated.

    `flags(m)` cuts it after each stage's m-th forward and appends the backwards still owed, which
    is Varuna's order for m (`forward_flags`). A toy two-stage order, stage 0 "F" then
    "FB" repeated, stage 1 "FB" repeated:

        >>> order = _PeriodicOrder([[True, True, False], [True, False]], [1, 0], 1)
        >>> [''.join('F' if f else 'B' for f in flags) for flags in order.flags(3)]
        ['FFBFBB', 'FBFBFB']
    """

    def __init__(self, orders: list[list[bool]], cycle_starts: list[int], forwards_per_cycle: int) -> None:
        self.cycle_starts = tuple(cycle_starts)
        self.forwards_per_cycle = forwards_per_cycle
        # Per stage: the order so far and its forward positions, the cycle and its forward
        # positions, and the order unrolled so far (prefix, then whole cycles), which grows as
        # larger m ask for it so that a cut is one slice.
        self.stages = []
        for order, start in zip(orders, cycle_starts):
            prefix = tuple(order)
            cycle = prefix[start:]
            self.stages.append([prefix, _forward_positions(prefix), cycle, _forward_positions(cycle), prefix])

    def flags(self, m: int) -> tuple[tuple[bool, ...], ...]:
        out = []
        for stage in self.stages:
            prefix, _, cycle, _, unrolled = stage
            end = self._after_forward(stage, m)
            if end > len(unrolled):
                unrolled = stage[4] = prefix + cycle * -(-(end - len(prefix)) // len(cycle))
            out.append(unrolled[:end] + (False,) * (2 * m - end))
        return tuple(out)

    def ends(self, m: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """`order_ends(p, m)`: the forwards before the first backward (all of them up to there),
        and the backwards after the cut."""
        warm_up, cool_down = [], []
        for stage in self.stages:
            prefix, _, cycle, _, _ = stage
            first = prefix.index(False) if False in prefix else len(prefix) + cycle.index(False)
            warm_up.append(min(first, m))
            cool_down.append(2 * m - self._after_forward(stage, m))
        return tuple(warm_up), tuple(cool_down)

    @staticmethod
    def _after_forward(stage: list, m: int) -> int:
        """The position right after the stage's m-th forward in its unbounded order."""
        prefix, prefix_forwards, cycle, cycle_forwards, _ = stage
        if m <= len(prefix_forwards):
            return prefix_forwards[m - 1] + 1
        # The (extra + 1)-th forward of the cycle after `cycles` whole cycles is the m-th.
        # Every cycle holds forwards: the state's indices are relative to stage 0's
        # progress, so a cycle moves every stage on by the same number of forwards.
        cycles, extra = divmod(m - len(prefix_forwards) - 1, len(cycle_forwards))
        return len(prefix) + cycles * len(cycle) + cycle_forwards[extra] + 1


def _forward_positions(order) -> list[int]:
    """Positions of the forwards (True) in an order."""
    return list(compress(count(), order))


def _derive(p: int, m: int, tf: float, tb: float, *, watch: bool) -> tuple[tuple[tuple[bool, ...], ...], _PeriodicOrder | None]:
    """The rules of `pipectl.schedule.varuna_order` for exactly m micro-batches, as flags; with
    `watch` (whole-number stage times only), the periodic order instead once the state repeats
    (its caller wants only that: no flags are cut then).

    The state watched is every stage's remaining busy time, recompute flag, progress and the
    forward/backward ends its neighbours will still read, all relative to now and to stage 0's
    next forward. The derivation is deterministic, so from the first repeat on it cycles, and
    each stage's order is its order so far followed by the cycle's choices, repeated; the order
    for m is then cut from it (the run is the same as for unboundedly many micro-batches while
    stage 0 has forwards left, which is when it is watched). The same rules as the definition,
    kept faster: moments on a heap, end tables grown as stage 0 gets further, states compared
    by a cheap summary first.
    """
    repeats = _RepeatWatch()
    last = p - 1
    # Ends per stage and micro-batch, grown as stage 0 (always the furthest on) gets further:
    # a derivation that finds its cycle reads only the first few p micro-batches of m.
    allocated = min(m, 4 * p + 16)
    forward_end = [[_NEVER] * allocated for _ in range(p)]
    backward_end = [[_NEVER] * allocated for _ in range(p)]  # known once the backward has started
    next_forward = [0] * p
    next_backward = [0] * p
    recomputed = [False] * p
    free_at = [0.0] * p
    orders: list[list[bool]] = [[] for _ in range(p)]
    unfinished = p  # stages with backwards left
    now = 0.0
    # Every moment something can change, pushed when it becomes known: a stage's end (free_at),
    # and T_f before the end of the backward the previous stage waits on (its recompute becomes
    # eligible then). Neither is replaced before it has passed (a stage starts again once free;
    # a stage's next backward comes after that moment), so the smallest pushed moment after now
    # is the smallest current one after now, which a scan of every stage would find.
    moments: list[float] = []
    appenders = [order.append for order in orders]
    while unfinished:
        if allocated < m and next_forward[0] + 2 > allocated:
            # Read and written this moment: up to one past the next forward of stage 0.
            allocated = _grow_ends(forward_end + backward_end, allocated, m)
        forward_done = now + tf  # when an F or R started now ends
        backward_done = now + tb
        for s in range(p):
            i = next_backward[s]
            if free_at[s] > now or i >= m:
                continue
            if s == last:
                if forward_end[s][i] <= now:  # B
                    free_at[s] = backward_done
                    backward_end[s][i] = backward_done
                    appenders[s](False)
                    next_backward[s] = i + 1
                    unfinished -= i + 1 == m
                    heappush(moments, backward_done)
                    if s > 0 and next_backward[s - 1] == i:
                        _push_after(moments, backward_done - tf, now)
                    continue
            elif recomputed[s]:
                gradient_end = backward_end[s + 1]
                if gradient_end[i] <= now:  # B after its R
                    free_at[s] = backward_done
                    backward_end[s][i] = backward_done
                    next_backward[s] = i + 1
                    unfinished -= i + 1 == m
                    recomputed[s] = False
                    heappush(moments, backward_done)
                    if s > 0 and next_backward[s - 1] == i:
                        _push_after(moments, backward_done - tf, now)
                    if i + 1 < m:
                        _push_after(moments, gradient_end[i + 1] - tf, now)
                continue  # rule 2: nothing else between R(i) and B(i)
            elif forward_end[s][i] <= now and backward_end[s + 1][i] - tf <= now:  # R
                free_at[s] = forward_done
                recomputed[s] = True
                appenders[s](False)
                heappush(moments, forward_done)
                continue
            j = next_forward[s]
            if j < m and (s == 0 or forward_end[s - 1][j] <= now):  # F
                free_at[s] = forward_done
                forward_end[s][j] = forward_done
                next_forward[s] = j + 1
                appenders[s](True)
                heappush(moments, forward_done)
        # Advance to the next moment anything can change: a stage frees up, or a recompute
        # becomes eligible (T_f before a known backward end).
        while moments and moments[0] <= now:
            heappop(moments)
        if not moments:
            if unfinished:  # pragma: no cover - would be a bug above
                raise ScheduleError(f"Varuna schedule generation stalled at t={now} (p={p}, m={m})")
            break
        upcoming = moments[0]
        if watch and next_forward[0] < m:
            periodic_order = repeats.periodic_order(
                now, orders, free_at, recomputed, next_forward, next_backward, forward_end, backward_end
            )
            if periodic_order is not None:
                return (), periodic_order
        now = upcoming
    if any(nf < m for nf in next_forward):  # pragma: no cover - B(i) implies F(i)
        raise ScheduleError(f"Varuna schedule generation left forwards unscheduled (p={p}, m={m})")
    return tuple(tuple(order) for order in orders), None


def _grow_ends(tables: list[list[float]], allocated: int, m: int) -> int:
    """Extend every end table by up to `allocated` more micro-batches (doubling, at most to m);
    the new length."""
    more = min(allocated, m - allocated)
    for ends in tables:
        ends.extend([_NEVER] * more)
    return allocated + more


class _RepeatWatch:
    """The derivation's states so far, to find the first one that repeats (`_derive`, `watch`).

    A cheap summary first; the full state only once the summary has come round before.
    Summaries are filed under a coarser key (part of the summary) as raw copies, and only
    computed once another moment with the same key needs comparing.
    """

    def __init__(self) -> None:
        self.seen: dict[tuple, tuple[list[int], int]] = {}  # full state -> (each stage's order length, base)
        # coarse key -> (moments not summarised yet, summaries seen)
        self.summaries_by_key: dict[tuple, tuple[list[tuple], set[tuple]]] = {}

    def periodic_order(
        self, now: float, orders: list[list[bool]], free_at, recomputed, next_forward, next_backward, forward_end,
        backward_end,
    ) -> _PeriodicOrder | None:
        """The periodic order when this moment's state was seen before, else None (the state filed)."""
        base = next_forward[0]
        last = len(orders) - 1
        key = (tuple(recomputed), next_forward[last] - base, next_backward[last] - base)
        filed = self.summaries_by_key.get(key)
        if filed is None:
            self.summaries_by_key[key] = ([(now, base, free_at[:], next_forward[:], next_backward[:])], set())
            return None
        pending, seen_summaries = filed
        for earlier in pending:
            seen_summaries.add(_varuna_summary(*earlier))
        pending.clear()
        summary = _varuna_summary(now, base, free_at, next_forward, next_backward)
        if summary in seen_summaries:
            state = _varuna_state(now, free_at, recomputed, next_forward, next_backward, forward_end, backward_end)
            earlier = self.seen.get(state)
            if earlier is not None:
                starts, earlier_base = earlier
                return _PeriodicOrder(orders, starts, base - earlier_base)
            self.seen[state] = ([len(order) for order in orders], base)
        seen_summaries.add(summary)
        return None


def _varuna_summary(now: float, base: int, free_at, next_forward, next_backward) -> tuple:
    """The cheap part of the derivation's state: busy time left, progress relative to stage 0's."""
    return (
        tuple([t - now if t > now else 0.0 for t in free_at]),
        tuple([n - base for n in next_forward]),
        tuple([n - base for n in next_backward]),
    )


_NEVER = float("inf")  # an end not known yet


def _push_after(moments: list[float], moment: float, now: float) -> None:
    """Push a moment of the Varuna derivation if it is still to come and known."""
    if now < moment < _NEVER:
        heappush(moments, moment)


def _varuna_state(now, free_at, recomputed, next_forward, next_backward, forward_end, backward_end) -> tuple:
    """The derivation's state relative to now and to stage 0's progress (see `_derive`).

    Times at or before now only matter as "done" (every test is `<= now`), so they read as 0.
    A stage's forward (backward) ends rise with the micro-batch, so the ends a window still reads
    are done ones, then the few still running; the window's bounds follow from the progress
    counters, so the ends after the last done one (found by `bisect_right`), relative to now,
    say as much as the whole window relative to now (0 when done): one number or none per
    stage instead of one per micro-batch in flight.
    """
    p = len(free_at)
    base = next_forward[0]
    parts: list = []
    for s in range(p):
        nf, nb = next_forward[s], next_backward[s]
        # Forward ends still read: by this stage's R/B (from nb on) and the next stage's F.
        first_forward = min(nb, next_forward[s + 1]) if s < p - 1 else nb
        # Backward ends still read by the previous stage's R/B.
        first_backward = next_backward[s - 1] if s > 0 else nb
        ends_f = forward_end[s]
        ends_b = backward_end[s]
        done_f = bisect_right(ends_f, now, first_forward, nf) if first_forward < nf else nf
        done_b = bisect_right(ends_b, now, first_backward, nb) if first_backward < nb else nb
        parts.append((
            max(free_at[s] - now, 0.0), recomputed[s], nf - base, nb - base,
            tuple([end - now for end in ends_f[done_f:nf]]),
            tuple([end - now for end in ends_b[done_b:nb]]),
        ))
    return tuple(parts)


