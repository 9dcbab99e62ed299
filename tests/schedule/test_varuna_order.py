"""Varuna's compact order equals the action-by-action derivation it replaced (kept here as the
reference), so the planner's fast timing reads the schedule the runtime executes."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.errors import ScheduleError
from pipectl.schedule.generators import _varuna_order, varuna_forward_flags
from pipectl.schedule.ir import Action, ActionKind

F = ActionKind.FORWARD
B = ActionKind.BACKWARD
R = ActionKind.RECOMPUTE


def reference_varuna_order(p: int, m: int, tf: float, tb: float) -> list[list[Action]]:
    last = p - 1
    never = float("inf")
    forward_end = [[never] * m for _ in range(p)]
    backward_end = [[never] * m for _ in range(p)]  # known once the backward has started
    next_forward = [0] * p
    next_backward = [0] * p
    recomputed = [False] * p
    free_at = [0.0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    now = 0.0
    while any(nb < m for nb in next_backward):
        for s in range(p):
            if free_at[s] > now or next_backward[s] >= m:
                continue
            i = next_backward[s]
            choice: tuple[ActionKind, int, float] | None = None
            if s == last:
                if forward_end[s][i] <= now:
                    choice = (B, i, tb)
            elif recomputed[s]:
                if backward_end[s + 1][i] <= now:
                    choice = (B, i, tb)
            elif forward_end[s][i] <= now and backward_end[s + 1][i] - tf <= now:
                choice = (R, i, tf)
            if choice is None and not (s != last and recomputed[s]):
                j = next_forward[s]
                if j < m and (s == 0 or forward_end[s - 1][j] <= now):
                    choice = (F, j, tf)
            if choice is None:
                continue
            kind, microbatch, seconds = choice
            orders[s].append(Action(s, kind, microbatch))
            free_at[s] = now + seconds
            if kind is F:
                forward_end[s][microbatch] = free_at[s]
                next_forward[s] += 1
            elif kind is R:
                recomputed[s] = True
            else:
                backward_end[s][microbatch] = free_at[s]
                next_backward[s] += 1
                recomputed[s] = False
        # Advance to the next moment anything can change: a stage frees up, or a recompute
        # becomes eligible (T_f before a known backward end).
        upcoming = [t for t in free_at if t > now]
        upcoming += [
            backward_end[s + 1][next_backward[s]] - tf
            for s in range(last)
            if next_backward[s] < m and backward_end[s + 1][next_backward[s]] - tf > now
        ]
        upcoming = [t for t in upcoming if t != never]
        if not upcoming:
            if any(nb < m for nb in next_backward):  # pragma: no cover - would be a bug above
                raise ScheduleError(f"Varuna schedule generation stalled at t={now} (p={p}, m={m})")
            break
        now = min(upcoming)
    if any(nf < m for nf in next_forward):  # pragma: no cover - B(i) implies F(i)
        raise ScheduleError(f"Varuna schedule generation left forwards unscheduled (p={p}, m={m})")
    return orders



@settings(max_examples=120, deadline=None)
@given(
    st.integers(1, 9),
    st.integers(1, 60),
    st.sampled_from([(1.0, 2.0), (1.0, 1.0), (1.0, 3.0), (0.7, 2.3), (2.0, 1.0)]),
)
def test_compact_order_expands_to_the_reference_derivation(p, m, times):
    tf, tb = times
    assert _varuna_order(p, m, tf, tb) == reference_varuna_order(p, m, tf, tb)


def test_flags_count_every_forward_and_backward_once():
    for flags in varuna_forward_flags(6, 25):
        assert sum(flags) == 25 and len(flags) == 50


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 9), st.integers(1, 40), st.integers(1, 40), st.sampled_from([(1.0, 2.0), (1.0, 1.0), (0.7, 2.3)]))
def test_order_cut_from_a_longer_derivation_is_the_direct_one(p, m, extra, times):
    from pipectl.schedule.generators import _first_forwards, _varuna_flags

    tf, tb = times
    longer = _varuna_flags(p, m + extra, tf, tb)
    assert tuple(_first_forwards(order, m) for order in longer) == _varuna_flags(p, m, tf, tb)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 12), st.integers(1, 300), st.sampled_from([(1.0, 2.0), (1.0, 1.0), (1.0, 3.0), (2.0, 3.0)]))
def test_cycle_found_in_the_derivation_gives_the_full_derivation(p, m, times):
    from pipectl.schedule.generators import _varuna_flags

    tf, tb = times
    assert _varuna_flags(p, m, tf, tb) == _varuna_flags(p, m, tf, tb, periodic=False)
