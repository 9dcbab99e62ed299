"""The training engine timed in child processes: one rank (a near-free model and the profiled one)
or two data-parallel ranks at once, as `runtime_calibration` needs them.

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
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from pipectl.artifacts.plan import Candidate
from pipectl.artifacts.run import Precision
from pipectl.errors import LaunchError
from pipectl.models.base import LayerDef, ModelLayers
from pipectl.runtime.engines import dsinit
from pipectl.runtime.engines.dsconfig import deepspeed_config
from pipectl.runtime.engines.dsinit import free_port
from pipectl.schedule import ScheduleKind, generate

# Micro-batches per calibration step: two, so that per-micro-batch and per-step costs separate.
CALIBRATION_MICRO_BATCHES = 2


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


def quiet_one_thread() -> None:
    """In a forked measuring child: silence its output (DeepSpeed prints; the parent may be
    printing JSON) and compute on one thread, as a launched rank does."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _child(connection, model: ModelLayers, sizes: list[int], warmup: int, steps: int, seed: int,
           precision: Precision) -> None:
    quiet_one_thread()
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
    quiet_one_thread()
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
    host cost each other (compute per micro-batch, which two plain loops of the same forward and
    backward in two processes do not show) and what the
    gradient all-reduce of ZeRO-1's reduction costs after compute. Raises `LaunchError` on failure.
    """
    return run_two_ranks(
        _pair_child, (model, micro_batch_size, warmup, steps, seed, precision), "two-rank engine calibration",
        timeout_seconds,
    )


def run_two_ranks(target, args: tuple, what: str, timeout_seconds: float, start: str | None = None) -> list:
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


__all__ = [
    "child_environment",
    "EngineTimings",
    "measure_engine",
    "null_model",
    "run_engine_calibration",
    "run_engine_pair_calibration",
    "start_method",
]
