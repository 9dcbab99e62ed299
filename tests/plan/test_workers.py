"""Sharing units of work between forked processes: every unit once, in order, whoever computed it."""

from __future__ import annotations

import os

import pytest

from pipectl.errors import UserInputError
from pipectl.plan import workers
from pipectl.plan.workers import available_workers, share


def _results(outcomes, decode=lambda remote: remote):
    return [outcome.local if outcome.local is not None else decode(outcome.remote) for outcome in outcomes]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_every_unit_is_computed_once_and_returned_in_order(count):
    units = list(range(9))
    weights = [5, 1, 9, 2, 2, 7, 1, 3, 4]
    outcomes = share(units, weights, lambda u: ("here", u * u), lambda u: ("child", u * u, os.getpid()), workers=count)
    results = _results(outcomes)
    assert [r[1] for r in results] == [u * u for u in units]
    pids = {r[2] for r in results if r[0] == "child"}
    assert os.getpid() not in pids
    if count == 1:
        assert all(r[0] == "here" for r in results)


def test_two_processes_both_take_units(tmp_path):
    import time

    parent_took, child_took = tmp_path / "parent-took-a-unit", tmp_path / "child-took-a-unit"
    deadline = time.monotonic() + 20  # for the whole test: a process that never takes one fails it

    def took(mine, theirs):
        # Each process's first unit waits (bounded) until the other has taken one too, however late
        # either gets a core: on a busy machine the forked child can otherwise take every unit
        # before this process takes its first (and the other way round).
        mine.touch()
        while not theirs.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    def here(unit):
        took(parent_took, child_took)
        return unit * 3

    def elsewhere(unit):
        took(child_took, parent_took)
        return unit * 3

    outcomes = share(list(range(16)), [1] * 16, here, elsewhere, workers=2)
    assert {outcome.local is not None for outcome in outcomes} == {True, False}
    assert _results(outcomes) == [u * 3 for u in range(16)]


def test_a_failing_child_leaves_its_units_to_this_process():
    def elsewhere(unit):
        raise RuntimeError("child failed")

    outcomes = share(list(range(6)), [1] * 6, lambda u: u + 100, elsewhere, workers=2)
    assert [outcome.local for outcome in outcomes] == [u + 100 for u in range(6)]


def test_a_child_that_dies_leaves_its_units_to_this_process():
    def elsewhere(unit):
        os._exit(3)  # no result, no message: the pipe just closes

    outcomes = share(list(range(6)), [1] * 6, lambda u: -u, elsewhere, workers=2)
    assert [outcome.local for outcome in outcomes] == [-u for u in range(6)]


def test_the_environment_sets_the_number_of_workers(monkeypatch):
    monkeypatch.setenv(workers.WORKERS_ENV, "3")
    assert available_workers() == 3
    monkeypatch.delenv(workers.WORKERS_ENV)
    assert 1 <= available_workers() <= workers.MOST_AUTOMATIC_WORKERS
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv(workers.WORKERS_ENV, bad)
        with pytest.raises(UserInputError, match=workers.WORKERS_ENV):
            available_workers()


def test_an_error_here_ends_the_children():
    import multiprocessing

    def here(unit):  # whichever unit this process takes first: a fixed one could go to a child
        raise ValueError("bad unit")

    def elsewhere(unit):  # still busy when this process fails, however late it gets a core
        import time

        time.sleep(5)
        return unit

    with pytest.raises(ValueError, match="bad unit"):
        share(list(range(8)), [1] * 8, here, elsewhere, workers=3)
    assert not multiprocessing.active_children()
