"""Measure a model layer by layer on one device: the `ModelProfile` the planner reads.

The profiler runs the real layers in order, exactly the modules DeepSpeed's pipeline engine will
run (PipeDream §3.1 profiles each layer's forward time, backward time, output size and weight size
the same way; Varuna §4 measures per micro-batch size and discards the first, slower steps):

    tokens -> embed -> block.0 -> ... -> final_norm -> head -> loss
              |<- layer i's output is layer i+1's input (detached, requires_grad) ->|

For every micro-batch size b and every layer l it records

- forward and backward seconds: the median of `repeats` timed runs after `warmup` discarded ones.
  The backward of a layer is autograd's backward from its output with a random upstream gradient of
  the output's shape (what the next stage would send back); the last layer's backward starts from
  the loss, so its cost includes the loss;
- output-activation bytes: numel * element_size of the real output tensor (what crosses a cut);
- saved-for-backward bytes: what autograd keeps for this layer's backward, summed through
  `torch.autograd.graph.saved_tensors_hooks` with storages de-duplicated and parameters left out
  (what recomputation frees);
- peak memory: on CUDA `torch.cuda.max_memory_allocated` around the layer; on CPU an *estimate*,
  parameters + gradients + saved + output bytes, since CPU allocators expose no peak counter.

Tied layers share one module, as DeepSpeed does when they sit on one stage, but each layer is timed
on its own forward. A tied layer that is not the first holder (the output head tied to the input
embedding) is charged the tied tensor it uses (`LayerDef.tied_weight_attr`), and all of it is
reported as shared, so `ModelProfile.parameter_count` counts the table once.

Sizes are tried in ascending order; the first that does not fit (CUDA out of memory, or on CPU a
whole-model estimate above `memory_budget_bytes`) stops the sweep and is recorded.

With `tensor_parallel` degrees t > 1 (`pipectl profile --tensor-parallel 1,2,4,8`) it also measures,
on the same device, the shard one rank of a t-way group holds of each transformer block
(`LayerProfile.shards`): the block rebuilt as a `TensorParallelBlock` of a group that exists only
on paper (`TensorParallelGroup.without_communication`, rank 0), on the same input as the block.
That times compute only, the all-reduces skipped (the planner prices them from the links); it
records what the shard really costs (a small shard is launch-bound, the LayerNorms' inputs stay
whole on every rank) instead of the whole block divided by t. One instance of each distinct block
is measured per t (`identical_layers`), whatever `once` says. Embeddings, the final norm and the
head are replicated on every tensor rank and have no shards.

Then, by default, the training engine itself is calibrated on one rank of the profiled device
(`runtime_calibration`; on CUDA without the two-rank terms, which describe CPU hosts): its
per-micro-batch overheads, its end-of-step cost (fixed and per parameter) and how much slower the
layers run inside a real step than alone. These go into
`ModelProfile.runtime`; the planner adds them to the layer times (`plan.costs`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import psutil
import torch

from pipectl.artifacts.profile import LayerCost, LayerProfile, ModelProfile, ProfileSource, ShardProfile
from pipectl.artifacts.run import Precision
from pipectl.cluster import host_state
from pipectl.errors import PipectlError, UserInputError
from pipectl.models.base import ModelLayers
from pipectl.plan.memory import format_gib
from pipectl.profile.runtime_calibration import CUDA_TWO_RANK_NOTE, calibrate_runtime
from pipectl.models.layer_facts import block_indices, check_tensor_parallel, identical_layers
from pipectl.profile.layer_timing import (
    Clock, LayerRun, ModelUnderTest, input_signature, measure_layer, shard_run, shard_under_test,
    model_code, to_device, untimed_pass,
)

DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4, 8)
# Engine calibration (runtime terms): warm-up and timed steps per micro-batch size.
CALIBRATION_WARMUP = 2
CALIBRATION_STEPS = 5

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ProfileProgress:
    """One finished (layer, micro-batch size) cell of the sweep; `done` of `total` cells."""

    done: int
    total: int
    layer: str
    micro_batch_size: int


ProgressCallback = Callable[[ProfileProgress], None]


def parse_dtype(name: str) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' -> torch dtype; anything else is a user error."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise UserInputError(f"unknown dtype '{name}'", hint=f"choose one of: {', '.join(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in _DTYPES.items() if value == dtype)


def resolve_device(device: str) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N'; CUDA must be present."""
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise UserInputError(f"unknown device '{device}'", hint="use cpu or cuda (or cuda:N)") from None
    if resolved.type not in ("cpu", "cuda"):
        raise UserInputError(f"cannot profile on device '{device}'", hint="use cpu or cuda (or cuda:N)")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UserInputError(
            f"device '{device}' requested but CUDA is not available on this machine",
            hint="profile on cpu, or derive a profile: pipectl profile MODEL --derive --device a100-80gb",
        )
    return resolved


