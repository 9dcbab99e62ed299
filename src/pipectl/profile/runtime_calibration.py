"""Measure what a real training step pays besides the layers' compute: the profile's `RuntimeCosts`.

The layer profiler (`measure`) times each layer alone. A real step also runs the training engine
(DeepSpeed's pipeline engine with pipectl's schedule executor): per micro-batch it loads the batch,
clones the stage input, dispatches the forward and backward instructions and keeps the loss; per
step it reduces the gradients (ZeRO-1 flattens them even on one rank), clips them, runs AdamW over
every parameter and copies the result back, and aggregates the loss. On a small model these cost
as much as the compute.

Varuna §4's answer is a one-off, scale-invariant calibration; here it is one rank, two models:

    near-free model (one 1 x 1 linear layer)  -> per-micro-batch forward / backward overhead,
                                                 per-step fixed cost (nothing else to pay for)
    the profiled model, at each profiled b    -> per-step cost per parameter held (the slope
                                                 between the two models' end-of-step times), and
                                                 the ratio of the engine's compute to the sum of
                                                 the profiled layers (layers run colder in a real
                                                 step than alone in a loop)

Every term is per micro-batch per stage, per step per rank or per parameter, so `plan.costs` can
evaluate it for any pipeline/data-parallel layout (p2p bandwidth and all-reduce figures come from
the link calibration).

One more term needs two ranks, the *busy handoff*, with how much of a core a rank gets alone and
next to another (`host_sharing`). The engine runs in child processes (`engine_timing`).

Example (the figures depend on the host and on how busy it is; `pipectl profile show` prints them):

    profile = profile_model(build_model("gpt-tiny"), [1, 2, 4, 8])
    profile.runtime.forward_overhead_seconds      # per micro-batch and stage
    profile.runtime.step_fixed_seconds            # per step and rank
    profile.runtime.step_seconds_per_parameter    # the optimizer step, per parameter held
    profile.runtime.busy_handoff_seconds          # one blocking message after both ranks computed
    profile.runtime.alone_compute_slowdown        # wall / CPU time, one rank
    profile.runtime.concurrent_compute_slowdown   # wall / CPU time, two ranks at once
"""

from __future__ import annotations

import statistics
from importlib.metadata import PackageNotFoundError, version
from typing import Sequence


from pipectl.artifacts.profile import EngineComputeRatio, ModelProfile, RuntimeCosts
from pipectl.artifacts.run import Precision
from pipectl.cluster import usable_cores
from pipectl.models.base import ModelLayers
from pipectl.profile.engine_timing import EngineTimings, run_engine_calibration, run_engine_pair_calibration
from pipectl.profile.host_sharing import measure_host_sharing, model_compute
# The smallest share of a profiled layer sum the engine's compute may be credited with (a noisy
# run must not turn into a negative or near-zero compute time).
MINIMUM_COMPUTE_RATIO = 0.5
CUDA_TWO_RANK_NOTE = (
    "two-rank terms (busy handoff, compute slowdowns, busy all-reduce) not measured on CUDA: they describe "
    "ranks sharing a CPU host; GPU ranks get all-reduce costs from the link calibration"
)


def engine_description(device: str = "cpu", precision: Precision = Precision.FP32) -> str:
    """What was calibrated (from package metadata: importing DeepSpeed here would cost a second)."""
    try:
        deepspeed_version = version("deepspeed")
    except PackageNotFoundError:  # pragma: no cover - the runtime needs DeepSpeed anyway
        deepspeed_version = "?"
    rank = "one rank" if device.startswith("cpu") else f"one rank on {device}"
    return f"deepspeed {deepspeed_version} pipeline engine (pipectl schedule), ZeRO-1, torch AdamW, {precision.value}, {rank}"


def runtime_costs(
    profile: ModelProfile, null_timings: EngineTimings, timings: Sequence[EngineTimings], engine: str
) -> RuntimeCosts:
    """Turn raw engine timings into the profile's scale-invariant terms (see the module docstring).

    Worked example: the near-free model's forward is 0.3 ms per micro-batch and its end of step
    3 ms; the profiled model (318 k parameters) has an end of step of 9 ms, so the slope is
    6 ms / 318 k = 19 ns per parameter; its forward of 5.0 ms at b = 8 over a profiled layer sum
    of 3.7 ms gives a forward ratio of (5.0 - 0.3) / 3.7 = 1.27.
    """
    compute_ratios = []
    for timing in timings:
        layers = [layer.cost(timing.micro_batch_size) for layer in profile.layers]
        forward_sum = sum(cost.forward_seconds for cost in layers)
        backward_sum = sum(cost.backward_seconds for cost in layers)
        forward_ratio = (timing.forward_seconds - null_timings.forward_seconds) / forward_sum if forward_sum else 1.0
        backward_ratio = (
            (timing.backward_seconds - null_timings.backward_seconds) / backward_sum if backward_sum else 1.0
        )
        compute_ratios.append(
            EngineComputeRatio(
                micro_batch_size=timing.micro_batch_size,
                forward_ratio=max(MINIMUM_COMPUTE_RATIO, forward_ratio),
                backward_ratio=max(MINIMUM_COMPUTE_RATIO, backward_ratio),
            )
        )
    parameters = timings[0].parameter_count if timings else 0
    extra_parameters = parameters - null_timings.parameter_count
    extra_seconds = statistics.median(t.step_end_seconds for t in timings) - null_timings.step_end_seconds
    slope = max(0.0, extra_seconds) / extra_parameters if extra_parameters > 0 else 0.0
    return RuntimeCosts(
        engine=engine,
        forward_overhead_seconds=null_timings.forward_seconds,
        backward_overhead_seconds=null_timings.backward_seconds,
        step_fixed_seconds=null_timings.step_end_seconds,
        step_seconds_per_parameter=slope,
        compute_ratios=compute_ratios,
        calibration_parameter_count=parameters,
    )


