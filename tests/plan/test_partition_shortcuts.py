"""The partitioner's shortcuts give the cut it finds without them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.plan.partition import balanced_partition, min_bottlenecks


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.integers(min_value=1, max_value=40), min_size=2, max_size=10),
    sizes=st.lists(st.integers(min_value=1, max_value=30), min_size=10, max_size=10),
    data=st.data(),
)
def test_furthest_ends_known_feasibility_and_the_unlimited_optimum_change_nothing(weights, sizes, data):
    layers = len(weights)
    stages = data.draw(st.integers(min_value=1, max_value=layers))
    limit = data.draw(st.integers(min_value=1, max_value=sum(sizes[:layers])))
    head = data.draw(st.integers(min_value=1, max_value=3))  # the first stage holds more in flight

    def fits(index, start, end):
        return sum(sizes[start:end]) * (head if index == 0 else 1) <= limit

    def furthest(index, start):
        return max([start] + [end for end in range(start + 1, layers + 1) if fits(index, start, end)])

    plain = balanced_partition(weights, stages, fits=fits)
    assert balanced_partition(weights, stages, furthest=furthest) == plain
    # Filling from the right asks `fits` of mirrored ranges: `furthest` then answers as a test.
    right = balanced_partition(weights, stages, fits=fits, from_right=True)
    assert balanced_partition(weights, stages, furthest=furthest, from_right=True) == right
    if plain is not None:
        unlimited = min_bottlenecks(weights, [stages])[stages]
        fast = balanced_partition(weights, stages, furthest=furthest, known_feasible=True, at_least=unlimited)
        assert fast == plain