def check_micro_batch_sizes(sizes: Sequence[int]) -> list[int]:
    """Positive, distinct, ascending micro-batch sizes."""
    if not sizes:
        raise UserInputError("no micro-batch sizes given")
    bad = [size for size in sizes if size <= 0]
    if bad:
        raise UserInputError(f"micro-batch sizes must be positive, got {bad[0]}")
    return sorted(set(sizes))


def profile_model(
    model: ModelLayers,
    micro_batch_sizes: Sequence[int] = DEFAULT_MICRO_BATCH_SIZES,
    device: str = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
    progress: ProgressCallback | None = None,
    *,
    memory_budget_bytes: int | None = None,
    cpu_threads: int | None = 1,
    device_name: str | None = None,
    seed: int = 0,
    runtime: bool = True,
    once: bool | None = None,
    tensor_parallel: Sequence[int] = (),
) -> ModelProfile:
    """Measure every layer of `model` at every micro-batch size that fits.

    `memory_budget_bytes` (CPU only) stops the sweep at the first size whose whole-model estimate
    (parameters + gradients + every layer's saved bytes + the last output) exceeds it; None means no
    CPU limit. `cpu_threads` pins torch's intra-op threads while profiling on CPU (1 matches a
    pipeline rank started with OMP_NUM_THREADS=1); None leaves them alone. `device_name` is the
    catalog name written into the profile (default: the torch device type). `runtime` also
    calibrates the training engine on one rank of the device (float32 only; about 3 s for gpt-tiny
    on CPU) and records `ModelProfile.runtime`; a failed calibration is noted, not raised.

    `once` measures one instance of each distinct layer (`identical_layers`, with the same input
    shapes) and gives the identical ones its costs (`LayerProfile.costs_from`; the notes list
    which): a uniform model's blocks are measured once, and only the layers measured are ever
    built. None: on CUDA (where the model may not fit whole), not on CPU. A shape-only model
    (`ModelLayers.shape_only`) can only be profiled this way; its engine calibration, which runs
    the whole model, is skipped with a note.

    `tensor_parallel`: degrees t whose block shards to measure too (t = 1 is the layers
    themselves; module docstring). Every t must divide every block's heads and hidden size.

    Example (gpt-tiny, 9 layers):

        >>> from pipectl.models import build_model
        >>> profile = profile_model(build_model("gpt-tiny"), [1, 2], warmup=1, repeats=3)
        >>> [layer.name for layer in profile.layers][:3], profile.micro_batch_sizes
        (['embed', 'block.0', 'block.1'], [1, 2])
        >>> profile.layers[1].cost(2).output_activation_bytes   # 2 x 32 x 64 float32
        16384
    """
    if warmup < 0:
        raise UserInputError(f"warmup must be >= 0, got {warmup}")
    if repeats < 1:
        raise UserInputError(f"repeats must be >= 1, got {repeats}")
    if memory_budget_bytes is not None and memory_budget_bytes <= 0:
        raise UserInputError(f"memory budget must be positive, got {memory_budget_bytes} bytes")
    sizes = check_micro_batch_sizes(micro_batch_sizes)
    torch_device = resolve_device(device)
    if not model.layers:
        raise UserInputError(f"model '{model.name}' has no layers")
    once = torch_device.type == "cuda" if once is None else once
    shard_degrees = check_tensor_parallel(model, tensor_parallel)
    if model.shape_only and not once:
        raise UserInputError(
            f"model '{model.name}' is shape-only: it is never built whole, so its layers cannot all be measured",
            hint=f"measure one instance of each distinct layer: pipectl profile {model.name} --once; "
            f"or derive its profile: pipectl profile {model.name} --derive --device a100-80gb",
        )

    previous_threads = torch.get_num_threads()
    if torch_device.type == "cpu" and cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            profile = _profile(model, sizes, torch_device, warmup, repeats, dtype, progress,
                               memory_budget_bytes, cpu_threads, device_name, seed, once, shard_degrees)
    finally:
        torch.set_num_threads(previous_threads)
    if runtime:
        profile = with_runtime_costs(profile, model, torch_device, dtype, seed)
    return profile


