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
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode
from torch import nn

from pipectl.artifacts.profile import LayerCost, LayerProfile, ModelProfile, ProfileSource, ShardProfile
from pipectl.artifacts.run import Precision
from pipectl.cluster import host_state
from pipectl.errors import PipectlError, UserInputError
from pipectl.models.base import ModelLayers
from pipectl.models.tensor_parallel import TensorParallelGroup, shard_model
from pipectl.profile.runtime_calibration import CUDA_TWO_RANK_NOTE, calibrate_runtime
from pipectl.models.layer_facts import block_indices, tied_holders, plain_value, check_tensor_parallel, identical_layers

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

    layer_input: Any  # detached
    output: Any  # detached
    output_bytes: int
    saved_bytes: int
    forward_flops: float = 0.0
    # A block that recomputes its attention core selectively (`models.transformer.TransformerBlock`):
    # the bytes that frees (saved bytes run normally less run selectively); None for other layers.
    attention_core_saved_bytes: int | None = None


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
    """The modules being measured, each built on first use.

    `same_as[i]` is the layer whose module layer i runs (itself in every-layer mode; the first
    identical layer in one-instance mode, so a uniform model's blocks share one module); a tied
    layer after the first holder runs the module of its holder's `same_as`.
    """

    def __init__(self, model: ModelLayers, device: torch.device, dtype: torch.dtype, same_as: list[int]) -> None:
        self.defs = model.layers
        self.device = device
        self.dtype = dtype
        self.same_as = same_as
        self.holder_of = tied_holders(model)
        self.built: dict[int, nn.Module] = {}
        self.parameter_storages: set[int] = set()

    def owner(self, index: int) -> int:
        holder = self.holder_of[index]
        return self.same_as[holder if holder is not None else index]

    def module(self, index: int) -> nn.Module:
        owner = self.owner(index)
        if owner not in self.built:
            with torch.device(self.device):  # on the device from the start: no host copy of a large layer
                module = self.defs[owner].build()
            module = module.to(device=self.device, dtype=self.dtype)
            self.built[owner] = module
            self.parameter_storages.update(p.untyped_storage().data_ptr() for p in module.parameters())
        return self.built[owner]

    def parameters(self, index: int) -> list[nn.Parameter]:
        """What layer `index` is charged with: its module's parameters, or the tied weight it uses."""
        module = self.module(index)
        if self.holder_of[index] is not None:
            return [self.defs[index].tied_weight(module)]
        return list(module.parameters())

    def shared_count(self, index: int) -> int:
        layer = self.defs[index]
        return layer.tied_weight(self.module(index)).numel() if layer.tie_key is not None else 0

    def parameter_bytes(self, index: int) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters(index))

    def forward(self, index: int, x: Any) -> Any:
        return self.defs[index].forward(self.module(index), x)

    def zero_grad(self) -> None:
        for module in self.built.values():
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
    under_test = _ModelUnderTest(model, device, dtype, same_as)
    shards = {t: _shard_under_test(model, t, device, dtype) for t in shard_degrees}
    shard_costs: dict[int, list[list[LayerCost]]] = {t: [[] for _ in model.layers] for t in shard_degrees}
    clock = _Clock(device)
    costs: list[list[LayerCost]] = [[] for _ in model.layers]
    sources: list[list[int]] = []  # per measured size: the layer each layer's costs come from
    measured_sizes: list[int] = []
    not_fitting: int | None = None
    notes: list[str] = []
    # How busy the host is, before this process adds to it, and how steady its timings are.
    load_before = host_state()
    spreads: list[float] = []
    total_cells = len(sizes) * (count + len(shard_degrees) * len(block_indices(model)))
    done = 0

    for size in sizes:
        generator = torch.Generator().manual_seed(seed + size)
        inputs, labels = model.make_batch(size, generator)
        inputs = _to_device(inputs, device, dtype)
        labels = _to_device(labels, device, dtype)
        try:
            runs, taken_from = _untimed_pass(under_test, inputs, labels, model.loss_fn)
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
            layer_costs: list[LayerCost] = []
            for index in range(count):
                source = taken_from[index]
                if source == index:
                    cost = _measure_layer(under_test, index, labels, model.loss_fn, runs[index], size,
                                          warmup, repeats, clock, device, spreads)
                else:
                    cost = layer_costs[source]
                layer_costs.append(cost)
                done += 1
                if progress is not None:
                    progress(ProfileProgress(done, total_cells, model.layers[index].name, size))
            shard_layer_costs: dict[int, dict[int, LayerCost]] = {}
            for t, shard in shards.items():
                measured: dict[tuple, int] = {}
                shard_layer_costs[t] = {}
                for index in block_indices(model):
                    run = runs[taken_from[index]]
                    key = (shard.same_as[index], _input_signature(run.layer_input))
                    source = measured.setdefault(key, index)
                    if source == index:
                        shard_run = _shard_run(shard, index, run.layer_input)
                        cost = _measure_layer(shard, index, labels, model.loss_fn, shard_run, size,
                                              warmup, repeats, clock, device)  # fmt: skip
                    else:
                        cost = shard_layer_costs[t][source]
                    shard_layer_costs[t][index] = cost
                    done += 1
                    if progress is not None:
                        progress(ProfileProgress(done, total_cells, f"{model.layers[index].name} (t={t} shard)", size))
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

    layers = [
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
        device_memory_bytes=device_memory_bytes(device),
        host=None if load_before is None else load_before.model_copy(
            update={"timing_spread": round(statistics.median(spreads), 4) if spreads else None}
        ),
    )


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of a CUDA device as its runtime reports it; None on CPU (no one figure applies)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(index).total_memory)


