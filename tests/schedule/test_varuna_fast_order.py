"""Varuna's order from the cut-by-arithmetic periodic order and the compact state hashing equals
the implementation it replaced (kept below as the reference, caches and all): the same flags for
every m, and the same cycle (`varuna_cycle`) reported after every call, whatever the call order."""

from functools import lru_cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.errors import ScheduleError
from pipectl.schedule import generators

# ---- reference: the previous implementation, verbatim but for the names -------------------------


@lru_cache(maxsize=256)
def reference_forward_flags(p: int, m: int, tf: float = 1.0, tb: float = 2.0) -> tuple[tuple[bool, ...], ...]:
    """Varuna's order per stage, compactly: True for the next forward, False for the next backward.

    Forwards and backwards each run in micro-batch order, and every backward of a stage other than
    the last is preceded by its recompute (rules 1-2), so this sequence is the whole order; the
    planner times it without building actions (`pipectl.plan.varuna_step`). Cached and shared.

    The order for m is read off a derivation for more micro-batches M > m when one is at hand:
    each stage's choices up to its m-th forward are the same in both (a choice depends on fewer
    than m forwards of the previous stage, and on backwards of the next stage, which differ only
    once that stage has run its m-th forward, later), and after it only backwards are left. So
    the order for m is the M order up to each stage's m-th forward, then backwards.

    >>> [''.join('F' if f else 'B' for f in flags) for flags in reference_forward_flags(2, 3)]
    ['FFFBBB', 'FBFBFB']
    """
    key = (p, tf, tb)
    longest = _REF_LONGEST.get(key)
    if longest is None or longest[0] < m:
        longest_m = max(m, 2 * longest[0]) if longest is not None else m
        flags = _ref_flags(p, longest_m, tf, tb)
        forwards_at = tuple(tuple(i for i, is_forward in enumerate(order) if is_forward) for order in flags)
        longest = (longest_m, flags, forwards_at)
        _REF_LONGEST[key] = longest
    longest_m, flags, forwards_at = longest
    if longest_m == m:
        return flags
    out = []
    for order, positions in zip(flags, forwards_at):
        prefix = order[: positions[m - 1] + 1]  # up to the m-th forward, then backwards only
        out.append(prefix + (False,) * (2 * m - len(prefix)))
    return tuple(out)


# (p, T_f, T_b) -> (M, order for M micro-batches, positions of each stage's forwards in it): the
# longest derivation so far, see above.
_REF_LONGEST: dict[tuple[int, float, float], tuple[int, tuple[tuple[bool, ...], ...], tuple[tuple[int, ...], ...]]] = {}
# (p, T_f, T_b) -> (where each stage's cycle starts in its order, forwards per cycle), once found.
_REF_CYCLES: dict[tuple[int, float, float], tuple[tuple[int, ...], int]] = {}


def reference_cycle(p: int, tf: float = 1.0, tb: float = 2.0) -> tuple[tuple[int, ...], int] | None:
    """Where Varuna's order for p stages turns periodic, if a derivation found it (see `_ref_flags`).

    (starts, q): from position starts[s] on, stage s repeats a cycle of q forwards and q backwards
    (2q flags) for as long as it has forwards left; cycle k of every stage only needs actions of
    cycles up to k (they are the choices between two moments of the derivation). None when no
    derivation for this p has run or none found a cycle.
    """
    return _REF_CYCLES.get((p, tf, tb))


def _ref_first_forwards(order: tuple[bool, ...], m: int) -> tuple[bool, ...]:
    """A stage's order cut after its m-th forward, then the backwards it still owes."""
    forwards = 0
    for position, is_forward in enumerate(order):
        if is_forward:
            forwards += 1
            if forwards == m:
                prefix = order[: position + 1]
                return prefix + (False,) * (2 * m - len(prefix))
    raise ScheduleError(f"Varuna order has fewer than {m} forwards")  # pragma: no cover - M > m