# The engine precision a profiled dtype trains in (`pipectl launch` runs a plan in its profile's dtype).
_ENGINE_PRECISION = {torch.float32: Precision.FP32, torch.bfloat16: Precision.BF16, torch.float16: Precision.FP16}


def with_runtime_costs(
    profile: ModelProfile, model: ModelLayers, device: torch.device, dtype: torch.dtype, seed: int
) -> ModelProfile:
    """The profile with `runtime` measured (see `runtime_calibration`), or a note saying why not.

    `profile_model(..., runtime=True)` ends with this; `pipectl profile` calls it apart, after the
    layer sweep, so that it can say what the ~15 s it takes on a CPU are spent on."""
    if model.shape_only:
        note = f"runtime terms not measured: model '{model.name}' is shape-only and the engine calibration runs the whole model"
        return profile.model_copy(update={"notes": [*profile.notes, note]})
    precision = _ENGINE_PRECISION.get(dtype)
    if precision is None:
        note = f"runtime terms not measured: no training engine precision for {dtype_name(dtype)}"
        return profile.model_copy(update={"notes": [*profile.notes, note]})
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the layers' memory, cached by this process, back to the GPU for the child
    started = time.perf_counter()
    try:
        costs = calibrate_runtime(model, profile, warmup=CALIBRATION_WARMUP, steps=CALIBRATION_STEPS, seed=seed,
                                  device=str(device), precision=precision)  # fmt: skip
    except PipectlError as exc:
        return profile.model_copy(update={"notes": [*profile.notes, f"runtime terms not measured: {exc.message}"]})
    notes = [
        f"runtime terms: {costs.engine}; one 1x1-layer model and this model at every size, "
        f"{CALIBRATION_STEPS} timed steps of m=2 after {CALIBRATION_WARMUP} warm-up steps, medians "
        f"({time.perf_counter() - started:.1f} s)"
    ]
    calibrated = [ratio.micro_batch_size for ratio in costs.compute_ratios]
    if len(calibrated) < len(profile.micro_batch_sizes):
        notes.append(
            f"engine calibration stopped after micro-batch size {max(calibrated)}: the next ran out of memory "
            "in a whole-model step; larger sizes take its compute ratios"
        )
    if device.type == "cuda":
        notes.append(CUDA_TWO_RANK_NOTE)
    return profile.model_copy(update={"runtime": costs, "notes": [*profile.notes, *notes]})


@dataclass
class _Sweep:
    """What every micro-batch size of one profile shares: the layers and shards under test, the
    clock, the timing settings, and the progress counted over all sizes."""

    model: ModelLayers
    under_test: ModelUnderTest
    shards: dict[int, ModelUnderTest]
    clock: Clock
    device: torch.device
    warmup: int
    repeats: int
    progress: ProgressCallback | None
    total_cells: int
    done: int = 0
    spreads: list[float] = field(default_factory=list)  # how steady the timings were, per layer timed

    def _advance(self, name: str, size: int) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(ProfileProgress(self.done, self.total_cells, name, size))

    def layers_at(self, size: int, runs: dict[int, LayerRun], taken_from: list[int], labels: Any) -> list[LayerCost]:
        """Every layer's costs at `size`; an identical layer takes those of the one it copies."""
        layer_costs: list[LayerCost] = []
        for index, source in enumerate(taken_from):
            if source == index:
                cost = measure_layer(self.under_test, index, labels, self.model.loss_fn, runs[index], size,
                                     self.warmup, self.repeats, self.clock, self.device, self.spreads)  # fmt: skip
            else:
                cost = layer_costs[source]
            layer_costs.append(cost)
            self._advance(self.model.layers[index].name, size)
        return layer_costs

    def shards_at(
        self, size: int, runs: dict[int, LayerRun], taken_from: list[int], labels: Any
    ) -> dict[int, dict[int, LayerCost]]:
        """t -> block -> the costs of one rank's shard at `size`, one measurement per distinct block
        and input shape."""
        by_degree: dict[int, dict[int, LayerCost]] = {}
        for t, shard in self.shards.items():
            measured: dict[tuple, int] = {}
            by_degree[t] = {}
            for index in block_indices(self.model):
                run = runs[taken_from[index]]
                source = measured.setdefault((shard.same_as[index], input_signature(run.layer_input)), index)
                if source == index:
                    on_shard = shard_run(shard, index, run.layer_input)
                    cost = measure_layer(shard, index, labels, self.model.loss_fn, on_shard, size,
                                         self.warmup, self.repeats, self.clock, self.device)  # fmt: skip
                else:
                    cost = by_degree[t][source]
                by_degree[t][index] = cost
                self._advance(f"{self.model.layers[index].name} (t={t} shard)", size)
        return by_degree