def _over_budget(
    model: ModelLayers,
    under_test: _ModelUnderTest,
    runs: dict[int, _LayerRun],
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


def _shard_under_test(model: ModelLayers, t: int, device: torch.device, dtype: torch.dtype) -> _ModelUnderTest:
    """Rank 0's shards of a t-way group without communication, one module per distinct block."""
    sharded = shard_model(model, TensorParallelGroup.without_communication(t))
    return _ModelUnderTest(sharded, device, dtype, identical_layers(sharded))


def _shard_run(shard: _ModelUnderTest, index: int, layer_input: Any) -> _LayerRun:
    """A shard's untimed pass on the block's own input: its output, saved bytes and FLOPs."""
    shard.module(index)  # built before the hooks below, which leave its parameters out
    hooks, saved = _saved_bytes_hooks(shard.parameter_storages)
    flops = FlopCounterMode(display=False)
    with hooks, flops:
        output = shard.forward(index, _detached_input(layer_input))
    return _LayerRun(layer_input=layer_input, output=output.detach(), output_bytes=tensor_bytes(output),
                     saved_bytes=saved[0], forward_flops=float(flops.get_total_flops()))  # fmt: skip


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


def _input_signature(value: Any) -> Any:
    """Shapes and dtypes of a layer's input (tensors in tuples, lists or dicts); other values by `plain_value`."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_input_signature(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(key), _input_signature(item)) for key, item in value.items())))
    return plain_value(value)


def _untimed_pass(
    under_test: _ModelUnderTest, inputs: Any, labels: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
) -> tuple[dict[int, _LayerRun], list[int]]:
    """Run the layers once in order: each measured layer's real output and the bytes it saves for backward.

    Returns the runs by layer index and, for every layer, the index of the layer it takes its
    run from: itself, or an earlier layer identical to it (`under_test.same_as`) that got the same
    input shapes (and is not the last: the last layer's backward includes the loss). Such a layer
    is not run; its output (the earlier layer's) is the next layer's input.
    Each layer runs on a detached copy of its input, so only one layer's graph is alive at a time.
    """
    runs: dict[int, _LayerRun] = {}
    taken_from: list[int] = []
    first_with: dict[tuple, int] = {}
    x = inputs
    last = len(under_test.defs) - 1
    for index in range(len(under_test.defs)):
        key = (under_test.same_as[index], _input_signature(x), index == last)
        source = first_with.setdefault(key, index)
        taken_from.append(source)
        if source != index:
            x = runs[source].output
            continue
        under_test.module(index)  # built before the hooks below, which leave its parameters out
        layer_input = _detached_input(x)
        hooks, saved = _saved_bytes_hooks(under_test.parameter_storages)
        # PyTorch's own FLOP counter (matmuls, attention, convolutions) on the same real forward:
        # what the plan's TFLOP/s per device is computed from.
        flops = FlopCounterMode(display=False)
        with hooks, flops:
            output = under_test.forward(index, layer_input)
            if index == last:
                loss_fn(output, labels)
        detached = output.detach() if isinstance(output, torch.Tensor) else output
        del output
        runs[index] = _LayerRun(layer_input=x, output=detached, output_bytes=tensor_bytes(detached),
                                saved_bytes=saved[0], forward_flops=float(flops.get_total_flops()),
                                attention_core_saved_bytes=_attention_core_saved_bytes(under_test, index, x, saved[0]))
        x = detached
    return runs, taken_from


def _has_attention_core(module: nn.Module) -> bool:
    """A block whose attention core can run under selective recomputation (pipectl's own)."""
    return hasattr(module, "selective_recompute") and hasattr(module, "attention_inputs")


def _attention_core_saved_bytes(under_test: _ModelUnderTest, index: int, layer_input: Any, saved_bytes: int) -> int | None:
    """What selective recomputation frees of a block's saved bytes: its saved bytes less those of
    the same forward with the attention core under a checkpoint (which keeps only q, k, v, views
    of the QKV output the block keeps anyway). None for a layer without such a core."""
    module = under_test.module(index)
    if not _has_attention_core(module):
        return None
    hooks, selective = _saved_bytes_hooks(under_test.parameter_storages)
    module.selective_recompute = True
    try:
        with hooks:
            under_test.forward(index, _detached_input(layer_input))
    finally:
        module.selective_recompute = False
    return max(0, saved_bytes - selective[0])


def _attention_core_seconds(
    under_test: _ModelUnderTest, index: int, layer_input: Any, warmup: int, repeats: int, clock: "_Clock"
) -> float | None:
    """Forward time of a block's attention core alone, on the q, k, v of its real input, with
    autograd recording (as its recomputation inside the backward runs): what selective
    recomputation adds to the block's backward. None for a layer without such a core.

    The least disturbed of the runs, not their median: on a small model the core takes tens of
    microseconds, and one time slice another process takes is a hundred times that (a CI run
    measured a median of 3.0 ms for gpt-tiny's core inside a 0.26 ms block forward). Other work
    only adds time; the host slowdowns scale the figure like every other compute term."""
    from pipectl.models.transformer import attention_core

    module = under_test.module(index)
    if not _has_attention_core(module):
        return None
    with torch.no_grad():
        q, k, v = module.attention_inputs(module.ln_attn(_detached_input(layer_input)))
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    times: list[float] = []
    for attempt in range(warmup + repeats):
        start = clock.now()
        out = attention_core(q, k, v, module.causal)
        end = clock.now()
        del out
        if attempt >= warmup:
            times.append(end - start)
    return min(times)


def _measure_layer(
    under_test: _ModelUnderTest,
    index: int,
    labels: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    run: _LayerRun,
    micro_batch_size: int,
    warmup: int,
    repeats: int,
    clock: _Clock,
    device: torch.device,
    spreads: list[float] | None = None,
) -> LayerCost:
    """Median forward and backward seconds of one layer at one micro-batch size; the spread of its
    timed runs, (slowest - fastest) / median, is appended to `spreads`."""
    layer_input = run.layer_input
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
    if spreads is not None:
        totals = [f + b for f, b in zip(forward_times, backward_times)]
        middle_total = statistics.median(totals)
        if middle_total > 0:
            spreads.append((max(totals) - min(totals)) / middle_total)
    parameter_bytes = under_test.parameter_bytes(index)
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
        attention_core_saved_bytes=run.attention_core_saved_bytes,
        attention_core_forward_seconds=(
            None if run.attention_core_saved_bytes is None
            else _attention_core_seconds(under_test, index, layer_input, warmup, repeats, clock)
        ),
    )


def layer_parameter_tensors(model: ModelLayers) -> list[list[torch.Tensor]]:
    """The parameter tensors each layer is charged with, built the way `profile_model` builds them.

    Useful to check a profile against the real modules (tests, reports).
    """
    under_test = _ModelUnderTest(model, torch.device("cpu"), torch.float32, list(range(len(model.layers))))
    return [under_test.parameters(index) for index in range(len(model.layers))]


__all__ = [
    "DEFAULT_MICRO_BATCH_SIZES",
    "ProfileProgress",
    "ProgressCallback",
    "check_micro_batch_sizes",
    "device_memory_bytes",
    "dtype_name",
    "layer_parameter_tensors",
    "parse_dtype",
    "profile_model",
    "resolve_device",
    "tensor_bytes",
]
