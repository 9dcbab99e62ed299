"""One layer at a time, as `measure` profiles a model: the untimed pass that records each layer's
input, output, saved-for-backward bytes and FLOPs (`untimed_pass`), then its forward and backward
timed on that input (`measure_layer`), and the same for one rank's shard of a tensor-parallel block
(`shard_under_test`). What is recorded, and why that way, is `measure`'s module docstring.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode
from torch import nn

from pipectl.artifacts.profile import LayerCost
from pipectl.errors import UserInputError
from pipectl.models.base import ModelLayers
from pipectl.models.tensor_parallel import TensorParallelGroup, shard_model
from pipectl.models.layer_facts import tied_holders, plain_value, identical_layers


@dataclass
class LayerRun:
    """What one layer produced during the untimed pass of one micro-batch size."""

    layer_input: Any  # detached
    output: Any  # detached
    output_bytes: int
    saved_bytes: int
    forward_flops: float = 0.0
    # A block that recomputes its attention core selectively (`models.transformer.TransformerBlock`):
    # the bytes that frees (saved bytes run normally less run selectively); None for other layers.
    attention_core_saved_bytes: int | None = None


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


def to_device(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Move a batch to the device; floating tensors take the profiled dtype, integer tensors keep theirs."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(item, device, dtype) for item in value)
    return value


class ModelUnderTest:
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


def saved_bytes_hooks(parameter_storages: set[int]):
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


class Clock:
    """Wall-clock seconds, synchronising CUDA so that queued kernels are counted."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def shard_under_test(model: ModelLayers, t: int, device: torch.device, dtype: torch.dtype) -> ModelUnderTest:
    """Rank 0's shards of a t-way group without communication, one module per distinct block."""
    sharded = shard_model(model, TensorParallelGroup.without_communication(t))
    return ModelUnderTest(sharded, device, dtype, identical_layers(sharded))


def shard_run(shard: ModelUnderTest, index: int, layer_input: Any) -> LayerRun:
    """A shard's untimed pass on the block's own input: its output, saved bytes and FLOPs."""
    shard.module(index)  # built before the hooks below, which leave its parameters out
    hooks, saved = saved_bytes_hooks(shard.parameter_storages)
    flops = FlopCounterMode(display=False)
    with hooks, flops:
        output = shard.forward(index, _detached_input(layer_input))
    return LayerRun(layer_input=layer_input, output=output.detach(), output_bytes=tensor_bytes(output),
                     saved_bytes=saved[0], forward_flops=float(flops.get_total_flops()))  # fmt: skip


def input_signature(value: Any) -> Any:
    """Shapes and dtypes of a layer's input (tensors in tuples, lists or dicts); other values by `plain_value`."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(input_signature(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(key), input_signature(item)) for key, item in value.items())))
    return plain_value(value)


LAYER_CHAIN = "a layer takes the previous one's output; the last one's output goes to loss_fn(output, labels)"


@contextmanager
def model_code(what: str, hint: str = LAYER_CHAIN) -> Iterator[None]:
    """The model's own code (a factory's layers, loss, batches) failing on its first run: one line
    naming the part and the error, a user's mistake (exit 2), not a traceback of pipectl's.
    Running out of memory is no mistake: it goes on to the caller, which stops the sweep there."""
    try:
        yield
    except (torch.cuda.OutOfMemoryError, MemoryError):
        raise
    except Exception as exc:
        raise UserInputError(f"{what} raised {type(exc).__name__}: {exc}", hint=hint) from exc


def untimed_pass(
    under_test: ModelUnderTest, inputs: Any, labels: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
) -> tuple[dict[int, LayerRun], list[int]]:
    """Run the layers once in order: each measured layer's real output and the bytes it saves for backward.

    Returns the runs by layer index and, for every layer, the index of the layer it takes its
    run from: itself, or an earlier layer identical to it (`under_test.same_as`) that got the same
    input shapes (and is not the last: the last layer's backward includes the loss). Such a layer
    is not run; its output (the earlier layer's) is the next layer's input.
    Each layer runs on a detached copy of its input, so only one layer's graph is alive at a time.
    """
    runs: dict[int, LayerRun] = {}
    taken_from: list[int] = []
    first_with: dict[tuple, int] = {}
    x = inputs
    last = len(under_test.defs) - 1
    for index in range(len(under_test.defs)):
        key = (under_test.same_as[index], input_signature(x), index == last)
        source = first_with.setdefault(key, index)
        taken_from.append(source)
        if source != index:
            x = runs[source].output
            continue
        under_test.module(index)  # built before the hooks below, which leave its parameters out
        layer_input = _detached_input(x)
        hooks, saved = saved_bytes_hooks(under_test.parameter_storages)
        # PyTorch's own FLOP counter (matmuls, attention, convolutions) on the same real forward:
        # what the plan's TFLOP/s per device is computed from.
        flops = FlopCounterMode(display=False)
        with hooks, flops:  # the loss's saved tensors count as the last layer's
            with model_code(f"layer {index} ({under_test.defs[index].name})"):
                output = under_test.forward(index, layer_input)
            if index == last:
                with model_code("the model's loss_fn"):
                    loss_fn(output, labels)
        detached = output.detach() if isinstance(output, torch.Tensor) else output
        del output
        runs[index] = LayerRun(layer_input=x, output=detached, output_bytes=tensor_bytes(detached),
                                saved_bytes=saved[0], forward_flops=float(flops.get_total_flops()),
                                attention_core_saved_bytes=_attention_core_saved_bytes(under_test, index, x, saved[0]))
        x = detached
    return runs, taken_from


def _has_attention_core(module: nn.Module) -> bool:
    """A block whose attention core can run under selective recomputation (pipectl's own)."""
    return hasattr(module, "selective_recompute") and hasattr(module, "attention_inputs")


def _attention_core_saved_bytes(under_test: ModelUnderTest, index: int, layer_input: Any, saved_bytes: int) -> int | None:
    """What selective recomputation frees of a block's saved bytes: its saved bytes less those of
    the same forward with the attention core under a checkpoint (which keeps only q, k, v, views
    of the QKV output the block keeps anyway). None for a layer without such a core."""
    module = under_test.module(index)
    if not _has_attention_core(module):
        return None
    hooks, selective = saved_bytes_hooks(under_test.parameter_storages)
    module.selective_recompute = True
    try:
        with hooks:
            under_test.forward(index, _detached_input(layer_input))
    finally:
        module.selective_recompute = False
    return max(0, saved_bytes - selective[0])


def _attention_core_seconds(
    under_test: ModelUnderTest, index: int, layer_input: Any, warmup: int, repeats: int, clock: "Clock"
) -> float | None:
    """Forward time of a block's attention core alone, on the q, k, v of its real input, with
    autograd recording (as its recomputation inside the backward runs): what selective
    recomputation adds to the block's backward. None for a layer without such a core.

    The least disturbed of the runs, not their median: on a small model the core takes tens of
    microseconds, and one time slice another process takes is a hundred times that (a median on a
    busy host can exceed the whole block's forward). Other work
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


def measure_layer(
    under_test: ModelUnderTest,
    index: int,
    labels: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    run: LayerRun,
    micro_batch_size: int,
    warmup: int,
    repeats: int,
    clock: Clock,
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
    under_test = ModelUnderTest(model, torch.device("cpu"), torch.float32, list(range(len(model.layers))))
    return [under_test.parameters(index) for index in range(len(model.layers))]


__all__ = [
    "layer_parameter_tensors",
    "tensor_bytes",
]
