"""Varuna's generator against a brute-force search over rule-compliant orders (issue #17).

`varuna_reference` (beside this file) defines the orders, their exact ASAP timing and rules 1 and
3, and searches them all. Here: the search agrees with a naive enumeration, the evaluator agrees
with the simulator, and Varuna's generator is rule-compliant and as good as the best compliant
order, or within a stated bound.

The bound. With T_b/T_f a whole number >= 2 every moment of the derivation is a whole number of
T_f, so a forward the generator starts before a recompute is due has ended by then: no recompute
is late, and the generator reaches the minimum on every instance swept. With other ratios (1, 3/2,
...) a forward started while R(i) was not yet due (or, at T_b = T_f, not yet known: stage s+1
starts B(i) at the very moment R(i) falls due) can still be running at the due moment, so R(i)
ends after its gradient has arrived and B(i) waits that long (rule 1 broken; `lateness`). A
compliant order that recomputes first (early, which rule 3 allows) avoids that wait, and is
better by at most that lateness on every instance swept (p <= 5, m <= 8 at T_b/T_f in {1, 3/2,
2, 3}; p <= 4, m <= 7 at nine more ratios). Where there is a gap it is exactly that lateness
(at 1 and 3/2: m = 4 and 7 for every p >= 2; at 5/2: m = 5 and 6). That is measured, not proved. Rule-1-keeping
variants of the derivation (wait for the recompute rather than start a forward that would
overrun it; recompute early instead; let a stage see the next stage's same-moment start) were
tried against this reference: each is worse on more instances (worst gap 4 T_f against 1 T_f),
so `varuna_order` is left as it is.
"""

from __future__ import annotations

import sys
from fractions import Fraction
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # varuna_reference, beside this file

from varuna_reference import (  # noqa: E402
    evaluate,
    exhaustive,
    makespan,
    reference,
    structural_violations,
    time_units,
)

from pipectl.plan.simulate import simulate
from pipectl.plan.stage_costs import uniform_costs  # noqa: E402
from pipectl.schedule.generators import generate, gpipe, one_f_one_b  # noqa: E402
from pipectl.schedule.ir import ScheduleKind  # noqa: E402
from pipectl.schedule.varuna_order import varuna_order  # noqa: E402

RATIOS = [Fraction(2), Fraction(3), Fraction(3, 2), Fraction(1)]  # T_b / T_f
SMALL = [(p, m) for p in range(1, 5) for m in range(1, 7)]


def orders_of(per_stage_actions) -> list[list[tuple[str, int]]]:
    return [[(a.kind.value, a.microbatch) for a in order] for order in per_stage_actions]


def generator(p, m, ratio):
    return orders_of(varuna_order(p, m, 1.0, float(ratio)))


def gpipe_recompute(p, m):
    return orders_of(gpipe(p, m, recompute=True).compute_order(rank) for rank in range(p))


@pytest.mark.parametrize(
    ("p", "m", "ratio"), [(1, 3, 2), (2, 4, 1), (3, 5, Fraction(3, 2)), (4, 5, 2), (4, 6, 3), (4, 4, Fraction(3, 2))]
)
def test_the_evaluator_agrees_with_the_simulator(p, m, ratio):
    """The exact ASAP evaluator the reference uses gives the simulator's step time (free
    communication, zero all-reduce and optimizer) for Varuna's, GPipe's and 1F1B's orders."""
    tf, tb = time_units(ratio)
    costs = uniform_costs(p, 1, 1.0, float(ratio))
    schedules = [
        generate(ScheduleKind.VARUNA, p, m, forward_seconds=1.0, backward_seconds=float(ratio)),
        gpipe(p, m, recompute=True),
        one_f_one_b(p, m, recompute=True),
    ]
    for schedule in schedules:
        orders = orders_of(schedule.compute_order(rank) for rank in range(p))
        assert not structural_violations(orders, m), schedule.kind
        exact = Fraction(makespan(orders, tf, tb), tf)
        assert simulate(schedule, costs).step_seconds == pytest.approx(float(exact), abs=1e-9), schedule.kind


@pytest.mark.parametrize("rules", [(False, False), (False, True), (True, False), (True, True)])
def test_the_search_agrees_with_enumerating_every_order(rules):
    """The memoised search and a naive enumeration of all Catalan(m)^p orders (each timed and
    checked on its own) find the same minimum, with and without rules 1 and 3."""
    rule1, rule3 = rules
    for p, m in [(1, 3), (2, 1), (2, 2), (2, 3), (2, 4), (3, 2), (3, 3), (3, 4), (4, 2), (4, 3)]:
        for ratio in RATIOS:
            found = reference(p, m, ratio, rule1=rule1, rule3=rule3).makespan
            assert found == exhaustive(p, m, ratio, rule1=rule1, rule3=rule3), (p, m, ratio)


