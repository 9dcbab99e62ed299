"""Measure what a real training step pays besides the layers' compute: the profile's `RuntimeCosts`.

The layer profiler (`measure`) times each layer alone. A real step also runs the training engine
(DeepSpeed's pipeline engine with pipectl's schedule executor): per micro-batch it loads the batch,
clones the stage input, dispatches the forward and backward instructions and keeps the loss; per
step it reduces the gradients (ZeRO-1 flattens them even on one rank), clips them, runs AdamW over
every parameter and copies the result back, and aggregates the loss. On a small model these cost
as much as the compute (gpt-tiny, one CPU rank, b = 8, m = 2: 35 ms measured, 20 ms of layer time).

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

The engine runs in a child process, with its output silenced, one thread, a world of one (gloo on
127.0.0.1 on CPU, NCCL on CUDA); the profiling process itself never starts torch.distributed.
Children are forked on a host without CUDA (torch is already imported, so one starts in about a
second) and spawned on a host with CUDA (`start_method`). CPU children are pinned to the CPU
(`CUDA_VISIBLE_DEVICES=""`, `DS_ACCELERATOR=cpu` in their environment), so the same calibration
runs on CPU ranks whatever the host has. On CUDA (`calibrate_runtime(device="cuda:N")`) the
one-rank engine terms are measured on that GPU; the two-rank terms describe ranks sharing a CPU
host (its cores, caches and scheduler) and are not measured there (`CUDA_TWO_RANK_NOTE`). The configuration is the one `pipectl
launch` writes (`runtime.engines.dsconfig.deepspeed_config`: ZeRO-1, torch AdamW, gradient clipping), in the
profile's precision (a bf16 profile runs DeepSpeed's bf16 engine).
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

import contextlib
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipectl.artifacts.plan import Candidate
from pipectl.artifacts.profile import EngineComputeRatio, ModelProfile, RuntimeCosts
from pipectl.artifacts.run import Precision
from pipectl.cluster import usable_cores
from pipectl.errors import LaunchError
from pipectl.models.base import LayerDef, ModelLayers
from pipectl.runtime.engines import dsinit
from pipectl.runtime.engines.dsconfig import deepspeed_config
from pipectl.runtime.engines.loopback import keep_stores_on_loopback
from pipectl.runtime.engines.dsinit import free_port
from pipectl.schedule import ScheduleKind, generate

# Micro-batches per calibration step: two, so that per-micro-batch and per-step costs separate.
CALIBRATION_MICRO_BATCHES = 2
# The smallest share of a profiled layer sum the engine's compute may be credited with (a noisy
# run must not turn into a negative or near-zero compute time).
MINIMUM_COMPUTE_RATIO = 0.5
CUDA_TWO_RANK_NOTE = (
    "two-rank terms (busy handoff, compute slowdowns, busy all-reduce) not measured on CUDA: they describe "
    "ranks sharing a CPU host; GPU ranks get all-reduce costs from the link calibration"
)


def start_method() -> str:
    """'fork' on a host without CUDA (fast: torch is already imported), else 'spawn'.

    A forked child can neither use CUDA that its parent initialised nor run autograd once the
    parent's first backward started autograd's per-device threads, which it does on any host with
    a GPU, even for CPU tensors (PyTorch then refuses: "Unable to handle autograd's threading in
    combination with fork-based multiprocessing").
    """
    return "spawn" if dsinit.cuda_available() else "fork"


def child_environment(device: str = "cpu") -> dict[str, str]:
    """What a calibration child's environment must say for it to run on `device` ('cpu', 'cuda',
    'cuda:N'): CPU children see no GPU and DeepSpeed's CPU accelerator; a CUDA child sees only the
    GPU it measures (as its device 0), with CUDA_VISIBLE_DEVICES's numbering if the parent had one.

        >>> child_environment("cpu")
        {'CUDA_VISIBLE_DEVICES': '', 'DS_ACCELERATOR': 'cpu'}
    """
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    visible = [entry for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    ordinal = int(index or 0)
    return {"CUDA_VISIBLE_DEVICES": visible[ordinal] if visible else str(ordinal), "DS_ACCELERATOR": "cuda"}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ while children start (a forked or spawned child inherits them from
    the start, before it imports anything), the previous values back afterwards."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _synchronize() -> None:
    """Wait for the GPU's queued work, so that a clock reading counts it (a no-op on CPU ranks)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


