"""engine_state's pure helpers (the capture and restore of a live engine are exercised by every
checkpoint, resume and resize test)."""

from __future__ import annotations

import doctest

import pipectl.runtime.checkpoint.engine_state
from pipectl.runtime.checkpoint.engine_state import uncovered


def test_doctests():
    assert doctest.testmod(pipectl.runtime.checkpoint.engine_state).failed == 0


def test_the_runs_no_piece_covers_are_what_a_restore_zeroes():
    assert uncovered([], 5) == [(0, 5)]
    assert uncovered([(0, 3), (3, 2)], 5) == []
    assert uncovered([(2, 2)], 4) == [(0, 2)]
