"""What two ranks of one host cost each other: the busy handoff and the compute slowdowns.

One more term needs two ranks: the *busy handoff*. Link calibration times a tight ping-pong, where
both processes spend their time waiting and wake at once (a fraction of a millisecond). In a
pipeline both ranks compute, then one blocks on a message; on a host with more runnable processes
than cores its core goes to another process, and when the message arrives it waits for the
scheduler (milliseconds per message on a host shared with other jobs, the same for a gradient
all-reduce). `measure_host_sharing` reproduces that pattern with two forked ranks:

    rank 0:  compute ~W ------------| send ->
    rank 1:  compute ~W ----------| recv ...........| running again
                                  |<- handoff ----->|   (from both ready; one clock, CLOCK_MONOTONIC)

and, in the same run, how much of a core a rank gets: wall-clock over CPU time of the same compute
on one rank alone and on both ranks at once. The layer profile keeps medians of short runs, which
are close to CPU time; a step lasts long enough to pay for every time slice other jobs take, so
a one-rank step grows with the host's load average.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipectl.models.base import ModelLayers
from pipectl.runtime.engines.loopback import keep_stores_on_loopback
from pipectl.profile.engine_timing import quiet_one_thread, run_two_ranks


# Two-rank host measurement. What each rank computes between messages: one forward and backward of
# the profiled model (`model_compute`). A kernel that stays in a core's own cache (a 64 x 64 matrix
# product) hides how two ranks slow each other down through the shared cache and memory, which a
# model's forward and backward does not.
HOST_WARMUP = 3
HOST_ROUNDS = 30  # messages handed off, and all-reduces timed per size
HOST_MIN_ROUNDS = 8  # when the model's compute is long
HOST_PHASE_SECONDS = 0.4  # compute time per phase (alone, together) and for the messages
HOST_MIN_COMPUTE_ROUNDS = 5
HOST_MAX_COMPUTE_ROUNDS = 100
HOST_MESSAGE_BYTES = 16 * 1024
SMALL_ALLREDUCE_BYTES = 1024
MATRIX_REPEATS = 300  # the stand-in compute without a model: tanh(x @ w) on 64 x 64

ComputeFn = Callable[[], None]


@dataclass(frozen=True)
class HostSharing:
    """What two ranks of this host see of each other (see the module docstring)."""

    busy_handoff_seconds: float
    alone_compute_slowdown: float  # wall / CPU time, one rank computing
    concurrent_compute_slowdown: float  # wall time with both ranks computing / CPU time alone
    busy_allreduce_latency_seconds: float = 0.0  # ring per-hop latency right after computing (0: not measured)
    busy_allreduce_bandwidth_bytes_per_second: float = 0.0  # ring bus bandwidth then (0: not measured)
    ranks: int = 2


class _MatrixCompute:
    """`repeats` products of 64 x 64 matrices; a plain object, so a spawned rank can receive it."""

    def __init__(self, repeats: int) -> None:
        self.repeats = repeats
        self.x0 = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
        self.w = torch.randn(64, 64, generator=torch.Generator().manual_seed(2)) * 0.1

    def __call__(self) -> None:
        x = self.x0
        for _ in range(self.repeats):
            x = torch.tanh(x @ self.w)


def matrix_compute(repeats: int = MATRIX_REPEATS) -> ComputeFn:
    """A model-free stand-in: `repeats` products of 64 x 64 matrices (fits in a core's cache)."""
    return _MatrixCompute(repeats)


class _ModelCompute:
    """One forward and backward of the whole model; the layers are built on the first call, in the
    rank that runs it (never in the profiling process), and kept."""

    def __init__(self, model: ModelLayers, micro_batch_size: int, seed: int) -> None:
        self.model = model
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.modules: list[nn.Module] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "modules": None}  # a rank builds its own

    def __call__(self) -> None:
        model = self.model
        if self.modules is None:
            self.modules = [layer.build() for layer in model.layers]
            self.batch = model.make_batch(self.micro_batch_size, torch.Generator().manual_seed(self.seed))
        x, labels = self.batch
        for layer, module in zip(model.layers, self.modules):
            x = layer.forward(module, x)
        model.loss_fn(x, labels).backward()
        for module in self.modules:
            module.zero_grad(set_to_none=True)


def model_compute(model: ModelLayers, micro_batch_size: int, seed: int = 0) -> ComputeFn:
    """One forward and backward of the whole model at `micro_batch_size` (the layers built once,
    on the first call).

    Tied layers get their own copy of the shared weight: the arithmetic is the same.
    """
    return _ModelCompute(model, micro_batch_size, seed)