@dataclass(frozen=True)
class EngineTimings:
    """Medians of one calibration run: one model at one micro-batch size on one rank."""

    micro_batch_size: int
    parameter_count: int
    forward_seconds: float  # per micro-batch: load + forward instruction
    backward_seconds: float  # per micro-batch: backward instruction
    step_end_seconds: float  # per step: the step minus its load/forward/backward instructions
    step_seconds: float
    reduce_seconds: float = 0.0  # per step: the gradient reduction instructions (ReduceGrads, ReduceTiedGrads)


def _null_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.randn(batch_size, 1, generator=generator)
    return inputs, torch.zeros(batch_size, 1)


class _NullLinear(nn.Linear):
    """A 1 x 1 linear layer that takes its fp32 input in its own dtype (a bf16 engine casts the
    layer, not the batch)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


def _null_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output.float(), target)


def null_model() -> ModelLayers:
    """A model whose one layer costs next to nothing: what is left of a step is the engine's own."""
    return ModelLayers(
        name="null",
        layers=[LayerDef(name="null", kind="null", module_cls=_NullLinear, args=(1, 1))],
        make_batch=_null_batch,
        loss_fn=_null_loss,
    )


def _one_rank_config(
    model: ModelLayers, micro_batch_size: int, data_parallel: int = 1, precision: Precision = Precision.FP32
) -> dict[str, Any]:
    """The DeepSpeed config `pipectl launch` would write for this model on one rank (one stage,
    `data_parallel` replicas) in `precision`."""
    # Only the fields `deepspeed_config` reads; a full Candidate would need predicted figures.
    candidate = Candidate.model_construct(
        micro_batch_size=micro_batch_size,
        micro_batches=CALIBRATION_MICRO_BATCHES,
        data_parallel=data_parallel,
        pipeline_parallel=1,
        zero_stage=0,
        stage_layers=[(0, len(model.layers))],
    )
    return deepspeed_config(candidate, precision=precision)


def _timed_engine_class():
    """`PlannedPipelineEngine` whose instructions add their wall-clock seconds to `instruction_seconds`."""
    from pipectl.runtime.engines.executor import PlannedPipelineEngine  # DeepSpeed: in the calibrating child only

    def timed(name: str, handler):
        def run(self, *args, **kwargs):
            _synchronize()
            start = time.perf_counter()
            try:
                return handler(self, *args, **kwargs)
            finally:
                _synchronize()
                seconds = self.instruction_seconds
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

        return run

    class TimedEngine(PlannedPipelineEngine):
        instruction_seconds: dict[str, float]
        _INSTRUCTION_MAP = {
            kind: timed(kind.__name__, handler) for kind, handler in PlannedPipelineEngine._INSTRUCTION_MAP.items()
        }

    return TimedEngine


def _engine(model: ModelLayers, micro_batch_size: int, data_parallel: int = 1, precision: Precision = Precision.FP32):
    # DeepSpeed: imported in the calibrating child, after dsinit has set its environment.
    import deepspeed
    from pipectl.runtime.engines.executor import plan_engine
    from pipectl.runtime.engines.pipeline import build_pipeline_module, planned_topology

    module = build_pipeline_module(model, [(0, len(model.layers))], topology=planned_topology(1, data_parallel))
    engine, *_ = deepspeed.initialize(
        model=module,
        config=_one_rank_config(model, micro_batch_size, data_parallel, precision),
        model_parameters=[p for p in module.parameters() if p.requires_grad],
    )
    engine = plan_engine(engine, generate(ScheduleKind.ONE_F_ONE_B, 1, CALIBRATION_MICRO_BATCHES))
    engine.__class__ = _timed_engine_class()
    parameters = sum(p.numel() for p in module.parameters())
    return engine, parameters


