"""Calibrate links between real torch.distributed processes: the `LinksProfile` the planner reads.

Varuna §4 calibrates communication once, independently of the job's size: point-to-point time as a
function of bytes, and all-reduce time as a function of bytes and ring size, measured on a few
devices and fitted so that the planner can evaluate any ring size (scale-invariant calibration).
Here:

- p2p: a ping-pong between ranks 0 and 1; one-way time = round trip / 2 (no clock sync needed).
  Fit: time(bytes) = latency + bytes / bandwidth, least squares with latency >= 0 (weighted by
  1/time^2, so every size counts by its relative error). Jitter: the spread of repeated transfers
  of the smaller, latency-bound messages.
- all-reduce over rings of D = 2..N ranks (sub-groups of the spawned world). Fit the ring model
  (Patarasuk & Yuan 2009; Thakur et al. 2005, "Optimization of Collective Communication Operations
  in MPICH"): time(bytes, D) = 2(D-1) * (alpha + bytes / (D * bandwidth)), i.e. 2(D-1) steps, each
  moving bytes/D. The two unknowns (alpha, bandwidth) do not depend on D, so the fit holds for any
  ring size.

All processes run on this machine, so every measurement is of the `intra_node` link class; an
inter-node figure needs processes on two machines (or the catalog's datasheet values).

Processes are spawned with torch.multiprocessing (gloo on CPU, NCCL on GPUs), on 127.0.0.1 and a
free port, one thread each (OMP_NUM_THREADS=1). Every wait is bounded; on error or time-out the
children are terminated.
"""

from __future__ import annotations

import math
import os
import queue
import statistics
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

from pipectl.artifacts.profile import LinkClass, LinkClassFit, LinkSample, LinksProfile
from pipectl.errors import LaunchError, UserInputError
from pipectl.runtime.engines.dsinit import free_port

KIB = 1024
MIB = 1024 * KIB
# 1 KiB .. 16 MiB in powers of 4.
DEFAULT_MESSAGE_SIZES = tuple(KIB * 4**i for i in range(8))


@dataclass(frozen=True)
class CalibrationRequest:
    """What to measure. `ranks` processes are started; all-reduce rings use 2..ranks of them."""

    ranks: int = 2
    message_sizes: tuple[int, ...] = DEFAULT_MESSAGE_SIZES
    warmup: int = 3
    repeats: int = 10
    backend: str = "gloo"
    timeout_seconds: float = 120.0


def _spread(times: list[float]) -> float:
    """Robust standard deviation of repeated timings: 1.4826 x the median absolute deviation.

    On a shared machine one descheduled transfer among ten would dominate a plain standard
    deviation; the MAD estimate describes the typical transfer (for normal noise it equals sigma).
    """
    middle = statistics.median(times)
    return 1.4826 * statistics.median(abs(t - middle) for t in times)


