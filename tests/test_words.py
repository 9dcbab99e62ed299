"""Counted nouns: one is singular, everything else plural (0 included)."""

import doctest

import pytest

import pipectl.words
from pipectl.words import count


def test_docstring_examples():
    assert doctest.testmod(pipectl.words).failed == 0


@pytest.mark.parametrize(
    "number, noun, expected",
    [(1, "rank", "1 rank"), (2, "rank", "2 ranks"), (0, "device", "0 devices"), (1, "step", "1 step"),
     (4, "stage", "4 stages"), (1, "layer", "1 layer"), (3, "node", "3 nodes"), (2, "process", "2 processes"),
     (2, "micro-batch", "2 micro-batches"), (2, "entry", "2 entries"), (2, "day", "2 days")],
)
def test_count(number, noun, expected):
    assert count(number, noun) == expected
