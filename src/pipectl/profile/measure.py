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

Then, by default on CPU, the training engine itself is calibrated on one rank
(`runtime_calibration`): its per-micro-batch overheads, its end-of-step cost (fixed and per
parameter) and how much slower the layers run inside a real step than alone. These go into
`ModelProfile.runtime`; the planner adds them to the layer times (`plan.costs`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode
from torch import nn

from pipectl.artifacts.profile import LayerCost, LayerProfile, ModelProfile, ProfileSource
from pipectl.errors import PipectlError, UserInputError
from pipectl.models.base import ModelLayers
from pipectl.profile.runtime_calibration import calibrate_runtime

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


@dataclass
class _LayerRun:
    """What one layer produced during the untimed pass of one micro-batch size."""

    output: Any
    output_bytes: int
    saved_bytes: int
    forward_flops: float = 0.0


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
            hint="profile on cpu, or derive a profile: pipectl profile MODEL --derive --device-kind a100-80gb",
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


def tensor_bytes(value: Any) -> int:
    """Bytes of a tensor, or of every tensor in a tuple/list/dict (layers may return several)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(item) for item in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    return 0


def _floating_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _floating_tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _floating_tensors(item)]
    return []


def _detached_input(value: Any) -> Any:
    """The next layer's input: detached from the previous graph, requiring grad when float."""
    if isinstance(value, torch.Tensor):
        detached = value.detach()
        return detached.requires_grad_(True) if detached.is_floating_point() else detached
    if isinstance(value, tuple):
        return tuple(_detached_input(item) for item in value)
    if isinstance(value, list):
        return [_detached_input(item) for item in value]
    if isinstance(value, dict):
        return {key: _detached_input(item) for key, item in value.items()}
    return value


def _to_device(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Move a batch to the device; floating tensors take the profiled dtype, integer tensors keep theirs."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(item, device, dtype) for item in value)
    return value


class _ModelUnderTest:
    """The model's modules built once, tied layers sharing the first holder's module."""

    def __init__(self, model: ModelLayers, device: torch.device, dtype: torch.dtype) -> None:
        self.defs = model.layers
        self.modules: list[nn.Module] = []
        first_holder: dict[str, nn.Module] = {}
        self.layer_parameters: list[list[nn.Parameter]] = []
        self.shared_counts: list[int] = []
        for layer in self.defs:
            if layer.tie_key is not None and layer.tie_key in first_holder:
                module = first_holder[layer.tie_key]
                tied = layer.tied_weight(module)
                params = [tied]
                shared = tied.numel()
            else:
                module = layer.build().to(device=device, dtype=dtype)
                if layer.tie_key is not None:
                    first_holder[layer.tie_key] = module
                params = list(module.parameters())
                shared = layer.tied_weight(module).numel() if layer.tie_key is not None else 0
            self.modules.append(module)
            self.layer_parameters.append(params)
            self.shared_counts.append(shared)
        self.parameter_storages = {p.untyped_storage().data_ptr() for m in self.modules for p in m.parameters()}

    def forward(self, index: int, x: Any) -> Any:
        return self.defs[index].forward(self.modules[index], x)

    def zero_grad(self) -> None:
        for module in self.modules:
            module.zero_grad(set_to_none=True)


def _saved_bytes_hooks(parameter_storages: set[int]):
    """Hooks that sum the bytes autograd saves, each storage once, parameters excluded."""
    seen: set[int] = set()
    total = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in parameter_storages and pointer not in seen:
            seen.add(pointer)
            total[0] += storage.nbytes()
        return tensor

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack), total


def _backward(output: Any, loss: torch.Tensor | None, upstream: list[torch.Tensor]) -> None:
    if loss is not None:
        loss.backward()
        return
    tensors = [t for t in _floating_tensors(output) if t.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, upstream)


class _Clock:
    """Wall-clock seconds, synchronising CUDA so that queued kernels are counted."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


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
) -> ModelProfile:
    """Measure every layer of `model` at every micro-batch size that fits.

    `memory_budget_bytes` (CPU only) stops the sweep at the first size whose whole-model estimate
    (parameters + gradients + every layer's saved bytes + the last output) exceeds it; None means no
    CPU limit. `cpu_threads` pins torch's intra-op threads while profiling on CPU (1 matches a
    pipeline rank started with OMP_NUM_THREADS=1); None leaves them alone. `device_name` is the
    catalog name written into the profile (default: the torch device type). `runtime` also
    calibrates the training engine on one rank (CPU only for now; about 3 s for gpt-tiny) and
    records `ModelProfile.runtime`; a failed calibration is noted, not raised.

    Example (gpt-tiny, 9 layers, on this 2-core CPU in about a second):

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

    previous_threads = torch.get_num_threads()
    if torch_device.type == "cpu" and cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            profile = _profile(model, sizes, torch_device, warmup, repeats, dtype, progress,
                               memory_budget_bytes, cpu_threads, device_name, seed)
    finally:
        torch.set_num_threads(previous_threads)
    if runtime:
        profile = _with_runtime_costs(profile, model, torch_device, dtype, seed)
    return profile


def _with_runtime_costs(
    profile: ModelProfile, model: ModelLayers, device: torch.device, dtype: torch.dtype, seed: int
) -> ModelProfile:
    """The profile with `runtime` measured (see `runtime_calibration`), or a note saying why not."""
    if device.type != "cpu":
        note = f"runtime terms not measured: the engine calibration runs on CPU only (device {device})"
        return profile.model_copy(update={"notes": [*profile.notes, note]})
    if dtype != torch.float32:
        note = f"runtime terms not measured: the engine calibration runs in float32 (profiled {dtype_name(dtype)})"
        return profile.model_copy(update={"notes": [*profile.notes, note]})
    started = time.perf_counter()
    try:
        costs = calibrate_runtime(model, profile, warmup=CALIBRATION_WARMUP, steps=CALIBRATION_STEPS, seed=seed)
    except PipectlError as exc:
        return profile.model_copy(update={"notes": [*profile.notes, f"runtime terms not measured: {exc.message}"]})
    note = (
        f"runtime terms: {costs.engine}; one 1x1-layer model and this model at every size, "
        f"{CALIBRATION_STEPS} timed steps of m=2 after {CALIBRATION_WARMUP} warm-up steps, medians "
        f"({time.perf_counter() - started:.1f} s)"
    )
    return profile.model_copy(update={"runtime": costs, "notes": [*profile.notes, note]})


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
) -> ModelProfile:
    under_test = _ModelUnderTest(model, device, dtype)
    clock = _Clock(device)
    costs: list[list[LayerCost]] = [[] for _ in model.layers]
    measured_sizes: list[int] = []
    not_fitting: int | None = None
    notes: list[str] = []
    total_cells = len(sizes) * len(model.layers)
    done = 0

    # Unique parameters (+ their gradients) held while the whole model runs on one device.
    unique = {p.untyped_storage().data_ptr(): p for params in under_test.layer_parameters for p in params}
    model_parameter_bytes = sum(p.numel() * p.element_size() for p in unique.values())

    for size in sizes:
        generator = torch.Generator().manual_seed(seed + size)
        inputs, labels = model.make_batch(size, generator)
        inputs = _to_device(inputs, device, dtype)
        labels = _to_device(labels, device, dtype)
        try:
            runs = _untimed_pass(under_test, inputs, labels, model.loss_fn)
        except torch.cuda.OutOfMemoryError:
            not_fitting = size
            notes.append(f"micro-batch size {size} ran out of CUDA memory; stopped there")
            break
        if device.type == "cpu" and memory_budget_bytes is not None:
            estimate = 2 * model_parameter_bytes + sum(r.saved_bytes for r in runs) + runs[-1].output_bytes
            if estimate > memory_budget_bytes:
                not_fitting = size
                notes.append(
                    f"micro-batch size {size} does not fit: estimated {estimate} bytes "
                    f"(parameters + gradients + saved activations) > budget {memory_budget_bytes} bytes"
                )
                break
        try:
            layer_costs = []
            for index in range(len(model.layers)):
                layer_input = inputs if index == 0 else runs[index - 1].output
                layer_costs.append(
                    _measure_layer(under_test, index, layer_input, labels, model.loss_fn, runs[index], size,
                                   warmup, repeats, clock, device)
                )
                done += 1
                if progress is not None:
                    progress(ProfileProgress(done, total_cells, model.layers[index].name, size))
        except torch.cuda.OutOfMemoryError:
            not_fitting = size
            notes.append(f"micro-batch size {size} ran out of CUDA memory while timing; stopped there")
            break
        for index, cost in enumerate(layer_costs):
            costs[index].append(cost)
        measured_sizes.append(size)

    if not measured_sizes:
        raise UserInputError(
            f"model '{model.name}' does not fit even at micro-batch size {sizes[0]}",
            hint="; ".join(notes) or None,
        )
    if device.type == "cpu":
        notes.append(
            "peak_memory_bytes on CPU is an estimate: parameters + gradients + saved + output bytes of the layer"
        )
        if cpu_threads is not None:
            notes.append(f"timed with {cpu_threads} CPU thread(s), as a pipeline rank runs")
    notes.append(f"times are medians of {repeats} runs after {warmup} discarded warm-up runs")

    layers = [
        LayerProfile(
            index=index,
            name=layer.name,
            kind=layer.kind,
            parameter_count=sum(p.numel() for p in under_test.layer_parameters[index]),
            parameter_bytes=sum(p.numel() * p.element_size() for p in under_test.layer_parameters[index]),
            shared_group=layer.tie_key,
            shared_parameter_count=under_test.shared_counts[index],
            costs=costs[index],
        )
        for index, layer in enumerate(model.layers)
    ]
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
        layers=layers,
        notes=notes,
    )