def _time_steps(engine, model: ModelLayers, micro_batch_size: int, parameters: int, warmup: int, steps: int,
                seed: int) -> EngineTimings:
    generator = torch.Generator().manual_seed(seed + micro_batch_size)
    batches = [model.make_batch(micro_batch_size, generator) for _ in range(CALIBRATION_MICRO_BATCHES)]
    forward, backward, step_end, step_seconds, reduce = [], [], [], [], []
    for attempt in range(warmup + steps):
        engine.instruction_seconds = {}
        _synchronize()
        start = time.perf_counter()
        engine.train_step(batches)
        _synchronize()
        elapsed = time.perf_counter() - start
        if attempt < warmup:
            continue
        seconds = engine.instruction_seconds
        load_and_forward = seconds.get("LoadMicroBatch", 0.0) + seconds.get("ForwardPass", 0.0)
        backward_total = seconds.get("BackwardPass", 0.0)
        forward.append(load_and_forward / CALIBRATION_MICRO_BATCHES)
        backward.append(backward_total / CALIBRATION_MICRO_BATCHES)
        step_end.append(max(0.0, elapsed - load_and_forward - backward_total))
        step_seconds.append(elapsed)
        reduce.append(seconds.get("ReduceGrads", 0.0) + seconds.get("ReduceTiedGrads", 0.0))
    return EngineTimings(
        micro_batch_size=micro_batch_size,
        parameter_count=parameters,
        forward_seconds=statistics.median(forward),
        backward_seconds=statistics.median(backward),
        step_end_seconds=statistics.median(step_end),
        step_seconds=statistics.median(step_seconds),
        reduce_seconds=statistics.median(reduce),
    )


def measure_engine(
    model: ModelLayers,
    micro_batch_sizes: Sequence[int],
    *,
    warmup: int = 3,
    steps: int = 6,
    seed: int = 0,
    precision: Precision = Precision.FP32,
) -> tuple[EngineTimings, list[EngineTimings]]:
    """(near-free model, `model` at each size): engine timings on one rank, in THIS process, in
    the engine's `precision` (a bf16 profile is calibrated on DeepSpeed's bf16 engine).

    The sizes run smallest first; one that runs out of GPU memory ends the list there (the planner
    takes the largest measured size's ratios beyond it), unless it is the first.

    torch.distributed must not be initialised yet; it is started here with a world of one (the
    caller runs this in a child process: see `calibrate_runtime`).
    """
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    dsinit.init_distributed()
    null = null_model()
    engine, parameters = _engine(null, 1, precision=precision)
    null_timings = _time_steps(engine, null, 1, parameters, warmup + 2, steps, seed)
    sizes = sorted(micro_batch_sizes)
    engine, parameters = _engine(model, sizes[0], precision=precision)
    timings = []
    for b in sizes:
        try:
            timings.append(_time_steps(engine, model, b, parameters, warmup, steps, seed))
        except torch.cuda.OutOfMemoryError:
            if not timings:
                raise
            break
    return null_timings, timings