def _profile(
    model: ModelLayers,
    sizes: list[int],
    device: torch.device,
    warmup: int,
    repeats: int,
    dtype: torch.dtype,
    progress: ProgressCallback | None,
    memory_budget_bytes: int | None,
    cpu_threads: int | None,
    device_name: str | None,
    seed: int,
    once: bool,
    shard_degrees: Sequence[int] = (),
) -> ModelProfile:
    count = len(model.layers)
    same_as = identical_layers(model) if once else list(range(count))
    under_test = ModelUnderTest(model, device, dtype, same_as)
    sweep = _Sweep(
        model, under_test, {t: shard_under_test(model, t, device, dtype) for t in shard_degrees}, Clock(device),
        device, warmup, repeats, progress, len(sizes) * (count + len(shard_degrees) * len(block_indices(model))),
    )
    costs: list[list[LayerCost]] = [[] for _ in model.layers]
    shard_costs: dict[int, list[list[LayerCost]]] = {t: [[] for _ in model.layers] for t in shard_degrees}
    sources: list[list[int]] = []  # per measured size: the layer each layer's costs come from
    measured_sizes: list[int] = []
    not_fitting: int | None = None
    notes: list[str] = []
    # How busy the host is, before this process adds to it, and how steady its timings are.
    load_before = host_state()

    per_sample = _batch_bytes(model, min(sizes), seed)
    for size in sizes:
        too_large = _beyond_host_memory(per_sample, size)  # before make_batch: it would allocate, then fail or swap
        if too_large is not None:
            not_fitting = size
            notes.append(too_large)
            break
        inputs, labels = _batch(model, size, seed, device, dtype)
        try:
            runs, taken_from = untimed_pass(under_test, inputs, labels, model.loss_fn)
        except torch.cuda.OutOfMemoryError:
            not_fitting = size
            notes.append(f"micro-batch size {size} ran out of CUDA memory; stopped there")
            break
        if device.type == "cpu" and memory_budget_bytes is not None:
            too_large = _over_budget(model, under_test, runs, taken_from, size, memory_budget_bytes)
            if too_large is not None:
                not_fitting = size
                notes.append(too_large)
                break
        try:
            layer_costs = sweep.layers_at(size, runs, taken_from, labels)
            shard_layer_costs = sweep.shards_at(size, runs, taken_from, labels)
        except torch.cuda.OutOfMemoryError:
            not_fitting = size
            notes.append(f"micro-batch size {size} ran out of CUDA memory while timing; stopped there")
            break
        for index, cost in enumerate(layer_costs):
            costs[index].append(cost)
        for t, by_layer in shard_layer_costs.items():
            for index, cost in by_layer.items():
                shard_costs[t][index].append(cost)
        sources.append(taken_from)
        measured_sizes.append(size)

    if not measured_sizes:
        raise UserInputError(
            f"model '{model.name}' does not fit even at micro-batch size {sizes[0]}",
            hint="; ".join(notes) or None,
        )
    # A layer reuses another's costs when it did so at every size (in practice: at all or none).
    costs_from = [
        per_size[0] if len(set(per_size)) == 1 and per_size[0] != index else None
        for index, per_size in enumerate(zip(*sources))
    ]
    if once:
        notes.append(_once_note(model, costs_from))
    notes += _method_notes(device, cpu_threads, warmup, repeats, shard_degrees)
    return ModelProfile(
        model=model.name,
        source=ProfileSource.MEASURED,
        device=device_name or device.type,
        dtype=dtype_name(dtype),
        micro_batch_sizes=measured_sizes,
        not_fitting_micro_batch_size=not_fitting,
        seq_len=model.seq_len,
        hidden=model.hidden,
        vocab=model.vocab,
        layers=_layer_profiles(model, under_test, sweep.shards, costs, shard_costs, costs_from),
        notes=notes,
        device_memory_bytes=device_memory_bytes(device),
        host=None if load_before is None else load_before.model_copy(
            update={"timing_spread": round(statistics.median(sweep.spreads), 4) if sweep.spreads else None}
        ),
    )