def _worker(rank: int, world_size: int, port: int, request: CalibrationRequest, results) -> None:
    """One calibration process. Rank 0 times and reports; every rank takes part in every operation."""
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch  # in the calibrating process, after its OMP_NUM_THREADS is set
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            request.backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=request.timeout_seconds),
        )
        device = torch.device("cpu")
        if request.backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        samples: list[tuple[str, int, int, float]] = []
        for size in request.message_sizes:
            buffer = torch.empty(max(1, size // 4), dtype=torch.float32, device=device)
            times = []
            for attempt in range(request.warmup + request.repeats):
                dist.barrier()
                start = time.perf_counter()
                if rank == 0:
                    dist.send(buffer, dst=1)
                    dist.recv(buffer, src=1)
                elif rank == 1:
                    dist.recv(buffer, src=0)
                    dist.send(buffer, dst=0)
                sync()
                if attempt >= request.warmup:
                    times.append((time.perf_counter() - start) / 2)
            samples.append(("p2p", 2, buffer.numel() * 4, statistics.median(times), _spread(times)))

        for ring_size in range(2, world_size + 1):
            members = list(range(ring_size))
            # Every rank must create every group, members or not (torch.distributed rule).
            group = dist.new_group(members) if ring_size < world_size else dist.group.WORLD
            for size in request.message_sizes:
                buffer = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
                times = []
                for attempt in range(request.warmup + request.repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    if rank in members:
                        dist.all_reduce(buffer, group=group)
                        sync()
                    if attempt >= request.warmup:
                        times.append(time.perf_counter() - start)
                samples.append(("allreduce", ring_size, buffer.numel() * 4, statistics.median(times), _spread(times)))
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            results.put(("ok", rank, samples))
    except BaseException:  # report every failure to the parent instead of dying silently
        results.put(("error", rank, traceback.format_exc()))


@dataclass(frozen=True)
class LinkMeasurements:
    """Rank 0's medians, and the spread of the repeats behind each median (same order)."""

    samples: list[LinkSample]
    spreads_seconds: list[float]

    def p2p_jitter_seconds(self) -> float:
        """Jitter of a p2p transfer: the median spread of repeats over the latency-bound half of the
        sweep (the smaller messages), where a transfer's extra delay is not hidden by its size."""
        p2p = sorted(
            (sample.message_bytes, spread)
            for sample, spread in zip(self.samples, self.spreads_seconds)
            if sample.op == "p2p"
        )
        if not p2p:
            return 0.0
        return statistics.median(spread for _, spread in p2p[: max(1, len(p2p) // 2)])


def measure_links(request: CalibrationRequest) -> LinkMeasurements:
    """Spawn `request.ranks` processes, run the sweep, return rank 0's measurements."""
    if request.ranks < 2:
        raise UserInputError(f"link calibration needs at least 2 ranks, got {request.ranks}")
    if not request.message_sizes or min(request.message_sizes) <= 0:
        raise UserInputError(f"message sizes must be positive, got {list(request.message_sizes)}")
    if request.repeats < 1 or request.warmup < 0:
        raise UserInputError(f"need repeats >= 1 and warmup >= 0, got {request.repeats} and {request.warmup}")

    if request.backend not in ("gloo", "nccl"):
        raise UserInputError(f"unknown backend '{request.backend}'", hint="use gloo (CPU) or nccl (GPUs)")
    import torch  # only when calibrating: the CLI starts without it
    import torch.multiprocessing as mp

    if request.backend == "nccl" and torch.cuda.device_count() < request.ranks:
        raise UserInputError(
            f"nccl calibration with {request.ranks} ranks needs {request.ranks} GPUs, "
            f"found {torch.cuda.device_count()}"
        )

    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = []
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # children inherit it before torch is imported there
    try:
        for rank in range(request.ranks):
            process = context.Process(
                target=_worker, args=(rank, request.ranks, port, request, results), daemon=True
            )
            process.start()
            processes.append(process)
        deadline = time.monotonic() + request.timeout_seconds
        while True:
            try:
                status, rank, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise LaunchError(
                        f"link calibration process exited with code {dead[0].exitcode} before reporting"
                    ) from None
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"link calibration did not finish within {request.timeout_seconds:.0f} s"
                    ) from None
                continue
            if status == "error":
                raise LaunchError(f"link calibration failed on rank {rank}:\n{payload}")
            break
        for process in processes:
            process.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = previous
    return LinkMeasurements(
        samples=[
            LinkSample(op=op, link_class=LinkClass.INTRA_NODE, ring_size=ring, message_bytes=nbytes, seconds=seconds)
            for op, ring, nbytes, seconds, _ in payload
        ],
        spreads_seconds=[spread for *_, spread in payload],
    )


@dataclass(frozen=True)
class LineFit:
    """time = intercept + slope * x, with the standard deviation of the residuals."""

    intercept: float
    slope: float
    residual_std: float


def fit_nonnegative_line(
    x: Sequence[float], y: Sequence[float], weights: Sequence[float] | None = None
) -> LineFit:
    """Least squares y = a + b*x with a >= 0 (through the origin when the free fit gives a < 0).

    Each point can be weighted; `fit_latency_bandwidth` weights by 1/y^2 so that small messages
    (latency-bound) count as much as large ones (bandwidth-bound): relative error is minimised.

        >>> fit = fit_nonnegative_line([0, 1, 2], [1, 3, 5])
        >>> round(fit.intercept, 6), round(fit.slope, 6)
        (1.0, 2.0)
    """
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need at least 2 paired points, got {len(x)} x and {len(y)} y")
    w = list(weights) if weights is not None else [1.0] * len(x)
    sw = sum(w)
    mean_x = sum(wi * xi for wi, xi in zip(w, x)) / sw
    mean_y = sum(wi * yi for wi, yi in zip(w, y)) / sw
    sxx = sum(wi * (xi - mean_x) ** 2 for wi, xi in zip(w, x))
    sxy = sum(wi * (xi - mean_x) * (yi - mean_y) for wi, xi, yi in zip(w, x, y))
    slope = sxy / sxx if sxx > 0 else 0.0
    intercept = mean_y - slope * mean_x
    if intercept < 0:
        intercept = 0.0
        sxx0 = sum(wi * xi * xi for wi, xi in zip(w, x))
        slope = sum(wi * xi * yi for wi, xi, yi in zip(w, x, y)) / sxx0 if sxx0 > 0 else 0.0
    residuals = [yi - (intercept + slope * xi) for xi, yi in zip(x, y)]
    residual_std = math.sqrt(sum(r * r for r in residuals) / len(residuals))
    return LineFit(intercept=intercept, slope=slope, residual_std=residual_std)


def _bandwidth(slope: float, x: Sequence[float], y: Sequence[float]) -> float:
    """1 / slope, or the best observed rate when timings show no growth with size (all noise)."""
    if slope > 0:
        return 1.0 / slope
    return max(xi / yi for xi, yi in zip(x, y) if yi > 0)


def fit_link_class(
    samples: Sequence[LinkSample], link_class: LinkClass, p2p_jitter_seconds: float | None = None
) -> LinkClassFit:
    """Fit p2p latency + bytes/bandwidth and the ring all-reduce model from raw samples.

    The all-reduce model time = 2(D-1)(alpha + bytes/(D*bw)) is linear in alpha and 1/bw once both
    sides are divided by 2(D-1): time / (2(D-1)) = alpha + (bytes/D) / bw. So the same line fit
    applies with x = bytes/D and y = time/(2(D-1)), pooling every ring size.

    `p2p_jitter_seconds` is the measured spread of repeated transfers; without it, the standard
    deviation of the p2p medians about the fitted line stands in.

    Example: samples that follow the model exactly give back its parameters.

        >>> alpha, bw = 5e-6, 2e9
        >>> samples = [LinkSample(op="allreduce", link_class=LinkClass.INTRA_NODE, ring_size=d,
        ...            message_bytes=n, seconds=2 * (d - 1) * (alpha + n / (d * bw)))
        ...            for d in (2, 3) for n in (1024, 65536, 1 << 20)]
        >>> samples += [LinkSample(op="p2p", link_class=LinkClass.INTRA_NODE, ring_size=2,
        ...             message_bytes=n, seconds=1e-5 + n / 4e9) for n in (1024, 65536, 1 << 20)]
        >>> fit = fit_link_class(samples, LinkClass.INTRA_NODE)
        >>> round(fit.allreduce_latency_seconds * 1e6, 3), round(fit.allreduce_bandwidth_bytes_per_second / 1e9, 3)
        (5.0, 2.0)
        >>> round(fit.p2p_latency_seconds * 1e6, 3), round(fit.p2p_bandwidth_bytes_per_second / 1e9, 3)
        (10.0, 4.0)
    """
    p2p = [s for s in samples if s.op == "p2p" and s.link_class == link_class]
    ring = [s for s in samples if s.op == "allreduce" and s.link_class == link_class]
    if len({s.message_bytes for s in p2p}) < 2 or len({s.message_bytes for s in ring}) < 2:
        raise UserInputError(
            f"fitting {link_class.value} links needs p2p and all-reduce samples at 2 or more message sizes"
        )
    p2p_x = [float(s.message_bytes) for s in p2p]
    p2p_y = [s.seconds for s in p2p]
    p2p_fit = fit_nonnegative_line(p2p_x, p2p_y, weights=[1.0 / max(t, 1e-12) ** 2 for t in p2p_y])
    ring_x = [s.message_bytes / s.ring_size for s in ring]
    ring_y = [s.seconds / (2 * (s.ring_size - 1)) for s in ring]
    ring_fit = fit_nonnegative_line(ring_x, ring_y, weights=[1.0 / max(t, 1e-12) ** 2 for t in ring_y])
    return LinkClassFit(
        link_class=link_class,
        p2p_latency_seconds=p2p_fit.intercept,
        p2p_bandwidth_bytes_per_second=_bandwidth(p2p_fit.slope, p2p_x, p2p_y),
        p2p_jitter_seconds=p2p_fit.residual_std if p2p_jitter_seconds is None else p2p_jitter_seconds,
        allreduce_latency_seconds=ring_fit.intercept,
        allreduce_bandwidth_bytes_per_second=_bandwidth(ring_fit.slope, ring_x, ring_y),
    )


def calibrate_links(request: CalibrationRequest = CalibrationRequest(), device_name: str = "cpu") -> LinksProfile:
    """Measure and fit: the links.json of this machine.

    `device_name` is the catalog name of the devices linked (`cpu` here). All ranks share this
    machine, so the one fit is of the intra_node class.
    """
    measured = measure_links(request)
    return LinksProfile(
        backend=request.backend,
        device=device_name,
        fits=[fit_link_class(measured.samples, LinkClass.INTRA_NODE, measured.p2p_jitter_seconds())],
        samples=measured.samples,
    )


def predict_p2p_seconds(fit: LinkClassFit, message_bytes: int) -> float:
    """latency + bytes / bandwidth."""
    return fit.p2p_latency_seconds + message_bytes / fit.p2p_bandwidth_bytes_per_second


def predict_allreduce_seconds(fit: LinkClassFit, message_bytes: int, ring_size: int) -> float:
    """Ring all-reduce: 2(D-1)(alpha + bytes/(D*bw)); 0 for a ring of one."""
    if ring_size <= 1:
        return 0.0
    return 2 * (ring_size - 1) * (
        fit.allreduce_latency_seconds + message_bytes / (ring_size * fit.allreduce_bandwidth_bytes_per_second)
    )