def calibrate_runtime(
    model: ModelLayers,
    profile: ModelProfile,
    *,
    warmup: int = 3,
    steps: int = 6,
    seed: int = 0,
    timeout_seconds: float = 300.0,
    device: str = "cpu",
    precision: Precision = Precision.FP32,
) -> RuntimeCosts:
    """Run the engine calibration for `model` at the profile's micro-batch sizes: `RuntimeCosts`.

    On `device` 'cuda' or 'cuda:N' only the one-rank terms are measured, on that GPU; the two-rank
    terms keep their "not measured" values (`CUDA_TWO_RANK_NOTE`). `precision` is the engine's (the
    profile's dtype): a bf16 step pays for its fp32 master copy and casts, an fp32 step does not.
    """
    null_timings, timings = run_engine_calibration(
        model, profile.micro_batch_sizes, warmup=warmup, steps=steps, seed=seed, timeout_seconds=timeout_seconds,
        device=device, precision=precision,
    )  # fmt: skip
    costs = runtime_costs(profile, null_timings, timings, engine_description(device, precision))
    if not device.startswith("cpu"):
        return costs
    # The two-rank measurements run the model itself at the middle profiled micro-batch size, and
    # all-reduce a buffer the size of its fp32 gradient (what ZeRO-1's gradient reduction moves).
    sizes = sorted(profile.micro_batch_sizes)
    micro_batch_size = sizes[len(sizes) // 2]
    layer_costs = [layer.cost(micro_batch_size) for layer in profile.layers]
    compute_seconds = sum(c.forward_seconds + c.backward_seconds for c in layer_costs)
    gradient_bytes = 4 * costs.calibration_parameter_count
    sharing = measure_host_sharing(
        model_compute(model, micro_batch_size, seed),
        compute_seconds=compute_seconds,
        gradient_bytes=gradient_bytes,
        timeout_seconds=timeout_seconds,
    )
    single = next(t for t in timings if t.micro_batch_size == micro_batch_size)
    pair = run_engine_pair_calibration(
        model, micro_batch_size, warmup=warmup, steps=steps, seed=seed, timeout_seconds=timeout_seconds,
        precision=precision,
    )
    concurrent = max(sharing.concurrent_compute_slowdown, sharing.alone_compute_slowdown * engine_pair_slowdown(single, pair))
    # Two measurements of the gradient all-reduce after compute: the engine's reduction (which adds
    # ZeRO's own work, but is a difference of two noisy times and can come out near zero) and the
    # plain gradient-sized all-reduce. The slower of the two prices it.
    bandwidths = [
        b for b in (
            engine_allreduce_bandwidth(single, pair, gradient_bytes, sharing.busy_allreduce_latency_seconds),
            sharing.busy_allreduce_bandwidth_bytes_per_second,
        ) if b > 0
    ]  # fmt: skip
    return costs.model_copy(
        update={
            "busy_handoff_seconds": sharing.busy_handoff_seconds,
            "alone_compute_slowdown": sharing.alone_compute_slowdown,
            "concurrent_compute_slowdown": concurrent,
            "concurrent_ranks": sharing.ranks,
            "host_cores": usable_cores(),
            "busy_allreduce_latency_seconds": sharing.busy_allreduce_latency_seconds,
            "busy_allreduce_bandwidth_bytes_per_second": min(bandwidths, default=0.0),
        }
    )


def engine_pair_slowdown(single: EngineTimings, pair: Sequence[EngineTimings]) -> float:
    """Per-micro-batch forward + backward of two data-parallel engine ranks over one rank's, >= 1.

        >>> one = EngineTimings(2, 100, 0.002, 0.004, 0.01, 0.03)
        >>> two = [EngineTimings(2, 100, 0.0025, 0.005, 0.02, 0.04), EngineTimings(2, 100, 0.0025, 0.0049, 0.02, 0.04)]
        >>> round(engine_pair_slowdown(one, two), 4)
        1.2417
    """
    alone = single.forward_seconds + single.backward_seconds
    if alone <= 0 or not pair:
        return 1.0
    together = sum(t.forward_seconds + t.backward_seconds for t in pair) / len(pair)
    return max(1.0, together / alone)


def engine_allreduce_bandwidth(
    single: EngineTimings, pair: Sequence[EngineTimings], gradient_bytes: int, latency_seconds: float
) -> float:
    """Ring bus bandwidth that makes a two-rank all-reduce of the gradient cost what the engine's
    gradient reduction gained going from one rank to two (0 when that gain is within the latency).

    Two ranks: extra = 2 * latency + bytes / bandwidth (`fit_two_rank_ring`).

        >>> one = EngineTimings(2, 100, 0.002, 0.004, 0.01, 0.03, reduce_seconds=0.001)
        >>> two = [EngineTimings(2, 100, 0.002, 0.004, 0.02, 0.04, reduce_seconds=0.006)] * 2
        >>> round(engine_allreduce_bandwidth(one, two, 1_000_000, 0.0005))
        250000000
    """
    if not pair or gradient_bytes <= 0:
        return 0.0
    extra = sum(t.reduce_seconds for t in pair) / len(pair) - single.reduce_seconds - 2 * latency_seconds
    return gradient_bytes / extra if extra > 0 else 0.0


__all__ = [
    "calibrate_runtime",
    "CUDA_TWO_RANK_NOTE",
    "engine_allreduce_bandwidth",
    "engine_pair_slowdown",
    "runtime_costs",
]