def _untimed_pass(
    under_test: _ModelUnderTest, inputs: Any, labels: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
) -> list[_LayerRun]:
    """Run the layers once in order: each layer's real output and the bytes it saves for backward.

    Each layer runs on a detached copy of its input, so only one layer's graph is alive at a time.
    """
    runs: list[_LayerRun] = []
    x = inputs
    last = len(under_test.defs) - 1
    for index in range(len(under_test.defs)):
        layer_input = _detached_input(x)
        hooks, saved = _saved_bytes_hooks(under_test.parameter_storages)
        # PyTorch's own FLOP counter (matmuls, attention, convolutions) on the same real forward:
        # what the plan's TFLOP/s per device is computed from.
        flops = FlopCounterMode(display=False)
        with hooks, flops:
            output = under_test.forward(index, layer_input)
            if index == last:
                loss_fn(output, labels)
        runs.append(_LayerRun(output=output.detach() if isinstance(output, torch.Tensor) else output,
                              output_bytes=tensor_bytes(output), saved_bytes=saved[0],
                              forward_flops=float(flops.get_total_flops())))
        x = output
    return runs


def _measure_layer(
    under_test: _ModelUnderTest,
    index: int,
    layer_input: Any,
    labels: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    run: _LayerRun,
    micro_batch_size: int,
    warmup: int,
    repeats: int,
    clock: _Clock,
    device: torch.device,
) -> LayerCost:
    """Median forward and backward seconds of one layer at one micro-batch size."""
    is_last = index == len(under_test.defs) - 1
    forward_times: list[float] = []
    backward_times: list[float] = []
    # Gradients start unallocated, as on a stage's first micro-batch; warm-up absorbs the allocation.
    under_test.zero_grad()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    for attempt in range(warmup + repeats):
        x = _detached_input(layer_input)
        start = clock.now()
        output = under_test.forward(index, x)
        loss = loss_fn(output, labels) if is_last else None
        middle = clock.now()
        upstream = [torch.randn_like(t) for t in _floating_tensors(output) if t.requires_grad]
        backward_start = clock.now()
        _backward(output, loss, upstream)
        end = clock.now()
        if attempt >= warmup:
            forward_times.append(middle - start)
            backward_times.append(end - backward_start)
        del output, loss, upstream, x
    params = under_test.layer_parameters[index]
    parameter_bytes = sum(p.numel() * p.element_size() for p in params)
    if device.type == "cuda":
        # Everything allocated above the baseline (gradients, saved tensors, output) + the weights.
        peak = torch.cuda.max_memory_allocated(device) - baseline + parameter_bytes
    else:
        peak = 2 * parameter_bytes + run.saved_bytes + run.output_bytes
    return LayerCost(
        micro_batch_size=micro_batch_size,
        forward_seconds=statistics.median(forward_times),
        backward_seconds=statistics.median(backward_times),
        output_activation_bytes=run.output_bytes,
        saved_activation_bytes=run.saved_bytes,
        peak_memory_bytes=peak,
        forward_flops=run.forward_flops,
    )


def layer_parameter_tensors(model: ModelLayers) -> list[list[torch.Tensor]]:
    """The parameter tensors each layer is charged with, built the way `profile_model` builds them.

    Useful to check a profile against the real modules (tests, reports).
    """
    return _ModelUnderTest(model, torch.device("cpu"), torch.float32).layer_parameters


__all__ = [
    "DEFAULT_MICRO_BATCH_SIZES",
    "ProfileProgress",
    "ProgressCallback",
    "check_micro_batch_sizes",
    "dtype_name",
    "layer_parameter_tensors",
    "parse_dtype",
    "profile_model",
    "resolve_device",
    "tensor_bytes",
]