def _ref_flags(p: int, m: int, tf: float, tb: float, periodic: bool = True) -> tuple[tuple[bool, ...], ...]:
    """The rule-based derivation of `reference_forward_flags` for exactly m micro-batches.

    With whole-number stage times (every time is then an exact float) the derivation watches for
    its state to repeat: every stage's remaining busy time, recompute flag, progress and the
    forward/backward ends its neighbours will still read, all relative to now and to stage 0's
    next forward. The derivation is deterministic, so from the first repeat on it cycles, and
    each stage's order is its order so far followed by the cycle's choices, repeated; the order
    for m is then cut as in `reference_forward_flags` (the run is the same as for unboundedly many
    micro-batches while stage 0 has forwards left).
    """
    watch = periodic and float(tf).is_integer() and float(tb).is_integer()
    seen: dict[tuple, tuple[list[int], int]] = {}  # full state -> (each stage's order length, base)
    seen_summaries: set[tuple] = set()
    last = p - 1
    never = float("inf")
    forward_end = [[never] * m for _ in range(p)]
    backward_end = [[never] * m for _ in range(p)]  # known once the backward has started
    next_forward = [0] * p
    next_backward = [0] * p
    recomputed = [False] * p
    free_at = [0.0] * p
    orders: list[list[bool]] = [[] for _ in range(p)]
    unfinished = p  # stages with backwards left
    now = 0.0
    while unfinished:
        for s in range(p):
            if free_at[s] > now or next_backward[s] >= m:
                continue
            i = next_backward[s]
            if s == last:
                if forward_end[s][i] <= now:  # B
                    free_at[s] = now + tb
                    backward_end[s][i] = free_at[s]
                    orders[s].append(False)
                    next_backward[s] += 1
                    unfinished -= next_backward[s] == m
                    continue
            elif recomputed[s]:
                if backward_end[s + 1][i] <= now:  # B after its R
                    free_at[s] = now + tb
                    backward_end[s][i] = free_at[s]
                    next_backward[s] += 1
                    unfinished -= next_backward[s] == m
                    recomputed[s] = False
                continue  # rule 2: nothing else between R(i) and B(i)
            elif forward_end[s][i] <= now and backward_end[s + 1][i] - tf <= now:  # R
                free_at[s] = now + tf
                recomputed[s] = True
                orders[s].append(False)
                continue
            j = next_forward[s]
            if j < m and (s == 0 or forward_end[s - 1][j] <= now):  # F
                free_at[s] = now + tf
                forward_end[s][j] = free_at[s]
                next_forward[s] += 1
                orders[s].append(True)
        # Advance to the next moment anything can change: a stage frees up, or a recompute
        # becomes eligible (T_f before a known backward end).
        upcoming = never
        for t in free_at:
            if now < t < upcoming:
                upcoming = t
        for s in range(last):
            i = next_backward[s]
            if i < m:
                t = backward_end[s + 1][i] - tf
                if now < t < upcoming:
                    upcoming = t
        if upcoming == never:
            if unfinished:  # pragma: no cover - would be a bug above
                raise ScheduleError(f"Varuna schedule generation stalled at t={now} (p={p}, m={m})")
            break
        if watch and next_forward[0] < m:
            # A cheap summary first; the full state only once the summary has come round before.
            base = next_forward[0]
            summary = (
                tuple(max(t - now, 0.0) for t in free_at), tuple(recomputed),
                tuple(n - base for n in next_forward), tuple(n - base for n in next_backward),
            )
            if summary in seen_summaries:
                state = _ref_state(now, free_at, recomputed, next_forward, next_backward, forward_end, backward_end)
                earlier = seen.get(state)
                if earlier is not None:
                    starts, earlier_base = earlier
                    _REF_CYCLES[(p, tf, tb)] = (tuple(starts), base - earlier_base)
                    return _ref_cycled(orders, starts, m)
                seen[state] = ([len(order) for order in orders], base)
            seen_summaries.add(summary)
        now = upcoming
    if any(nf < m for nf in next_forward):  # pragma: no cover - B(i) implies F(i)
        raise ScheduleError(f"Varuna schedule generation left forwards unscheduled (p={p}, m={m})")
    return tuple(tuple(order) for order in orders)