def test_the_papers_figure_4_instance():
    """p=4, m=5, T_f = R = 1, T_b = 2, free communication: Varuna 27, GPipe with recompute 28;
    the best rule-compliant order is 27 too, so Varuna is optimal here. Without rule 3 the best
    is 26: its last stage runs F0 F1 F2 before B0, holding back a ready backward."""
    ratio = 2
    assert evaluate(generator(4, 5, ratio), ratio).makespan == 27
    assert evaluate(gpipe_recompute(4, 5), ratio).makespan == 28
    assert reference(4, 5, ratio, rule3=True).makespan == 27
    assert reference(4, 5, ratio, rule1=True, rule3=True).makespan == 27
    assert reference(4, 5, ratio, rule1=True).makespan == 27
    unconstrained = reference(4, 5, ratio)
    assert unconstrained.makespan == 26
    assert evaluate(unconstrained.orders, ratio).rule3  # what 26 costs: rule 3


def test_a_late_recompute_is_the_gap():
    """p=2, m=4, T_b = 1.5 T_f: stage 0 starts F2 at 2, the moment stage 1 starts B0; R0 is due at
    2.5, F2 runs to 3, R0 ends at 4, half a T_f after its gradient (3.5). The best compliant order
    recomputes R0 at 2 instead and finishes half a T_f earlier."""
    ratio = Fraction(3, 2)
    ours = evaluate(generator(2, 4, ratio), ratio)
    assert ours.rule1[0] == "stage 0: R0 ends at 4, gradient at 7/2"
    best = reference(2, 4, ratio, rule3=True)
    assert (ours.makespan, ours.lateness, best.makespan) == (Fraction(31, 2), Fraction(1, 2), 15)
    assert best.orders[0][:3] == [("F", 0), ("F", 1), ("R", 0)]


def _check_instance(p, m, ratio):
    """Varuna's order against the best rule-compliant one on one instance (module docstring)."""
    order = generator(p, m, ratio)
    assert not structural_violations(order, m)
    ours = evaluate(order, ratio)
    best = reference(p, m, ratio, rule3=True)
    assert not ours.rule3, ours.rule3  # the generator is in the reference's set ...
    assert best.makespan <= ours.makespan  # ... so the minimum over it can only be lower
    check = evaluate(best.orders, ratio)  # the search's order, timed and checked on its own
    assert not structural_violations(best.orders, m) and not check.rule3
    assert check.makespan == best.makespan
    if ratio.denominator == 1 and ratio >= 2:
        assert ours.lateness == 0 and ours.makespan == best.makespan, (p, m, ratio)
    else:
        assert ours.makespan - best.makespan <= ours.lateness, (p, m, ratio)
    assert ours.makespan <= evaluate(gpipe_recompute(p, m), ratio).makespan
    return ours.makespan, best.makespan


@pytest.mark.parametrize("ratio", RATIOS, ids=str)
def test_the_generator_is_optimal_or_within_its_lateness(ratio):
    """p <= 4, m <= 6: the generator obeys rules 2 and 3; at T_b = 2 T_f and 3 T_f it finishes
    exactly when the best rule-compliant order does; at 1.5 T_f and T_f it is within its own
    largest rule-1 lateness (module docstring), and it is never later than GPipe with recompute."""
    gaps = {}
    for p, m in SMALL:
        ours, best = _check_instance(p, m, ratio)
        if ours != best:
            gaps[(p, m)] = ours - best
    if ratio.denominator != 1 or ratio < 2:
        # the instances where the generator is behind, and by how much: kept in view
        assert gaps == {(2, 4): 2 - ratio, (3, 4): 2 - ratio, (4, 4): 2 - ratio}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ratio", "stages", "micro_batches"),
    [(ratio, 5, 8) for ratio in RATIOS]
    + [(Fraction(ratio), 4, 7) for ratio in ("5/4", "4/3", "5/3", "7/4", "9/4", "5/2", "7/2", "4", "5")],
    ids=lambda value: str(value),
)
def test_the_generator_against_the_reference_on_larger_instances(ratio, stages, micro_batches):
    """The same checks on p <= 5, m <= 8 at the four ratios, p <= 4, m <= 7 at nine more (about
    12 s in all here)."""
    for p in range(1, stages + 1):
        for m in range(1, micro_batches + 1):
            _check_instance(p, m, ratio)