@dataclass(frozen=True)
class _HostPlan:
    """How many rounds each phase of the host measurement runs (the same on both ranks)."""

    compute_rounds: int
    message_rounds: int
    gradient_bytes: int


def _host_rank(connection, rank: int, port: int, compute: ComputeFn, plan: _HostPlan) -> None:
    """One of the two ranks: compute alone (rank 0), compute together, hand messages off, all-reduce."""
    quiet_one_thread()
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        keep_stores_on_loopback()  # rank 0's store serves 127.0.0.1 only
        dist.init_process_group("gloo", rank=rank, world_size=2)
        alone: list[tuple[float, float]] = []  # (wall, CPU) seconds per round
        together: list[tuple[float, float]] = []
        handoffs: list[tuple[float, float]] = []  # (ready, done) per message
        reduces: dict[int, list[tuple[float, float]]] = {}  # bytes -> (arrived, done) per all-reduce
        if rank == 0:  # rank 1 sleeps in the barrier meanwhile
            for attempt in range(HOST_WARMUP + plan.compute_rounds):
                start, cpu_start = time.perf_counter(), time.thread_time()
                compute()
                if attempt >= HOST_WARMUP:
                    alone.append((time.perf_counter() - start, time.thread_time() - cpu_start))
        dist.barrier()
        for attempt in range(HOST_WARMUP + plan.compute_rounds):
            start, cpu_start = time.perf_counter(), time.thread_time()
            compute()
            if attempt >= HOST_WARMUP:
                together.append((time.perf_counter() - start, time.thread_time() - cpu_start))
        dist.barrier()
        message = torch.zeros(HOST_MESSAGE_BYTES // 4)
        for attempt in range(HOST_WARMUP + plan.message_rounds):
            compute()
            ready = time.perf_counter()
            if rank == 0:
                dist.send(message, 1)
            else:
                dist.recv(message, 0)
            if attempt >= HOST_WARMUP:
                handoffs.append((ready, time.perf_counter()))
            dist.barrier()
        sizes = [SMALL_ALLREDUCE_BYTES] + ([plan.gradient_bytes] if plan.gradient_bytes > SMALL_ALLREDUCE_BYTES else [])
        for size in sizes:
            buffer = torch.ones(size // 4)
            timed = reduces.setdefault(size, [])
            for attempt in range(HOST_WARMUP + plan.message_rounds):
                compute()
                arrived = time.perf_counter()
                dist.all_reduce(buffer)
                if attempt >= HOST_WARMUP:
                    timed.append((arrived, time.perf_counter()))
                dist.barrier()
        dist.destroy_process_group()
        connection.send(("ok", (alone, together, handoffs, reduces)))
    except BaseException as exc:
        connection.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        connection.close()


def trimmed_mean(values: Sequence[float], cut: float = 0.1) -> float:
    """Mean of the values without the lowest and highest `cut` fraction (one stall must not rule).

    A step pays the sum of many handoffs, so their mean (not median) is what it adds up to.

        >>> trimmed_mean([1.0, 2.0, 3.0, 4.0, 100.0, 0.0, 2.0, 3.0, 2.0, 3.0])
        2.5
    """
    ordered = sorted(values)
    drop = int(len(ordered) * cut)
    kept = ordered[drop : len(ordered) - drop] or ordered
    return sum(kept) / len(kept)


def host_plan(compute_seconds: float, gradient_bytes: int) -> _HostPlan:
    """Round counts for a compute of about `compute_seconds`: each phase about HOST_PHASE_SECONDS.

        >>> host_plan(0.0025, 0), host_plan(0.2, 0).compute_rounds
        (_HostPlan(compute_rounds=100, message_rounds=30, gradient_bytes=0), 5)
    """
    per_phase = HOST_PHASE_SECONDS / max(compute_seconds, 1e-6)
    return _HostPlan(
        compute_rounds=int(min(HOST_MAX_COMPUTE_ROUNDS, max(HOST_MIN_COMPUTE_ROUNDS, per_phase))),
        message_rounds=int(min(HOST_ROUNDS, max(HOST_MIN_ROUNDS, per_phase))),
        gradient_bytes=max(0, int(gradient_bytes)),
    )


def measure_host_sharing(
    compute: ComputeFn | None = None,
    *,
    compute_seconds: float = 0.0025,
    gradient_bytes: int = 0,
    rounds: int | None = None,
    timeout_seconds: float = 60.0,
    start: str | None = None,
) -> HostSharing:
    """Two forked ranks (gloo on 127.0.0.1, one thread each) measure how they share this host.

    `compute` is what each rank runs between messages (default: `matrix_compute()`; the
    calibration passes `model_compute` of the profiled model), `compute_seconds` about how long
    it takes on one core (sets the round counts), `gradient_bytes` the size of the gradient
    all-reduce to time besides a small one (0: only the small one). `rounds` overrides the number
    of messages and all-reduces timed per size.

    - compute slowdowns: rank 0 computes alone (rank 1 sleeps), then both at once. Alone:
      wall-clock over CPU time (`time.thread_time`), what other jobs take of the core. Together:
      wall-clock over the CPU time alone, which adds what the two ranks take from each other;
    - busy handoff: after both computed, rank 0 sends a small message to rank 1; from both being
      ready (the later of the two) to rank 1 running again, trimmed mean;
    - busy all-reduce: after both computed, an all-reduce, from both having arrived to both
      done (trimmed mean per size), fitted to the two-rank ring 2 * (alpha + bytes / 2 / bw).

    `start`: how the two ranks start, 'fork' or 'spawn' (None: `start_method()`). Raises
    `LaunchError` if a rank fails or runs past `timeout_seconds`.
    """
    plan = host_plan(compute_seconds, gradient_bytes)
    if rounds is not None:
        plan = _HostPlan(plan.compute_rounds, rounds, plan.gradient_bytes)
    work = compute if compute is not None else matrix_compute()
    results = run_two_ranks(_host_rank, (work, plan), "host measurement", timeout_seconds, start)
    (alone, together_0, sent, reduces_0), (_, together_1, received, reduces_1) = results
    handoffs = [
        max(0.0, done - max(send_ready, receive_ready))
        for (send_ready, _), (receive_ready, done) in zip(sent, received)
    ]
    reduce_seconds = {
        size: trimmed_mean(
            [max(0.0, max(d0, d1) - max(a0, a1)) for (a0, d0), (a1, d1) in zip(reduces_0[size], reduces_1[size])]
        )
        for size in reduces_0
    }
    latency, bandwidth = fit_two_rank_ring(reduce_seconds)
    alone_cpu = sum(cpu for _, cpu in alone) / len(alone) if alone else 0.0
    both = together_0 + together_1
    together_wall = sum(wall for wall, _ in both) / len(both) if both else 0.0
    return HostSharing(
        busy_handoff_seconds=trimmed_mean(handoffs),
        alone_compute_slowdown=wall_over_cpu(alone),
        concurrent_compute_slowdown=max(1.0, together_wall / alone_cpu) if alone_cpu > 0 else wall_over_cpu(both),
        busy_allreduce_latency_seconds=latency,
        busy_allreduce_bandwidth_bytes_per_second=bandwidth,
    )


def fit_two_rank_ring(seconds_by_bytes: dict[int, float]) -> tuple[float, float]:
    """(per-hop latency, bus bandwidth) of the ring model from two-rank all-reduce times.

    Two ranks: time = 2 * (latency + bytes / 2 / bandwidth) = 2 * latency + bytes / bandwidth
    (`LinkCost.ring_allreduce_seconds` with D = 2). The smallest size gives the latency, the
    slope to the largest the bandwidth; one size gives the latency only (bandwidth 0: unknown).

        >>> latency, bandwidth = fit_two_rank_ring({1024: 0.0004, 1_001_024: 0.0024})
        >>> latency, round(bandwidth)
        (0.0002, 500000000)
    """
    sizes = sorted(seconds_by_bytes)
    if not sizes:
        return 0.0, 0.0
    small = sizes[0]
    latency = seconds_by_bytes[small] / 2
    if len(sizes) < 2:
        return latency, 0.0
    large = sizes[-1]
    extra = seconds_by_bytes[large] - seconds_by_bytes[small]
    bandwidth = (large - small) / extra if extra > 0 else large / max(seconds_by_bytes[large], 1e-12)
    return latency, bandwidth


def wall_over_cpu(rounds: Sequence[tuple[float, float]]) -> float:
    """Total wall-clock / total CPU seconds of (wall, CPU) rounds, at least 1.

    Totals, not a typical round: a step pays for every time slice another job takes, so the rare
    preempted rounds count in full (a trimmed mean would drop exactly them).

        >>> wall_over_cpu([(0.003, 0.002), (0.002, 0.002)])
        1.25
    """
    cpu = sum(c for _, c in rounds)
    return max(1.0, sum(w for w, _ in rounds) / cpu) if cpu > 0 else 1.0


__all__ = [
    "fit_two_rank_ring",
    "host_plan",
    "HostSharing",
    "matrix_compute",
    "measure_host_sharing",
    "model_compute",
    "trimmed_mean",
    "wall_over_cpu",
]
