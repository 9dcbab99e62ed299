"""Schedule generators: pure functions `(p, m, v) -> Schedule` with compute actions only.

Each generator returns, for every rank, the ordered forward (F), backward (B) and recompute (R)
actions of one optimizer step, followed by one all-reduce (AR) and one optimizer step (STEP).
Sends and receives are added by a separate pass (`pipectl.schedule.comm.add_communication`); timing
by the simulator (`pipectl.plan.simulate`). SPEC §4 describes every schedule here.

The AR and STEP actions carry the rank as their stage (the rank's chunk-0 virtual stage).

Worked example, 1F1B with flush on p=2 ranks and m=3 micro-batches (stage 0 warms up with
p - 0 - 1 = 1 forward, stage 1 with none):

    >>> print(one_f_one_b(2, 3).to_text(), end="")
    # 1f1b p=2 m=3 v=1
    0: 0F0 0F1 0B0 0F2 0B1 0B2 0AR 0STEP
    1: 1F0 1B0 1F1 1B1 1F2 1B2 1AR 1STEP

`generate` is the single dispatch everyone uses; it is cached, so the returned `Schedule` is shared:
treat it (and its `actions` mapping) as immutable.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache
from heapq import heappop, heappush
from itertools import compress, count

from pipectl.errors import ScheduleError
from pipectl.schedule.ir import Action, ActionKind, Schedule, ScheduleKind

F = ActionKind.FORWARD
B = ActionKind.BACKWARD
R = ActionKind.RECOMPUTE


def _check_degrees(pipeline_parallel: int, micro_batches: int, chunks: int = 1) -> None:
    for name, value in (
        ("pipeline-parallel degree p", pipeline_parallel),
        ("micro-batches per step m", micro_batches),
        ("chunks per rank v", chunks),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} must be a whole number >= 1, got {value!r}")


def _finish(
    kind: ScheduleKind,
    pipeline_parallel: int,
    micro_batches: int,
    chunks: int,
    compute: list[list[Action]],
) -> Schedule:
    """Append AR and STEP to every rank's compute order and freeze it into a `Schedule`."""
    actions = {
        rank: tuple(order)
        + (Action(rank, ActionKind.ALL_REDUCE), Action(rank, ActionKind.OPTIMIZER_STEP))
        for rank, order in enumerate(compute)
    }
    return Schedule(kind, pipeline_parallel, micro_batches, chunks, actions)


def _insert_recompute(compute: list[list[Action]], last_stage: int) -> list[list[Action]]:
    """Put R(i) right before every B(i), except on the last (virtual) stage.

    The last stage runs its backward straight after its forward, so its activations are never
    dropped; recomputing them would only cost time (Varuna §3.2, Megatron's checkpointing).
    """
    out = []
    for order in compute:
        with_r: list[Action] = []
        for action in order:
            if action.kind is B and action.stage != last_stage:
                with_r.append(Action(action.stage, R, action.microbatch))
            with_r.append(action)
        out.append(with_r)
    return out


def _gpipe_order(p: int, m: int) -> list[list[Action]]:
    return [[Action(s, F, i) for i in range(m)] + [Action(s, B, i) for i in range(m)] for s in range(p)]


def _one_f_one_b_order(p: int, m: int) -> list[list[Action]]:
    """PipeDream-Flush: min(p - s - 1, m) warm-up forwards, then F/B pairs, then drain backwards."""
    compute = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        order = [Action(s, F, i) for i in range(warmup)]
        for i in range(m - warmup):
            order.append(Action(s, F, warmup + i))
            order.append(Action(s, B, i))
        order.extend(Action(s, B, i) for i in range(m - warmup, m))
        compute.append(order)
    return compute


def gpipe(pipeline_parallel: int, micro_batches: int, recompute: bool = False) -> Schedule:
    """GPipe: all m forwards, then all m backwards (in micro-batch order); flush; step.

    >>> print(gpipe(2, 2).to_text(), end="")
    # gpipe p=2 m=2 v=1
    0: 0F0 0F1 0B0 0B1 0AR 0STEP
    1: 1F0 1F1 1B0 1B1 1AR 1STEP
    """
    _check_degrees(pipeline_parallel, micro_batches)
    compute = _gpipe_order(pipeline_parallel, micro_batches)
    if recompute:
        compute = _insert_recompute(compute, pipeline_parallel - 1)
    return _finish(ScheduleKind.GPIPE, pipeline_parallel, micro_batches, 1, compute)


