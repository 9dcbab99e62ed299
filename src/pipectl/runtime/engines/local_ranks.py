"""Local ranks for tests and measurements: not a launch engine.

The launch engines (torchrun, DeepSpeed's launcher, Slurm) live in `pipectl.launch`. Tests and
benchmarks that only need a few gloo ranks on this host start them from a fork server that has
imported torch (and whatever `preload` names) once, so that each rank starts in well under a
second, where a fresh interpreter re-imports them (about 3 s per rank on two cores).
"""

from __future__ import annotations

import multiprocessing
import queue
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from pipectl.errors import LaunchError


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (the ranks' rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_local_ranks(
    target: Callable[..., None],
    args: Sequence[Any],
    world: int,
    *,
    preload: Sequence[str],
    timeout_seconds: float,
    what: str,
) -> dict[int, Any]:
    """Run `target(rank, world, port, *args, results)` in `world` processes and return what each
    rank put on `results` as `(rank, value)`, by rank. A rank that fails puts an exception instead,
    raised here as a `LaunchError`; ranks still running after `timeout_seconds` are killed and a
    `LaunchError` names `what` did not finish."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    port = free_port()
    results = context.Queue()
    procs = [context.Process(target=target, args=(rank, world, port, *args, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    outcomes: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_seconds
    try:
        while len(outcomes) < world:
            try:
                item = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise LaunchError(f"{what}: ranks did not finish within {timeout_seconds} s") from None
            if isinstance(item, BaseException):
                raise LaunchError(str(item))
            rank, value = item
            outcomes[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(outcomes) == world else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return outcomes
