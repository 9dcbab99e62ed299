"""Brute-force reference for Varuna's order: the best rule-compliant order of small pipelines.

A test helper (not product code: the planner never needs an exhaustive search; it only checks that
`pipectl.schedule.varuna_order` is as good as the rules allow). Everything here is independent of
`varuna_order` and of the simulator: its own exact evaluator, its own rule checker, its own search.

**Model.** p stages, m micro-batches, uniform stage times: a forward F(i) and a recompute R(i) take
T_f, a backward B(i) takes T_b, communication is free. Times are exact: the ratio T_b/T_f is a
`Fraction` b/a in lowest terms and the code counts in units of T_f/a (T_f = a, T_b = b, whole
numbers); results come back as `Fraction`s in units of T_f.

**Orders.** A schedule is one order per stage of its F, R and B actions. It is *structurally
compliant* (`structural_violations`) when

- each stage runs F(0..m-1), and B(0..m-1), once each and each kind in micro-batch order;
- on every stage but the last, every B(i) is immediately preceded by R(i), nothing between them
  (rule 2), and R(i) comes after F(i);
- the last stage runs no recompute (its B(i) comes after its F(i)).

**Timing** (`asap_times`): each action starts as soon as its stage has finished the action before
it in its order and its input has arrived: F(i) on stage s > 0 after F(i) on stage s-1 has ended;
B(i) on stage s < p-1 after B(i) on stage s+1 has ended (R(i) and the last stage's B(i) need only
their own stage's earlier actions). An order whose dependencies form a cycle deadlocks and is not
a schedule. The makespan is the end of the last action.

**Rules 1 and 3** are conditions on the timed order (`rule_violations`); t is the end of B(i) on
stage s+1, the moment the gradient reaches stage s:

- rule 1 (t - t' >= T_f, t' the start of R(i) on stage s): R(i) ends no later than its gradient
  arrives, so B(i) never waits for its recompute;
- rule 3 (a ready backward goes before a forward): no stage starts a forward F(j) at a moment tau at
  which its oldest pending backward i < j is ready. On the last stage B(i) is ready once F(i) has
  run, so the last stage runs F(i), B(i) alternately. On the other stages the backward is ready
  when its recompute is due, as Varuna's generator reads rule 1: stage s+1 started B(i) before tau
  (strictly: stages decide together from what has happened) and tau >= t - T_f.

`reference(p, m, ratio, rule1=..., rule3=...)` searches every structurally compliant order
(optionally also obeying rule 1 and/or rule 3) and returns the smallest makespan and an order
reaching it. Rule 3 as stated leaves a stage free to run a recompute early (before it is due) and
to wait; it forbids only a forward while a backward is ready. `all_orders` enumerates the same
space naively, for cross-checking the search on tiny instances.

*Rule-compliant*, for the tests, means structurally compliant and obeying rule 3: that set holds
Varuna's generator on every instance (its forwards start exactly when the derivation chooses them,
and it chooses a forward only when no recompute is due). Rule 1 is reported, not required: with
T_b/T_f not a whole number >= 2 the generator itself breaks it (a forward it started before a
recompute was due can still be running at that moment), and so does GPipe with recompute (its
second-to-last stage falls behind the last one); as a hard constraint it would only make stages
idle. `lateness` measures how far an order breaks it.

**Search.** An event-driven search over all orders at once. A stage that becomes free picks its
next action (next forward, or next recompute/backward), which then starts as soon as its input
has arrived: every order is one sequence of picks, and its timing is the ASAP timing. The state at
a moment (each stage's counts, its current action and the time left of it, all relative to now)
determines everything after it, so the least time to finish from a state is memoised: the number
of states is polynomial in m for fixed p, where the orders number about Catalan(m)^p.

Figure 4 of the paper (p=4, m=5, T_b = 2 T_f): 27 with rule 3 (Varuna's 27), 26 without it (the
last stage holds back B(0), which rule 3 forbids):

    >>> reference(4, 5, 2, rule3=True).makespan, reference(4, 5, 2).makespan
    (Fraction(27, 1), Fraction(26, 1))
"""

from __future__ import annotations

import sys
from fractions import Fraction
from itertools import product
from typing import NamedTuple

F, R, B = "F", "R", "B"
INF = float("inf")

