"""Varuna's compact, periodic order (`pipectl.plan.fast.varuna_flags`) is the definition's order
(`pipectl.schedule.varuna_order`) for every m, whatever was asked for before."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.plan.fast import varuna_flags
from pipectl.schedule.ir import Action, ActionKind
from pipectl.schedule.varuna_order import varuna_order

F, B, R = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECOMPUTE
TIMES = [(1.0, 2.0), (1.0, 1.0), (1.0, 3.0), (2.0, 3.0), (2.0, 1.0), (0.7, 2.3)]


def expanded(p, flags):
    """The actions the flags stand for: forwards, and (recompute +) backwards, in micro-batch order."""
    orders = []
    for s, stage_flags in enumerate(flags):
        order, forwards, backwards = [], 0, 0
        for is_forward in stage_flags:
            if is_forward:
                order.append(Action(s, F, forwards))
                forwards += 1
            else:
                if s != p - 1:
                    order.append(Action(s, R, backwards))
                order.append(Action(s, B, backwards))
                backwards += 1
        orders.append(order)
    return orders


def forget():
    varuna_flags.forward_flags.cache_clear()
    varuna_flags._periodic_order.cache_clear()


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 12), st.integers(1, 300), st.sampled_from(TIMES))
def test_flags_are_the_definition(p, m, times):
    assert expanded(p, varuna_flags.forward_flags(p, m, *times)) == varuna_order(p, m, *times)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 16), st.integers(1, 200)), min_size=2, max_size=6), st.sampled_from(TIMES))
def test_any_order_of_calls_gives_the_same_answers(calls, times):
    forget()
    first = [(varuna_flags.forward_flags(p, m, *times), varuna_flags.cycle(p, *times)) for p, m in calls]
    forget()
    shuffled = list(enumerate(calls))
    random.Random(len(calls)).shuffle(shuffled)
    again = {i: (varuna_flags.forward_flags(p, m, *times), varuna_flags.cycle(p, *times)) for i, (p, m) in shuffled}
    assert first == [again[i] for i in range(len(calls))]


@pytest.mark.parametrize("p, m", [(43, 768), (11, 384), (4, 1000)])
def test_planner_sizes_give_the_definition(p, m):
    assert expanded(p, varuna_flags.forward_flags(p, m)) == varuna_order(p, m)


@pytest.mark.slow
@pytest.mark.parametrize("p, m", [(43, 1536), (69, 1536), (69, 3072), (64, 3072)])
def test_largest_planner_sizes_give_the_definition(p, m):
    assert expanded(p, varuna_flags.forward_flags(p, m)) == varuna_order(p, m)


@pytest.mark.parametrize("p", list(range(1, 25)) + [43, 69, 128])
def test_whole_number_times_find_the_cycle(p):
    # The fast step time skips cycles only where the order's cycle is known.
    assert varuna_flags.cycle(p) is not None


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 16), st.integers(1, 6), st.sampled_from(TIMES[:5]))
def test_the_definition_repeats_its_cycle_until_each_stage_runs_out_of_forwards(p, extra, times):
    starts, q = varuna_flags.cycle(p, *times)
    m = 4 * p + 8 + extra * q
    definition = [[a.kind is F for a in order if a.kind is not R] for order in varuna_order(p, m, *times)]
    for s, order in enumerate(definition):
        last_forward = max(i for i, is_forward in enumerate(order) if is_forward)
        first = order[starts[s]: starts[s] + 2 * q]
        assert sum(first) == q
        k = starts[s]
        while k + 2 * q <= last_forward + 1:
            assert order[k: k + 2 * q] == first
            k += 2 * q


def test_times_that_are_not_whole_numbers_derive_every_m_in_full():
    # No cycle watch: the derivation runs to m = 300, far past the 4p + 16 micro-batches its end
    # tables start with.
    assert varuna_flags.cycle(3, 0.7, 2.3) is None
    for p in (1, 3, 8):
        assert expanded(p, varuna_flags.forward_flags(p, 300, 0.7, 2.3)) == varuna_order(p, 300, 0.7, 2.3)


def test_flags_count_every_forward_and_backward_once():
    for flags in varuna_flags.forward_flags(6, 25):
        assert sum(flags) == 25 and len(flags) == 50


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 16), st.integers(1, 300), st.sampled_from(TIMES))
def test_order_ends_are_what_the_flags_show(p, m, times):
    flags = varuna_flags.forward_flags(p, m, *times)
    warm_up = tuple(order.index(False) for order in flags)
    cool_down = tuple(len(order) - 1 - max(i for i, forward in enumerate(order) if forward) for order in flags)
    assert varuna_flags.order_ends(p, m, *times) == (warm_up, cool_down)