def _method_notes(
    device: torch.device, cpu_threads: int | None, warmup: int, repeats: int, shard_degrees: Sequence[int]
) -> list[str]:
    """How the figures were taken, for the profile's notes."""
    notes = []
    if device.type == "cpu":
        notes.append(
            "peak_memory_bytes on CPU is an estimate: parameters + gradients + saved + output bytes of the layer"
        )
        if cpu_threads is not None:
            notes.append(f"timed with {cpu_threads} CPU thread(s), as a pipeline rank runs")
    notes.append(f"times are medians of {repeats} runs after {warmup} discarded warm-up runs")
    if shard_degrees:
        notes.append(
            f"tensor-parallel shards (t = {', '.join(map(str, shard_degrees))}): one rank's shard of each distinct "
            "transformer block, timed on this device with the all-reduces skipped (compute only; the planner "
            "prices them from the links); embeddings, final norm and head are replicated on every tensor rank"
        )
    return notes


def _layer_profiles(
    model: ModelLayers,
    under_test: ModelUnderTest,
    shards: dict[int, ModelUnderTest],
    costs: list[list[LayerCost]],
    shard_costs: dict[int, list[list[LayerCost]]],
    costs_from: list[int | None],
) -> list[LayerProfile]:
    return [
        LayerProfile(
            index=index,
            name=layer.name,
            kind=layer.kind,
            parameter_count=sum(p.numel() for p in under_test.parameters(index)),
            parameter_bytes=under_test.parameter_bytes(index),
            shared_group=layer.tie_key,
            shared_parameter_count=under_test.shared_count(index),
            costs=costs[index],
            costs_from=costs_from[index],
            shards=[
                ShardProfile(
                    tensor_parallel=t,
                    parameter_count=sum(p.numel() for p in shard.parameters(index)),
                    parameter_bytes=shard.parameter_bytes(index),
                    costs=shard_costs[t][index],
                )
                for t, shard in shards.items()
                if shard_costs[t][index]
            ],
        )
        for index, layer in enumerate(model.layers)
    ]


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of a CUDA device as its runtime reports it; None on CPU (no one figure applies)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(index).total_memory)