def _ref_state(now, free_at, recomputed, next_forward, next_backward, forward_end, backward_end) -> tuple:
    """The derivation's state relative to now and to stage 0's progress (see `_ref_flags`).

    Times at or before now only matter as "done" (every test is `<= now`), so they read as 0.
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
        parts.append((
            max(free_at[s] - now, 0.0), recomputed[s], nf - base, nb - base,
            tuple(max(ends_f[i] - now, 0.0) for i in range(first_forward, nf)),
            tuple(max(ends_b[i] - now, 0.0) for i in range(first_backward, nb)),
        ))
    return tuple(parts)


def _ref_cycled(orders: list[list[bool]], cycle_start: list[int], m: int) -> tuple[tuple[bool, ...], ...]:
    """Each stage's order so far, its cycle (the choices since `cycle_start`) repeated until it
    has m forwards, then the backwards it still owes."""
    out = []
    for order, start in zip(orders, cycle_start):
        cycle = order[start:]
        forwards_per_cycle = sum(cycle)
        flags = list(order)
        forwards = sum(flags)
        if forwards < m:
            # The cycle's net progress is the same for every stage (the state's indices are
            # relative to stage 0), and stage 0 still has forwards left, so it holds one.
            repeats = -(-(m - forwards) // forwards_per_cycle)
            flags.extend(cycle * repeats)
        out.append(_ref_first_forwards(tuple(flags), m))
    return tuple(out)


# ---- comparisons ----------------------------------------------------------------------------------

TIMES = [(1.0, 2.0), (1.0, 1.0), (1.0, 3.0), (2.0, 3.0), (2.0, 1.0), (0.7, 2.3)]


def _forget_derivations() -> None:
    """Both implementations start from empty caches."""
    generators.varuna_forward_flags.cache_clear()
    generators._VARUNA_LONGEST.clear()
    generators._VARUNA_CYCLES.clear()
    generators._VARUNA_PERIODIC.clear()
    reference_forward_flags.cache_clear()
    _REF_LONGEST.clear()
    _REF_CYCLES.clear()


@pytest.fixture(autouse=True)
def _fresh_caches():
    _forget_derivations()
    yield
    _forget_derivations()


def _assert_same_calls(calls, times) -> None:
    tf, tb = times
    for p, m in calls:
        assert generators.varuna_forward_flags(p, m, tf, tb) == reference_forward_flags(p, m, tf, tb), (p, m)
        assert generators.varuna_cycle(p, tf, tb) == reference_cycle(p, tf, tb), (p, m)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 24), st.integers(1, 400)), min_size=1, max_size=8),
    st.sampled_from(TIMES),
)
def test_any_sequence_of_calls_gives_the_reference_orders_and_cycles(calls, times):
    _forget_derivations()
    _assert_same_calls(calls, times)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.lists(st.integers(1, 600), min_size=2, max_size=6), st.sampled_from(TIMES))
def test_one_p_many_m_gives_the_reference_orders(p, ms, times):
    # Smaller and larger m after the first derivation: cut from the periodic order, or from the
    # longest derivation when no cycle was found.
    _forget_derivations()
    _assert_same_calls([(p, m) for m in ms], times)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 30), st.integers(1, 500), st.sampled_from(TIMES))
def test_single_derivation_is_the_reference_derivation(p, m, times):
    tf, tb = times
    assert generators._varuna_flags(p, m, tf, tb) == _ref_flags(p, m, tf, tb)
    assert generators.varuna_cycle(p, tf, tb) == reference_cycle(p, tf, tb)


def test_planner_sizes_give_the_reference_orders():
    # The stage counts and micro-batch counts of the 3,072-GPU planning benchmark.
    _assert_same_calls([(43, 768), (43, 1536), (69, 1536), (69, 3072), (11, 384), (64, 3072)], (1.0, 2.0))


def test_small_m_derived_in_full_then_larger_m_gives_the_reference():
    # m too small for a repeat: the full derivation, then a longer one that finds the cycle.
    _assert_same_calls([(20, 3), (20, 5), (20, 2)], (1.0, 2.0))
    assert generators.varuna_cycle(20) is None
    _assert_same_calls([(20, 200), (20, 7), (20, 1000)], (1.0, 2.0))
    assert generators.varuna_cycle(20) is not None


def test_derivation_without_a_cycle_grows_its_end_tables_to_m():
    # Non-whole times: no cycle watch, so the derivation runs to m = 300, far past the
    # 4p + 16 micro-batches its end tables start with.
    for p in (1, 3, 8):
        assert generators._varuna_flags(p, 300, 0.7, 2.3) == _ref_flags(p, 300, 0.7, 2.3)
    assert generators.varuna_cycle(3, 0.7, 2.3) is None
