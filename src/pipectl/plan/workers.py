"""Sharing a search's independent units of work between processes.

The planner's enumeration comes in independent units; on a machine with several cores they run
at once. Children are forked (they inherit the inputs: nothing is sent to them); every process,
this one included, takes the next unit not yet taken from one shared counter, heaviest first, until
none is left, so no process idles while another has a queue. A child sends what it computed back
through a pipe. Whatever goes wrong in a child (it raises, dies, or fork is not available here),
this process computes that child's units itself: sharing never changes the answer, only how long
it takes.

    >>> outcomes = share([1, 2, 3], [1, 1, 1], lambda x: x * x, lambda x: -x, workers=1)
    >>> [outcome.local for outcome in outcomes]
    [1, 4, 9]
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
from dataclasses import dataclass
from typing import Any, Callable, Generic, Sequence, TypeVar

from pipectl.cluster import usable_cores
from pipectl.errors import UserInputError

Unit = TypeVar("Unit")
Local = TypeVar("Local")

WORKERS_ENV = "PIPECTL_PLAN_WORKERS"


# The enumeration comes in ~16 units of uneven size: past this many processes its longest unit
# and the serial rest of the search set the time, and more children only cost memory.
MOST_AUTOMATIC_WORKERS = 8


def available_workers() -> int:
    """Processes a search may use: `PIPECTL_PLAN_WORKERS` if set, else the cores this process may
    run on (at most `MOST_AUTOMATIC_WORKERS`)."""
    text = os.environ.get(WORKERS_ENV, "").strip()
    if text:
        try:
            workers = int(text)
        except ValueError:
            workers = 0
        if workers < 1:
            raise UserInputError(f"{WORKERS_ENV}={text!r} is not a positive number of processes")
        return workers
    return min(usable_cores(), MOST_AUTOMATIC_WORKERS)


@dataclass
class Outcome(Generic[Local]):
    """A unit's result: `local` when computed in this process, else `remote` (what a child sent)."""

    local: Local | None = None
    remote: Any = None


def share(
    units: Sequence[Unit],
    weights: Sequence[float],
    here: Callable[[Unit], Local],
    elsewhere: Callable[[Unit], Any],
    *,
    workers: int,
) -> list[Outcome[Local]]:
    """Each unit's outcome, in the units' order: `here(unit)` (never None) for those this process took,
    `elsewhere(unit)` (a picklable result) for those a child took. `weights` order the taking
    (heaviest first, so the last units taken are short and every process ends about together)."""
    order = sorted(range(len(units)), key=lambda i: -weights[i])
    outcomes: list[Outcome[Local] | None] = [None] * len(units)
    children = _start_children(order, units, elsewhere, max(0, min(workers, len(units)) - 1))
    counter = children[0][2] if children else None
    try:
        while True:
            position = _take(counter) if counter is not None else _next_unset(order, outcomes)
            if position is None or position >= len(order):
                break
            index = order[position]
            outcomes[index] = Outcome(local=here(units[index]))
        for process, receive, _ in children:
            for index, result in _collect(process, receive).items():
                outcomes[index] = Outcome(remote=result)
    finally:  # this process failed (or was interrupted): no child outlives it
        for process, _, _ in children:
            if process.is_alive():
                process.terminate()
                process.join()
    for index, outcome in enumerate(outcomes):
        if outcome is None:  # a child failed: its units are computed here
            outcomes[index] = Outcome(local=here(units[index]))
    return outcomes  # type: ignore[return-value]


def _next_unset(order: list[int], outcomes: list) -> int | None:
    return next((position for position, index in enumerate(order) if outcomes[index] is None), None)


def _take(counter: Any) -> int:
    with counter.get_lock():
        position = counter.value
        counter.value += 1
    return position


def _start_children(order, units, elsewhere, count: int) -> list[tuple[Any, Any, Any]]:
    if count == 0:
        return []
    try:
        context = multiprocessing.get_context("fork")
        counter = context.Value("i", 0)
    except (ValueError, OSError):  # no fork on this platform
        return []
    children = []
    for _ in range(count):
        try:
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(order, units, elsewhere, counter, send), daemon=True)
            process.start()
        except (OSError, AssertionError):  # no processes left, or this process is a daemon
            break
        send.close()
        children.append((process, receive, counter))
    return children


def _child(order, units, elsewhere, counter, send) -> None:
    # Ctrl-C reaches the whole process group: the parent handles it (and ends its children).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    results: dict[int, Any] = {}
    try:
        while (position := _take(counter)) < len(order):
            results[order[position]] = elsewhere(units[order[position]])
        payload = pickle.dumps(("ok", results), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:  # the parent computes the units itself (and so raises the same error there)
        payload = pickle.dumps(("failed", None))
    try:
        send.send_bytes(payload)
        send.close()
    except OSError:  # the parent has gone
        pass


def _collect(process: Any, receive: Any) -> dict[int, Any]:
    try:
        status, results = pickle.loads(receive.recv_bytes())
    except (EOFError, OSError, pickle.UnpicklingError):
        status, results = "failed", None
    finally:
        receive.close()
        process.join()
    return results if status == "ok" else {}
