"""The partitioner against brute force over every cut on small non-uniform cases."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.plan.partition import balanced_partition, greedy_cuts, min_bottlenecks


def all_cuts(layers: int, stages: int):
    for cut_points in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cut_points, layers)
        yield tuple(zip(bounds, bounds[1:]))


def brute_force(weights, stages, fits=None, cut_seconds=None):
    best = None
    for cuts in all_cuts(len(weights), stages):
        if fits and not all(fits(i, s, e) for i, (s, e) in enumerate(cuts)):
            continue
        value = max(sum(weights[s:e]) for s, e in cuts)
        if cut_seconds is not None and stages > 1:
            value = max(value, max(cut_seconds[s] for s, _ in cuts[1:]))
        if best is None or value < best:
            best = value
    return best


weights_strategy = st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=9)


@settings(max_examples=150, deadline=None)
@given(weights=weights_strategy, data=st.data())
def test_balanced_partition_matches_brute_force(weights, data):
    stages = data.draw(st.integers(min_value=1, max_value=len(weights)))
    from_right = data.draw(st.booleans())
    result = balanced_partition(weights, stages, from_right=from_right)
    expected = brute_force(weights, stages)
    assert result is not None
    assert result.bottleneck_seconds == pytest.approx(expected)
    assert len(result.stage_layers) == stages
    assert result.stage_layers[0][0] == 0 and result.stage_layers[-1][1] == len(weights)
    assert all(end > start for start, end in result.stage_layers)


@settings(max_examples=150, deadline=None)
@given(weights=weights_strategy, data=st.data())
def test_memory_limit_is_respected_and_optimal(weights, data):
    stages = data.draw(st.integers(min_value=1, max_value=len(weights)))
    # Memory of a stage: its layer count, plus more for early stages (like 1F1B's in-flight count).
    capacity = data.draw(st.integers(min_value=1, max_value=len(weights) + stages))

    def fits(index, start, end):
        return (end - start) + (stages - index) <= capacity

    result = balanced_partition(weights, stages, fits=fits)
    expected = brute_force(weights, stages, fits=fits)
    if expected is None:
        assert result is None
    else:
        assert result is not None
        assert result.bottleneck_seconds == pytest.approx(expected)
        assert all(fits(i, s, e) for i, (s, e) in enumerate(result.stage_layers))


@settings(max_examples=100, deadline=None)
@given(weights=weights_strategy, data=st.data())
def test_cut_costs_count_in_the_bottleneck(weights, data):
    stages = data.draw(st.integers(min_value=1, max_value=len(weights)))
    cut_seconds = [0.0] + [data.draw(st.integers(min_value=0, max_value=80)) for _ in range(len(weights) - 1)] + [0.0]
    result = balanced_partition(weights, stages, cut_seconds=cut_seconds)
    expected = brute_force(weights, stages, cut_seconds=cut_seconds)
    assert result is not None
    assert result.bottleneck_seconds == pytest.approx(expected)


@settings(max_examples=100, deadline=None)
@given(weights=st.lists(st.floats(min_value=0.01, max_value=5.0), min_size=1, max_size=10))
def test_min_bottlenecks_for_every_p_at_once(weights):
    counts = list(range(1, len(weights) + 1))
    found = min_bottlenecks(weights, counts)
    for stages in counts:
        assert found[stages] == pytest.approx(brute_force(weights, stages), rel=1e-9)
        # And the greedy cut at that bottleneck gives exactly p stages.
        prefix = [0.0]
        for w in weights:
            prefix.append(prefix[-1] + w)
        cuts = greedy_cuts(prefix, stages, found[stages])
        assert cuts is not None and len(cuts) == stages


def test_embedding_and_head_unlike_blocks():
    # A GPT-like model: a cheap embedding, 8 equal blocks, a norm and an expensive logit layer.
    weights = [0.2] + [1.0] * 8 + [0.05, 2.5]
    result = balanced_partition(weights, 4)
    assert result.bottleneck_seconds == pytest.approx(brute_force(weights, 4))
    assert result.stage_layers[-1][1] - result.stage_layers[-1][0] <= 2  # the head stage stays short


def test_big_model_is_fast():
    rng = random.Random(0)
    weights = [0.3] + [1.0 + rng.random() * 0.01 for _ in range(128)] + [0.01, 1.7]
    found = min_bottlenecks(weights, range(1, 132))
    assert found[128] >= max(weights)
    assert found[1] == pytest.approx(sum(weights))


@settings(max_examples=150, deadline=None)
@given(weights=weights_strategy, data=st.data())
def test_starting_from_a_laxer_demands_optimum_keeps_the_optimum(weights, data):
    stages = data.draw(st.integers(min_value=1, max_value=len(weights)))
    lax = data.draw(st.integers(min_value=1, max_value=len(weights) + stages))
    strict = data.draw(st.integers(min_value=1, max_value=lax))

    def fits_under(capacity):
        return lambda index, start, end: (end - start) + (stages - index) <= capacity

    laxer = balanced_partition(weights, stages, fits=fits_under(lax))
    at_least = laxer.bottleneck_seconds if laxer is not None else 0.0
    result = balanced_partition(weights, stages, fits=fits_under(strict), at_least=at_least)
    expected = brute_force(weights, stages, fits=fits_under(strict))
    if expected is None:
        assert result is None
    else:
        assert result is not None and result.bottleneck_seconds == pytest.approx(expected)
        assert result == balanced_partition(weights, stages, fits=fits_under(strict))