def _batch(model: ModelLayers, size: int, seed: int, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """The model's batch of `size` samples on `device`: (inputs, labels)."""
    inputs, labels = _made_batch(model, size, seed)
    return to_device(inputs, device, dtype), to_device(labels, device, dtype)


def _made_batch(model: ModelLayers, size: int, seed: int) -> Any:
    """The model's own make_batch of `size` samples, with its seed per size, on the host."""
    with model_code(f"the model's make_batch({size}, generator)",
                    hint="make_batch(micro_batch_size, generator) returns (inputs, labels)"):
        return model.make_batch(size, torch.Generator().manual_seed(seed + size))


# The largest batch made only to learn a sample's bytes: a smallest size asked for beyond it is
# what the host-memory check exists to keep from being made.
PROBE_SAMPLES = 64


def _batch_bytes(model: ModelLayers, smallest: int, seed: int) -> float:
    """Bytes of one sample's inputs and labels (a batch of b takes b times that), from a batch of
    the smallest size asked for, or of 1 when that is beyond `PROBE_SAMPLES`; 0 (nothing checked)
    when the model makes no batch of 1."""
    size = smallest if smallest <= PROBE_SAMPLES else 1
    try:
        batch = _made_batch(model, size, seed)
    except PipectlError:
        if size == smallest:
            raise
        return 0.0

    def nbytes(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.nelement() * value.element_size()
        if isinstance(value, dict):
            return sum(nbytes(v) for v in value.values())
        return sum(nbytes(v) for v in value) if isinstance(value, (list, tuple)) else 0

    return nbytes(batch) / size


def _beyond_host_memory(per_sample: float, size: int) -> str | None:
    """Why a batch of `size` samples of `per_sample` bytes is not made, or None when the host has the memory."""
    available = psutil.virtual_memory().available
    if per_sample * size <= available:
        return None
    return (f"micro-batch size {size}: its batch alone would take {format_gib(per_sample * size)} of host memory, "
            f"{format_gib(available)} available; stopped there")


def _over_budget(
    model: ModelLayers,
    under_test: ModelUnderTest,
    runs: dict[int, LayerRun],
    taken_from: list[int],
    size: int,
    budget_bytes: int,
) -> str | None:
    """Why micro-batch size `size` does not fit the CPU budget, or None when it does.

    A model that can be built whole is held whole by one device: its parameters and gradients,
    every layer's saved bytes and the last output. A shape-only model is measured one layer at a
    time, so each measured layer alone must fit (parameters, gradients, saved and output bytes).
    """
    if model.shape_only:
        index = max(runs, key=lambda i: 2 * under_test.parameter_bytes(i) + runs[i].saved_bytes + runs[i].output_bytes)
        run = runs[index]
        estimate = 2 * under_test.parameter_bytes(index) + run.saved_bytes + run.output_bytes
        if estimate <= budget_bytes:
            return None
        return (
            f"micro-batch size {size} does not fit: estimated {estimate} bytes for layer "
            f"'{model.layers[index].name}' alone (parameters + gradients + saved activations + output; "
            f"shape-only model, measured one layer at a time) > budget {budget_bytes} bytes"
        )
    holder_of = under_test.holder_of
    # Unique parameters: a tied layer after the first holder charges a copy of the holder's weight.
    parameter_bytes = sum(under_test.parameter_bytes(i) for i in range(len(taken_from)) if holder_of[i] is None)
    saved = sum(runs[source].saved_bytes for source in taken_from)
    estimate = 2 * parameter_bytes + saved + runs[taken_from[-1]].output_bytes
    if estimate <= budget_bytes:
        return None
    return (
        f"micro-batch size {size} does not fit: estimated {estimate} bytes "
        f"(parameters + gradients + saved activations) > budget {budget_bytes} bytes"
    )


def _names(model: ModelLayers, indices: list[int]) -> str:
    """Layer names, a long list of them shortened: 'block.1, block.2, ..., block.95 (95 layers)'."""
    names = [model.layers[i].name for i in indices]
    if len(names) <= 4:
        return ", ".join(names)
    return f"{names[0]}, {names[1]}, ..., {names[-1]} ({len(names)} layers)"


def _once_note(model: ModelLayers, costs_from: list[int | None]) -> str:
    """Which layers were measured and which reuse whose costs (one-instance mode)."""
    measured = [i for i, source in enumerate(costs_from) if source is None]
    reused: dict[int, list[int]] = {}
    for index, source in enumerate(costs_from):
        if source is not None:
            reused.setdefault(source, []).append(index)
    parts = [f"{_names(model, copies)} reuse {model.layers[source].name}" for source, copies in reused.items()]
    return (
        f"one instance of each distinct layer measured ({len(measured)} of {len(costs_from)}: "
        f"{_names(model, measured)}); "
        + ("; ".join(parts) if parts else "no layer is identical to another")
        + " (identical: same kind, constructor arguments, parameter shapes and input shape; "
        "the last layer apart)"
    )


__all__ = [
    "check_micro_batch_sizes",
    "DEFAULT_MICRO_BATCH_SIZES",
    "device_memory_bytes",
    "dtype_name",
    "parse_dtype",
    "profile_model",
    "ProfileProgress",
    "ProgressCallback",
    "resolve_device",
]