def one_f_one_b(pipeline_parallel: int, micro_batches: int, recompute: bool = False) -> Schedule:
    """1F1B with flush (PipeDream-Flush, Narayanan et al. 2021 §3.1); see the module docstring."""
    _check_degrees(pipeline_parallel, micro_batches)
    compute = _one_f_one_b_order(pipeline_parallel, micro_batches)
    if recompute:
        compute = _insert_recompute(compute, pipeline_parallel - 1)
    return _finish(ScheduleKind.ONE_F_ONE_B, pipeline_parallel, micro_batches, 1, compute)


def interleaved(
    pipeline_parallel: int, micro_batches: int, chunks: int, recompute: bool = False
) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021 §2.2), in Megatron-LM's order.

    Rank k holds chunks c = 0..v-1, i.e. virtual stages k, k+p, k+2p, ...; virtual stage
    s = c·p + k. The m·v "virtual micro-batches" of a rank are visited in groups of p: virtual
    micro-batch j runs chunk (j mod p·v) // p (reversed for backwards) on micro-batch
    (j // (p·v))·p + j mod p. Rank k warms up with 2(p-k-1) + (v-1)·p forwards (all of them when
    m == p, as Megatron does), then alternates one forward and one backward, then drains.
    Requires m to be a multiple of p when v > 1; with v == 1 this is plain 1F1B.

    >>> print(interleaved(2, 2, 2).to_text(), end="")
    # interleaved p=2 m=2 v=2
    0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1 0AR 0STEP
    1: 1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1 1AR 1STEP
    """
    p, m, v = pipeline_parallel, micro_batches, chunks
    _check_degrees(p, m, v)
    if v == 1:
        compute = _one_f_one_b_order(p, m)
    else:
        if m % p != 0:
            raise ScheduleError(
                f"interleaved schedule needs micro-batches m={m} to be a multiple of the "
                f"pipeline-parallel degree p={p} (v={v} chunks)",
                hint=f"use m in {{{p}, {2 * p}, {3 * p}, ...}} or the 1f1b schedule",
            )
        compute = [_interleaved_rank_order(p, m, v, rank) for rank in range(p)]
    if recompute:
        compute = _insert_recompute(compute, p * v - 1)
    return _finish(ScheduleKind.INTERLEAVED, p, m, v, compute)


def _interleaved_rank_order(p: int, m: int, v: int, rank: int) -> list[Action]:
    total = m * v
    group = p * v

    def action(j: int, kind: ActionKind) -> Action:
        chunk = (j % group) // p
        if kind is B:
            chunk = v - 1 - chunk
        microbatch = (j // group) * p + j % p
        return Action(chunk * p + rank, kind, microbatch)

    if m == p:
        warmup = total
    else:
        warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = [action(j, F) for j in range(warmup)]
    for j in range(total - warmup):
        order.append(action(warmup + j, F))
        order.append(action(j, B))
    order.extend(action(j, B) for j in range(total - warmup, total))
    return order


def pipedream_2bw(pipeline_parallel: int, micro_batches: int, recompute: bool = False) -> Schedule:
    """PipeDream-2BW (Narayanan et al. 2021 §3.1): 1F1B order, no flush, two weight versions.

    One step's representation is the 1F1B order; what differs is the semantics, which the runtime
    and the planner must honour: there is no pipeline flush between steps, and micro-batch k
    (1-based, counted over the whole run) uses weight version `weight_version(k, m)` =
    max(⌊(k−1)/m⌋ − 1, 0), so updates are 1-stale: W(t+1) = W(t) − ν·∇f(W(t−1)). This is a
    different optimizer: `ScheduleKind.PIPEDREAM_2BW.changes_optimizer_semantics` is True and it
    must never be chosen silently.
    """
    _check_degrees(pipeline_parallel, micro_batches)
    compute = _one_f_one_b_order(pipeline_parallel, micro_batches)
    if recompute:
        compute = _insert_recompute(compute, pipeline_parallel - 1)
    return _finish(ScheduleKind.PIPEDREAM_2BW, pipeline_parallel, micro_batches, 1, compute)


def weight_version(microbatch_number: int, micro_batches: int) -> int:
    """PipeDream-2BW: the weight version used by micro-batch k (1-based): max(⌊(k−1)/m⌋ − 1, 0).

    >>> [weight_version(k, 2) for k in range(1, 9)]
    [0, 0, 0, 0, 1, 1, 2, 2]
    """
    if microbatch_number < 1:
        raise ScheduleError(f"micro-batch numbers are 1-based, got {microbatch_number}")
    if micro_batches < 1:
        raise ScheduleError(f"micro-batches per step m must be >= 1, got {micro_batches}")
    return max((microbatch_number - 1) // micro_batches - 1, 0)


def varuna(
    pipeline_parallel: int,
    micro_batches: int,
    forward_seconds: float = 1.0,
    backward_seconds: float = 2.0,
) -> Schedule:
    """Varuna's rule-based schedule with recomputation (Athlur et al., EuroSys 2022, §3.2).

    Derived as Varuna does, from a simulation of one step with uniform stage times (one forward
    `forward_seconds` = T_f, one backward `backward_seconds`, one recompute = T_f, free
    communication). Whenever a stage is idle it picks, in this order:

    1. a recompute R(i) of its oldest pending backward i, once the next stage is known to finish
       B(i) at time t and now >= t − T_f. t − T_f is the latest start that still has the
       recompute done when the gradient arrives (SPEC §4 rule 1, t − t' ≥ T_f), and starting
       exactly then keeps the activations alive for the shortest time: an idle stage gets
       t − t' = T_f, the equality the "≥" allows and Varuna's own generator produces;
    2. after R(i) has run, only B(i) (rule 2: no forward between R(i) and B(i));
    3. B(i) if its gradient is there (rule 3: backward before forward), else the next forward.

    The last stage does not recompute: it runs B(i) right after F(i).

    >>> print(varuna(2, 3).to_text(), end="")
    # varuna p=2 m=3 v=1
    0: 0F0 0F1 0F2 0R0 0B0 0R1 0B1 0R2 0B2 0AR 0STEP
    1: 1F0 1B0 1F1 1B1 1F2 1B2 1AR 1STEP
    """
    p, m = pipeline_parallel, micro_batches
    _check_degrees(p, m)
    if not (forward_seconds > 0 and backward_seconds > 0):
        raise ScheduleError(
            f"Varuna's schedule needs positive stage times, got forward {forward_seconds!r} s, "
            f"backward {backward_seconds!r} s"
        )
    return _finish(ScheduleKind.VARUNA, p, m, 1, _varuna_order(p, m, forward_seconds, backward_seconds))


def _varuna_order(p: int, m: int, tf: float, tb: float) -> list[list[Action]]:
    """Varuna's order as actions, expanded from `varuna_forward_flags`."""
    orders: list[list[Action]] = []
    last = p - 1
    for s, flags in enumerate(varuna_forward_flags(p, m, tf, tb)):
        order: list[Action] = []
        forwards = backwards = 0
        for is_forward in flags:
            if is_forward:
                order.append(Action(s, F, forwards))
                forwards += 1
            else:
                if s != last:
                    order.append(Action(s, R, backwards))
                order.append(Action(s, B, backwards))
                backwards += 1
        orders.append(order)
    return orders


@lru_cache(maxsize=256)
def varuna_forward_flags(p: int, m: int, tf: float = 1.0, tb: float = 2.0) -> tuple[tuple[bool, ...], ...]:
    """Varuna's order per stage, compactly: True for the next forward, False for the next backward.

    Forwards and backwards each run in micro-batch order, and every backward of a stage other than
    the last is preceded by its recompute (rules 1-2), so this sequence is the whole order; the
    planner times it without building actions (`pipectl.plan.fast.varuna`). Cached and shared.

    The order for m is read off a derivation for more micro-batches M > m when one is at hand:
    each stage's choices up to its m-th forward are the same in both (a choice depends on fewer
    than m forwards of the previous stage, and on backwards of the next stage, which differ only
    once that stage has run its m-th forward, later), and after it only backwards are left. So
    the order for m is the M order up to each stage's m-th forward, then backwards. Once a
    derivation for p has found where the order turns periodic (`varuna_cycle`), every m is cut
    from that periodic order by arithmetic, without deriving again.

    >>> [''.join('F' if f else 'B' for f in flags) for flags in varuna_forward_flags(2, 3)]
    ['FFFBBB', 'FBFBFB']
    """
    key = (p, tf, tb)
    periodic = _VARUNA_PERIODIC.get(key)
    if periodic is not None:
        return periodic.flags(m)
    longest = _VARUNA_LONGEST.get(key)
    if longest is None or longest[0] < m:
        longest_m = max(m, 2 * longest[0]) if longest is not None else m
        flags = _varuna_flags(p, longest_m, tf, tb)
        periodic = _VARUNA_PERIODIC.get(key)
        if periodic is not None:  # this derivation found the cycle
            return flags if longest_m == m else periodic.flags(m)
        forwards_at = tuple(tuple(_forward_positions(order)) for order in flags)
        longest = (longest_m, flags, forwards_at)
        _VARUNA_LONGEST[key] = longest
    longest_m, flags, forwards_at = longest
    if longest_m == m:
        return flags
    out = []
    for order, positions in zip(flags, forwards_at):
        prefix = order[: positions[m - 1] + 1]  # up to the m-th forward, then backwards only
        out.append(prefix + (False,) * (2 * m - len(prefix)))
    return tuple(out)


class _PeriodicOrder:
    """Every stage's order for unboundedly many micro-batches: the choices a derivation made up to
    its first repeated state, then the choices since the state's first visit, repeated.

    `flags(m)` cuts it after each stage's m-th forward and appends the backwards still owed, which
    is Varuna's order for m (`varuna_forward_flags`). A toy two-stage order, stage 0 "F" then
    "FB" repeated, stage 1 "FB" repeated:

        >>> order = _PeriodicOrder([[True, True, False], [True, False]], [1, 0])
        >>> [''.join('F' if f else 'B' for f in flags) for flags in order.flags(3)]
        ['FFBFBB', 'FBFBFB']
    """

    def __init__(self, orders: list[list[bool]], cycle_starts: list[int]) -> None:
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
            prefix, prefix_forwards, cycle, cycle_forwards, unrolled = stage
            if m <= len(prefix_forwards):
                end = prefix_forwards[m - 1] + 1
            else:
                # The (extra + 1)-th forward of the cycle after `cycles` whole cycles is the m-th.
                # Every cycle holds forwards: the state's indices are relative to stage 0's
                # progress, so a cycle moves every stage on by the same number of forwards.
                cycles, extra = divmod(m - len(prefix_forwards) - 1, len(cycle_forwards))
                end = len(prefix) + cycles * len(cycle) + cycle_forwards[extra] + 1
                if end > len(unrolled):
                    unrolled = stage[4] = prefix + cycle * (cycles + 1)
            out.append(unrolled[:end] + (False,) * (2 * m - end))
        return tuple(out)


def _forward_positions(order) -> list[int]:
    """Positions of the forwards (True) in an order."""
    return list(compress(count(), order))


# (p, T_f, T_b) -> (M, order for M micro-batches, positions of each stage's forwards in it): the
# longest derivation so far, see above.
_VARUNA_LONGEST: dict[tuple[int, float, float], tuple[int, tuple[tuple[bool, ...], ...], tuple[tuple[int, ...], ...]]] = {}
# (p, T_f, T_b) -> (where each stage's cycle starts in its order, forwards per cycle), once found.
_VARUNA_CYCLES: dict[tuple[int, float, float], tuple[tuple[int, ...], int]] = {}
# (p, T_f, T_b) -> the periodic order every m is cut from, once a derivation found the cycle.
_VARUNA_PERIODIC: dict[tuple[int, float, float], _PeriodicOrder] = {}


def varuna_cycle(p: int, tf: float = 1.0, tb: float = 2.0) -> tuple[tuple[int, ...], int] | None:
    """Where Varuna's order for p stages turns periodic, if a derivation found it (see `_varuna_flags`).

    (starts, q): from position starts[s] on, stage s repeats a cycle of q forwards and q backwards
    (2q flags) for as long as it has forwards left; cycle k of every stage only needs actions of
    cycles up to k (they are the choices between two moments of the derivation). None when no
    derivation for this p has run or none found a cycle.
    """
    return _VARUNA_CYCLES.get((p, tf, tb))


def _first_forwards(order: tuple[bool, ...], m: int) -> tuple[bool, ...]:
    """A stage's order cut after its m-th forward, then the backwards it still owes."""
    positions = _forward_positions(order)
    if len(positions) < m:  # pragma: no cover - only cut from derivations for M > m
        raise ScheduleError(f"Varuna order has fewer than {m} forwards")
    prefix = order[: positions[m - 1] + 1]
    return prefix + (False,) * (2 * m - len(prefix))


def _varuna_flags(p: int, m: int, tf: float, tb: float, periodic: bool = True) -> tuple[tuple[bool, ...], ...]:
    """The rule-based derivation of `varuna_forward_flags` for exactly m micro-batches.

    With whole-number stage times (every time is then an exact float) the derivation watches for
    its state to repeat: every stage's remaining busy time, recompute flag, progress and the
    forward/backward ends its neighbours will still read, all relative to now and to stage 0's
    next forward. The derivation is deterministic, so from the first repeat on it cycles, and
    each stage's order is its order so far followed by the cycle's choices, repeated
    (`_PeriodicOrder`, kept for every later m); the order for m is then cut as in
    `varuna_forward_flags` (the run is the same as for unboundedly many micro-batches while
    stage 0 has forwards left).
    """
    watch = periodic and float(tf).is_integer() and float(tb).is_integer()
    seen: dict[tuple, tuple[list[int], int]] = {}  # full state -> (each stage's order length, base)
    # coarse key -> (moments not summarised yet, summaries seen); see the repeat check below
    summaries_by_key: dict[tuple, tuple[list[tuple], set[tuple]]] = {}
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
            more = min(allocated, m - allocated)
            for ends in forward_end + backward_end:
                ends.extend([_NEVER] * more)
            allocated += more
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
            # A cheap summary first; the full state only once the summary has come round before.
            # Summaries are filed under a coarser key (part of the summary) as raw copies, and
            # only computed once another moment with the same key needs comparing.
            base = next_forward[0]
            key = (tuple(recomputed), next_forward[last] - base, next_backward[last] - base)
            filed = summaries_by_key.get(key)
            if filed is None:
                summaries_by_key[key] = ([(now, base, free_at[:], next_forward[:], next_backward[:])], set())
                now = upcoming
                continue
            pending, seen_summaries = filed
            for earlier in pending:
                seen_summaries.add(_varuna_summary(*earlier))
            pending.clear()
            summary = _varuna_summary(now, base, free_at, next_forward, next_backward)
            if summary in seen_summaries:
                state = _varuna_state(now, free_at, recomputed, next_forward, next_backward, forward_end, backward_end)
                earlier = seen.get(state)
                if earlier is not None:
                    starts, earlier_base = earlier
                    _VARUNA_CYCLES[(p, tf, tb)] = (tuple(starts), base - earlier_base)
                    periodic_order = _PeriodicOrder(orders, starts)
                    _VARUNA_PERIODIC[(p, tf, tb)] = periodic_order
                    return periodic_order.flags(m)
                seen[state] = ([len(order) for order in orders], base)
            seen_summaries.add(summary)
        now = upcoming
    if any(nf < m for nf in next_forward):  # pragma: no cover - B(i) implies F(i)
        raise ScheduleError(f"Varuna schedule generation left forwards unscheduled (p={p}, m={m})")
    return tuple(tuple(order) for order in orders)


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
    """The derivation's state relative to now and to stage 0's progress (see `_varuna_flags`).

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


@lru_cache(maxsize=4096)
def generate(
    kind: ScheduleKind,
    pipeline_parallel: int,
    micro_batches: int,
    chunks: int = 1,
    recompute: bool = False,
    *,
    forward_seconds: float = 1.0,
    backward_seconds: float = 2.0,
) -> Schedule:
    """The one dispatch everyone uses: `generate(ScheduleKind.ONE_F_ONE_B, p, m)`.

    `chunks` (v) is only meaningful for the interleaved schedule. Varuna always recomputes (it is
    defined with recomputation; `recompute` is ignored for it), and its order is derived with
    uniform stage times `forward_seconds`/`backward_seconds` (only their ratio matters). The result
    is cached and shared: do not mutate it.

    >>> generate(ScheduleKind.GPIPE, 4, 8, recompute=True).actions[0][8]
    Action(stage=0, kind=<ActionKind.RECOMPUTE: 'R'>, microbatch=0)
    """
    try:
        kind = ScheduleKind(kind)
    except ValueError:
        known = ", ".join(k.value for k in ScheduleKind)
        raise ScheduleError(f"unknown schedule {kind!r}", hint=f"known schedules: {known}") from None
    _check_degrees(pipeline_parallel, micro_batches, chunks)
    if chunks != 1 and kind is not ScheduleKind.INTERLEAVED:
        raise ScheduleError(
            f"chunks v={chunks} needs the interleaved schedule, not {kind.value}",
            hint="pass --schedule interleaved, or v=1",
        )
    if kind is ScheduleKind.GPIPE:
        return gpipe(pipeline_parallel, micro_batches, recompute)
    if kind is ScheduleKind.ONE_F_ONE_B:
        return one_f_one_b(pipeline_parallel, micro_batches, recompute)
    if kind is ScheduleKind.INTERLEAVED:
        return interleaved(pipeline_parallel, micro_batches, chunks, recompute)
    if kind is ScheduleKind.VARUNA:
        return varuna(pipeline_parallel, micro_batches, forward_seconds, backward_seconds)
    return pipedream_2bw(pipeline_parallel, micro_batches, recompute)