Order = list[list[tuple[str, int]]]  # per stage: (kind, micro-batch) in order


def time_units(ratio) -> tuple[int, int]:
    """(T_f, T_b) as whole numbers for a backward/forward ratio (int, Fraction, str or float)."""
    r = Fraction(ratio).limit_denominator(10**6) if isinstance(ratio, float) else Fraction(ratio)
    if r <= 0:
        raise ValueError(f"the backward/forward ratio must be positive, got {ratio!r}")
    return r.denominator, r.numerator


# --------------------------------------------------------------------------- orders, timing, rules


def structural_violations(orders: Order, m: int) -> list[str]:
    """What makes `orders` not structurally compliant (see the module docstring); [] if it is."""
    p = len(orders)
    problems = []
    for s, order in enumerate(orders):
        last = s == p - 1
        forwards = [i for kind, i in order if kind == F]
        backwards = [i for kind, i in order if kind == B]
        recomputes = [i for kind, i in order if kind == R]
        if forwards != list(range(m)) or backwards != list(range(m)):
            problems.append(f"stage {s}: forwards or backwards not each once in micro-batch order")
        if last and recomputes:
            problems.append(f"stage {s}: the last stage recomputes")
        if not last and recomputes != list(range(m)):
            problems.append(f"stage {s}: recomputes not each once in micro-batch order")
        done = set()
        for k, (kind, i) in enumerate(order):
            if kind == B and not last and (k == 0 or order[k - 1] != (R, i)):
                problems.append(f"stage {s}: B{i} not immediately after R{i} (rule 2)")
            if kind in (R, B) and i not in done:
                problems.append(f"stage {s}: {kind}{i} before F{i}")
            if kind == F:
                done.add(i)
    return problems