def _quiet_one_thread() -> None:
    """In a forked measuring child: silence its output (DeepSpeed prints; the parent may be
    printing JSON) and compute on one thread, as a launched rank does."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _child(connection, model: ModelLayers, sizes: list[int], warmup: int, steps: int, seed: int,
           precision: Precision) -> None:
    _quiet_one_thread()
    try:
        connection.send(("ok", measure_engine(model, sizes, warmup=warmup, steps=steps, seed=seed, precision=precision)))
    except BaseException as exc:  # report to the parent instead of dying silently
        connection.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        connection.close()


def run_engine_calibration(
    model: ModelLayers,
    micro_batch_sizes: Sequence[int],
    *,
    warmup: int = 3,
    steps: int = 6,
    seed: int = 0,
    timeout_seconds: float = 300.0,
    device: str = "cpu",
    start: str | None = None,
    precision: Precision = Precision.FP32,
) -> tuple[EngineTimings, list[EngineTimings]]:
    """`measure_engine` in a child process on `device` ('cpu', 'cuda', 'cuda:N'), started by `start`
    ('fork' or 'spawn'; None: `start_method()`); raises `LaunchError` if it fails or runs past the limit."""
    context = multiprocessing.get_context(start or start_method())
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(
        target=_child, args=(sender, model, list(micro_batch_sizes), warmup, steps, seed, precision)
    )
    with _environment(child_environment(device)):
        child.start()
    sender.close()
    try:
        if not receiver.poll(timeout_seconds):
            raise LaunchError(f"engine calibration did not finish within {timeout_seconds:.0f} s")
        status, payload = receiver.recv()
    except EOFError:
        raise LaunchError(f"engine calibration process exited with code {child.exitcode}") from None
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join(timeout=5)
        receiver.close()
    if status != "ok":
        raise LaunchError(f"engine calibration failed: {payload}")
    return payload


def _pair_child(connection, rank: int, port: int, model: ModelLayers, micro_batch_size: int, warmup: int,
                steps: int, seed: int, precision: Precision = Precision.FP32) -> None:
    """One of two data-parallel engine ranks (see `run_engine_pair_calibration`)."""
    _quiet_one_thread()
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
        )
        dsinit.init_distributed()
        engine, parameters = _engine(model, micro_batch_size, data_parallel=2, precision=precision)
        timings = _time_steps(engine, model, micro_batch_size, parameters, warmup, steps, seed + rank)
        connection.send(("ok", timings))
    except BaseException as exc:
        connection.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        connection.close()


def run_engine_pair_calibration(
    model: ModelLayers, micro_batch_size: int, *, warmup: int = 3, steps: int = 6, seed: int = 0,
    timeout_seconds: float = 300.0, precision: Precision = Precision.FP32,
) -> list[EngineTimings]:
    """The engine on two data-parallel ranks of this host at once (p = 1, d = 2), one timing per rank.

    Compared with the one-rank run at the same micro-batch size it gives what two ranks of a
    host cost each other (compute per micro-batch: measured 25-40 % slower on gpt-tiny here, where
    two plain loops of the same forward and backward in two processes showed none) and what the
    gradient all-reduce of ZeRO-1's reduction costs after compute. Raises `LaunchError` on failure.
    """
    return _run_two_ranks(
        _pair_child, (model, micro_batch_size, warmup, steps, seed, precision), "two-rank engine calibration",
        timeout_seconds,
    )


def _run_two_ranks(target, args: tuple, what: str, timeout_seconds: float, start: str | None = None) -> list:
    """Two CPU ranks running `target(connection, rank, port, *args)`; their payloads in rank order.

    Started by `start` ('fork' or 'spawn'; None: `start_method()`), pinned to the CPU
    (`child_environment`). Each rank sends ("ok", payload) or ("error", message) over its pipe.
    Raises `LaunchError` (naming `what`) if a rank fails, dies or runs past `timeout_seconds`;
    never leaves one running.
    """
    context = multiprocessing.get_context(start or start_method())
    port = free_port()
    pipes = [context.Pipe(duplex=False) for _ in range(2)]
    children = [context.Process(target=target, args=(pipes[rank][1], rank, port, *args)) for rank in range(2)]
    with _environment(child_environment("cpu")):
        for child in children:
            child.start()
    results = []
    try:
        for rank, (receiver, sender) in enumerate(pipes):
            sender.close()
            if not receiver.poll(timeout_seconds):
                raise LaunchError(f"{what}: rank {rank} did not finish within {timeout_seconds:.0f} s")
            try:
                status, payload = receiver.recv()
            except EOFError:
                raise LaunchError(f"{what}: rank {rank} exited without a result") from None
            if status != "ok":
                raise LaunchError(f"{what} failed on rank {rank}: {payload}")
            results.append(payload)
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
                child.join(timeout=5)
        for receiver, _ in pipes:
            receiver.close()
    return results


# Two-rank host measurement. What each rank computes between messages: one forward and backward of
# the profiled model (`model_compute`). A kernel that stays in a core's own cache (a 64 x 64 matrix
# product) hides how two ranks slow each other down through the shared cache and memory: measured
# here, two ranks at once made gpt-tiny's forward and backward 20-29 % slower than one rank alone,
# and a 64 x 64 product 0-5 %.
HOST_WARMUP = 3
HOST_ROUNDS = 30  # messages handed off, and all-reduces timed per size
HOST_MIN_ROUNDS = 8  # when the model's compute is long
HOST_PHASE_SECONDS = 0.4  # compute time per phase (alone, together) and for the messages
HOST_MIN_COMPUTE_ROUNDS = 5
HOST_MAX_COMPUTE_ROUNDS = 100
HOST_MESSAGE_BYTES = 16 * 1024
SMALL_ALLREDUCE_BYTES = 1024
MATRIX_REPEATS = 300  # the stand-in compute without a model: tanh(x @ w) on 64 x 64, ~2.5 ms here

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
    _quiet_one_thread()
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
    results = _run_two_ranks(_host_rank, (work, plan), "host measurement", timeout_seconds, start)
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
    "CUDA_TWO_RANK_NOTE",
    "EngineTimings",
    "calibrate_runtime",
    "child_environment",
    "HostSharing",
    "measure_host_sharing",
    "measure_engine",
    "engine_allreduce_bandwidth",
    "engine_pair_slowdown",
    "fit_two_rank_ring",
    "run_engine_pair_calibration",
    "host_plan",
    "matrix_compute",
    "model_compute",
    "null_model",
    "run_engine_calibration",
    "runtime_costs",
    "start_method",
    "trimmed_mean",
    "wall_over_cpu",
]