def asap_times(orders: Order, tf, tb) -> dict[tuple[int, str, int], tuple]:
    """(stage, kind, micro-batch) -> (start, end) when every action starts as soon as its stage
    is free and its input has arrived. Raises ValueError if the orders deadlock."""
    p = len(orders)
    times: dict[tuple[int, str, int], tuple] = {}
    position = [0] * p
    free = [0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while position[s] < len(orders[s]):
                kind, i = orders[s][position[s]]
                if kind == F and s > 0:
                    needs = (s - 1, F, i)
                elif kind == B and s < p - 1:
                    needs = (s + 1, B, i)
                else:
                    needs = None
                if needs is not None and needs not in times:
                    break
                start = max(free[s], times[needs][1]) if needs is not None else free[s]
                free[s] = start + (tb if kind == B else tf)
                times[(s, kind, i)] = (start, free[s])
                position[s] += 1
                progress = True
    if any(position[s] < len(orders[s]) for s in range(p)):
        raise ValueError("the orders deadlock: their dependencies form a cycle")
    return times


def makespan(orders: Order, tf, tb):
    """The end of the last action under `asap_times` (in the units of tf and tb)."""
    return max(end for _, end in asap_times(orders, tf, tb).values())


def lateness(orders: Order, tf, tb):
    """How far the ASAP-timed orders break rule 1: the most any recompute ends after its gradient
    has arrived (its backward waits that long), 0 if none does (in the units of tf and tb)."""
    times = asap_times(orders, tf, tb)
    return max([0] + [end - times[(s + 1, B, i)][1] for (s, kind, i), (_, end) in times.items() if kind == R])


class Evaluation(NamedTuple):
    makespan: Fraction  # units of T_f
    lateness: Fraction  # units of T_f: see `lateness`
    rule1: list[str]  # where rule 1 breaks
    rule3: list[str]  # where rule 3 breaks


def evaluate(orders: Order, ratio) -> Evaluation:
    """Makespan, rule-1 lateness and rule breaks of `orders` with T_b = ratio * T_f."""
    tf, tb = time_units(ratio)
    broken = rule_violations(orders, tf, tb)
    return Evaluation(
        Fraction(makespan(orders, tf, tb), tf), Fraction(lateness(orders, tf, tb), tf), broken[1], broken[3]
    )


def rule_violations(orders: Order, tf, tb) -> dict[int, list[str]]:
    """{1: [...], 3: [...]}: where the ASAP-timed orders break rule 1 and rule 3 (module docstring).
    tf and tb are whole numbers (`time_units`); the messages give times in units of T_f."""
    p = len(orders)
    times = asap_times(orders, tf, tb)
    broken: dict[int, list[str]] = {1: [], 3: []}
    for s, order in enumerate(orders):
        pending = 0  # oldest micro-batch whose backward has not run here
        for kind, i in order:
            if kind == B:
                pending = i + 1
            if kind == R:
                gradient = times[(s + 1, B, i)][1]
                if times[(s, R, i)][1] > gradient:
                    broken[1].append(
                        f"stage {s}: R{i} ends at {Fraction(times[(s, R, i)][1], tf)}, gradient at {Fraction(gradient, tf)}"
                    )
            if kind == F and pending < i:
                tau = times[(s, F, i)][0]
                at = Fraction(tau, tf)
                if s == p - 1:
                    broken[3].append(f"stage {s}: F{i} at {at} while B{pending} is ready")
                else:
                    b_start, b_end = times[(s + 1, B, pending)]
                    if b_start < tau and b_end - tf <= tau:
                        broken[3].append(f"stage {s}: F{i} at {at} while R{pending} is due")
    return broken


def all_orders(p: int, m: int):
    """Every structurally compliant order (deadlocking ones included): Catalan(m)^p of them."""

    def stage_orders(last: bool):
        def extend(prefix, forwards, backwards):
            if backwards == m:
                yield prefix
                return
            if forwards < m:
                yield from extend(prefix + [(F, forwards)], forwards + 1, backwards)
            if backwards < forwards:
                pair = [(B, backwards)] if last else [(R, backwards), (B, backwards)]
                yield from extend(prefix + pair, forwards, backwards + 1)

        return list(extend([], 0, 0))

    per_stage = [stage_orders(s == p - 1) for s in range(p)]
    for combination in product(*per_stage):
        yield [list(order) for order in combination]


def exhaustive(p: int, m: int, ratio, *, rule1: bool = False, rule3: bool = False):
    """The least makespan over `all_orders`, each timed and checked on its own (slow: tiny p, m)."""
    tf, tb = time_units(ratio)
    best = None
    for orders in all_orders(p, m):
        try:
            broken = rule_violations(orders, tf, tb)
        except ValueError:
            continue
        if (rule1 and broken[1]) or (rule3 and broken[3]):
            continue
        span = makespan(orders, tf, tb)
        if best is None or span < best:
            best = span
    return None if best is None else Fraction(best, tf)


# --------------------------------------------------------------------------- the search

# a stage's state: (forwards started, backwards started, R(next backward) done, activity, time left)
FREE, RUN_F, RUN_R, RUN_B, WAIT_F, WAIT_B = range(6)


class Reference(NamedTuple):
    makespan: Fraction | None  # in units of T_f; None: no order obeys the rules asked for
    orders: Order | None  # one order reaching it
    states: int  # states the search memoised


class _Search:
    def __init__(self, p: int, m: int, tf: int, tb: int, rule1: bool, rule3: bool) -> None:
        self.p, self.m, self.tf, self.tb, self.rule1, self.rule3 = p, m, tf, tb, rule1, rule3
        self.memo: dict[tuple, tuple[float, tuple | None]] = {}

    def options(self, state: tuple, s: int) -> list[str]:
        """What free stage s may run next: its next forward, its next recompute (last stage:
        backward), in the structural order."""
        nf, nb, _, _, _ = state[s]
        choices = []
        if nf < self.m:
            choices.append(F)
        if nb < nf:
            choices.append(B if s == self.p - 1 else R)
        return choices

    def step(self, state: tuple, picks: dict[int, str]):
        """From `state` at now, free stages pick `picks`; everything that can starts now; time runs
        to the next end. Returns (elapsed, next state, actions started now), or None where a rule
        breaks or nothing can ever run again (a deadlock)."""
        p, tf, tb = self.p, self.tf, self.tb
        stages = [list(stage) for stage in state]
        for s, kind in picks.items():
            stages[s][3] = WAIT_F if kind == F else WAIT_B if s == p - 1 else RUN_R
            if kind == R:
                stages[s][4] = tf
        started = [(s, R, state[s][1]) for s, kind in picks.items() if kind == R]
        # starts: conditions read `state` (what ended or started before now); nothing ends now
        for s, stage in enumerate(stages):
            nf, nb, _, activity, _ = stage
            if activity == WAIT_F:
                if s > 0:
                    before = state[s - 1]
                    if not nf < before[0] - (before[3] == RUN_F):
                        continue  # F(nf) has not ended on the stage before
                if self.rule3 and nb < nf:
                    if s == p - 1:
                        return None  # B(nb) is ready on the last stage
                    after = state[s + 1]
                    if nb < after[1]:  # stage s+1 started B(nb) before now ...
                        ended = nb < after[1] - (after[3] == RUN_B)
                        if ended or after[4] <= tf:  # ... and it ends by now + T_f: R(nb) is due
                            return None
                stage[0], stage[3], stage[4] = nf + 1, RUN_F, tf
                started.append((s, F, nf))
            elif activity == WAIT_B:
                if s < p - 1:
                    after = state[s + 1]
                    if not nb < after[1] - (after[3] == RUN_B):
                        continue  # the gradient of B(nb) has not arrived
                stage[1], stage[2], stage[3], stage[4] = nb + 1, False, RUN_B, tb
                started.append((s, B, nb))
        running = [stage[4] for stage in stages if stage[3] in (RUN_F, RUN_R, RUN_B)]
        if not running:
            return None  # everyone waits for someone: a deadlock (finished states never get here)
        elapsed = min(running)
        finished_backward = []
        for s, stage in enumerate(stages):
            if stage[3] not in (RUN_F, RUN_R, RUN_B):
                continue
            stage[4] -= elapsed
            if stage[4] == 0:
                if stage[3] == RUN_R:
                    stage[2], stage[3] = True, WAIT_B  # rule 2: B(nb) is next
                else:
                    if stage[3] == RUN_B:
                        finished_backward.append(s)
                    stage[3] = FREE
        if self.rule1:
            for s in finished_backward:
                if s > 0:
                    nb, recomputed = stages[s - 1][1], stages[s - 1][2]
                    if not (recomputed and nb == stages[s][1] - 1):
                        return None  # the gradient arrives before the recompute has ended
        return elapsed, tuple(tuple(stage) for stage in stages), started

    def best(self, state: tuple) -> float:
        """Least time from `state` to the end of the last action (INF: no compliant way)."""
        known = self.memo.get(state)
        if known is not None:
            return known[0]
        free = [s for s, stage in enumerate(state) if stage[3] == FREE and stage[1] < self.m]
        if not free and all(stage[1] == self.m and stage[3] == FREE for stage in state):
            self.memo[state] = (0, None)
            return 0
        best_time, best_picks = INF, None
        for kinds in product(*(self.options(state, s) for s in free)):
            picks = dict(zip(free, kinds))
            stepped = self.step(state, picks)
            if stepped is None:
                continue
            elapsed, following, _ = stepped
            total = elapsed + self.best(following)
            if total < best_time:
                best_time, best_picks = total, picks
        self.memo[state] = (best_time, best_picks)
        return best_time

    def start(self) -> tuple:
        return tuple((0, 0, False, FREE, 0) for _ in range(self.p))

    def replay(self) -> Order:
        orders: Order = [[] for _ in range(self.p)]
        state = self.start()
        while self.memo[state][1] is not None:
            _, following, started = self.step(state, self.memo[state][1])
            for s, kind, i in started:
                orders[s].append((kind, i))
            state = following
        return orders


def reference(p: int, m: int, ratio=2, *, rule1: bool = False, rule3: bool = False) -> Reference:
    """The least makespan (units of T_f) over all structurally compliant orders of p stages and m
    micro-batches with T_b = ratio * T_f, R = T_f, free communication; with `rule1`/`rule3`, over
    those that also obey rule 1/rule 3 (module docstring). Also one order reaching it."""
    tf, tb = time_units(ratio)
    search = _Search(p, m, tf, tb, rule1, rule3)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * (3 * p * m + 10)))
    try:
        total = search.best(search.start())
    finally:
        sys.setrecursionlimit(limit)
    if total == INF:
        return Reference(None, None, len(search.memo))
    return Reference(Fraction(total, tf), search.replay(), len(search.memo))
