"""A DeepSpeed engine's training state, to host memory and back (one rank).

What a rank holds under DeepSpeed's ZeRO-1 optimizer (fp32, bf16 and fp16 alike: the
`DeepSpeedZeroOptimizer` keeps the master copy): per optimizer group, one flat fp32 partition of
its stage's parameters (`single_partition_of_fp32_groups`: all of them with one data-parallel
rank, 1/d of them with d) and the wrapped optimizer's state for that flat tensor (AdamW: `step`,
`exp_avg`, `exp_avg_sq`). DeepSpeed links every model parameter to its piece of the partition
(`param._hp_mapping`: where the piece starts in the parameter and in the partition); those links
become the `Fragment`s of `pipectl.runtime.checkpoint.shards`.

Under ZeRO-3 (`DeepSpeedZeroOptimizer_Stage3`, one-stage plans in DeepSpeed's ordinary engine)
the model's parameters are partitioned too (`param.ds_tensor`: elements r x P .. (r + 1) x P of
the flattened parameter on data-parallel rank r, P = `param.partition_numel()`, the last piece
padded), and each sub-group's pieces lie end to end in one flat fp32 partition
(`fp32_partitioned_groups_flat`) on which the optimizer keeps its state. DeepSpeed's own map of
where each piece lies (`grad_position`: sub-group, offset, length; what its `safe_get_local_*`
helpers read) becomes the same `Fragment`s, one sub-group per checkpoint group, so the two
optimizers' checkpoints are one format and load into each other. (DeepSpeed's default
`sub_group_size`, 1e9 elements, gives one sub-group per parameter group below a billion elements
per rank; `restore` refuses a checkpoint with another number of groups.)

`runtime.checkpoint.snapshot.HostSnapshot.capture` copies the partitions and states into host
buffers that are allocated once and reused (pinned when the engine runs on a GPU), so the training
loop pauses only for the copy. `restore` is the inverse for any layout: each parameter this rank holds is read from the
checkpoint, cut for this rank's tensor slice, and written into its piece of the partition, its
optimizer state and the model's own (possibly bf16) copy.

A snapshot taken at a step boundary holds one consistent instant: the weights and moments after
optimizer step N, the learning-rate schedule and loss scale after step N, the RNG states as step
N+1 will find them, and the data position N x B samples (the batches are a function of the step).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from pipectl.errors import CheckpointError
from pipectl.runtime.checkpoint.shards import FP32, RankHeader, ShardReader, TensorSplit, group_tensor

# DeepSpeed engine counters restored with the state (engine.load_checkpoint restores the same).
ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


# --------------------------------------------------------------------------- what DeepSpeed holds


@dataclass(frozen=True)
class Piece:
    """Elements `start` .. `start + numel` of `parameter` (flattened, whole on this tensor rank) at
    `offset` .. `offset + numel` of its group's flat partition."""

    parameter: torch.nn.Parameter
    offset: int
    start: int
    numel: int


@dataclass
class OptimizerGroup:
    """One flat fp32 partition this rank holds, the model parameters linked to it (`parameters`,
    all of them, also those whose elements lie in other ranks' partitions) and where each piece
    held here lies (`pieces`)."""

    partition: torch.Tensor
    parameters: list[torch.nn.Parameter]
    pieces: list[Piece]
    settings: dict[str, Any]  # the wrapped optimizer's param group (lr, betas, ...; no 'params')


def is_zero3(engine: Any) -> bool:
    """Whether the engine's optimizer is DeepSpeed's ZeRO-3 one (parameters partitioned too)."""
    return hasattr(engine.optimizer, "fp32_partitioned_groups_flat")


def parameter_shape(parameter: torch.nn.Parameter) -> tuple[int, ...]:
    """Its whole shape on this tensor rank (a ZeRO-3 parameter holds an empty tensor between uses)."""
    return tuple(getattr(parameter, "ds_shape", parameter.shape))


def _settings(optimizer: Any, index: int) -> dict[str, Any]:
    return {k: v for k, v in optimizer.optimizer.param_groups[index].items() if k != "params"}


def optimizer_groups(engine: Any) -> list[OptimizerGroup]:
    """Per optimizer group (ZeRO-3: per sub-group): the flat fp32 partition this rank holds and
    its links to the parameters. Raises `CheckpointError` for an optimizer that keeps no such
    partition. An engine that lays its state out so itself (the torch engine,
    `runtime.engines.torch_pipeline.TorchPipelineEngine`: one flat fp32 tensor) says where through its own
    `optimizer_groups()`; the rest of this module reads only those groups and named parameters."""
    if hasattr(engine, "optimizer_groups"):
        return engine.optimizer_groups()
    optimizer = engine.optimizer
    if is_zero3(engine):
        return _zero3_groups(optimizer)
    partitions = getattr(optimizer, "single_partition_of_fp32_groups", None)
    parameters = getattr(optimizer, "bit16_groups", None)
    if partitions is None or parameters is None:
        raise CheckpointError(
            f"cannot checkpoint a {type(optimizer).__name__}: pipectl reads DeepSpeed's ZeRO-1/2/3 optimizer partitions",
            hint="train with zero_optimization.stage 1 (pipectl's ds_config does)",
        )
    groups = []
    for index, (partition, group) in enumerate(zip(partitions, parameters)):
        pieces = []
        for parameter in group:
            mapping = parameter._hp_mapping
            if mapping is None:  # every element of it lies in another data-parallel rank's partition
                continue
            pieces.append(
                Piece(
                    parameter,
                    offset=mapping.hp_fragment_address.start,
                    start=mapping.lp_fragment_address.start,
                    numel=mapping.lp_fragment_address.numel,
                )
            )
        groups.append(OptimizerGroup(partition, list(group), pieces, _settings(optimizer, index)))
    return groups


def _zero3_groups(optimizer: Any) -> list[OptimizerGroup]:
    """ZeRO-3's sub-groups: parameter r x P .. (r + 1) x P (its padding excluded) at the offset
    DeepSpeed records for it in the sub-group's flat partition (`grad_position`, which its
    `safe_get_local_fp32_param` reads too)."""
    groups = []
    for index, (partition, group) in enumerate(zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_groups)):
        pieces = []
        for parameter in group:
            sub_group, offset, length = optimizer.grad_position[optimizer.get_param_id(parameter)]
            if sub_group != index:
                raise CheckpointError(f"ZeRO-3 places a parameter of sub-group {index} in sub-group {sub_group}")
            start = optimizer._get_param_partition_rank(parameter) * length
            numel = min(length, parameter.ds_numel - start)
            if numel > 0:
                pieces.append(Piece(parameter, offset=offset, start=start, numel=numel))
        settings = _settings(optimizer, optimizer.sub_group_to_group_id[index])
        groups.append(OptimizerGroup(partition, list(group), pieces, settings))
    return groups


def device_kind(engine: Any) -> str:
    """'cuda' when the engine trains on a CUDA device, else 'cpu'."""
    device = getattr(engine, "device", "cpu")
    return "cuda" if str(getattr(device, "type", device)).startswith("cuda") else "cpu"


def tensor_rank(engine: Any) -> tuple[int, int]:
    """(rank, size) of this rank's tensor-parallel group ((0, 1) without one)."""
    grid = getattr(engine, "grid", None)
    if grid is None:
        return 0, 1
    return grid.get_slice_parallel_rank(), grid.get_slice_parallel_world_size()


def parameter_split(parameter: torch.nn.Parameter) -> TensorSplit | None:
    """How tensor parallelism splits it (`pipectl.models.tensor_parallel` marks its slices)."""
    return getattr(parameter, "tensor_parallel_split", None)


def _module_tensors(module: torch.nn.Module, trained: set[int]) -> dict[str, torch.Tensor]:
    """Persistent buffers and parameters no optimizer group holds, by state-dict name."""
    state = module.state_dict(keep_vars=True)
    return {name: value for name, value in state.items() if torch.is_tensor(value) and id(value) not in trained}


def _numbers(values: dict[str, Any]) -> dict[str, Any]:
    """The numeric entries (lists of numbers included) of an optimizer group or a loss scaler."""
    kept = {}
    for key, value in values.items():
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)):
            kept[key] = value
        elif isinstance(value, (tuple, list)) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            kept[key] = list(value)
    return kept


def _restore_rng(state: dict[str, Any], torch_state: torch.Tensor) -> None:
    import numpy as np

    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    # A copy with its own storage: set_rng_state reads from the storage's start, ignoring a view's
    # offset (measured: a view into a larger buffer gives 'Invalid mt19937 state', or a crash).
    torch.set_rng_state(torch_state.clone())


def _state_tensor(prepared: Any, partition: torch.Tensor) -> torch.Tensor:
    """The tensor a per-element optimizer state of `partition` is restored into: the one
    `prepare_states` made, else a new one."""
    if torch.is_tensor(prepared) and prepared.shape == partition.shape and prepared.dtype == partition.dtype:
        return prepared
    return torch.empty_like(partition)


def _write(target: torch.Tensor, values: torch.Tensor) -> None:
    """`target.copy_(values)`, skipped when `values` is `target` itself (what a live resize
    received straight into the engine's tensors is read from where it already lies)."""
    if (
        target.data_ptr() == values.data_ptr()
        and target.shape == values.shape
        and target.stride() == values.stride()
        and target.dtype == values.dtype
    ):
        return
    target.copy_(values)


# --------------------------------------------------------------------------- receiving in place


class TouchedMemory:
    """Host memory whose pages are touched already, handed out piece by piece (`take`).

    The first write to freshly allocated memory costs a page fault per 4 KiB page, several times
    what copying into touched pages costs. A rank that will build
    an engine in a live resize's pause allocates and touches this beforehand, while the job still
    trains; the engine's flat tensors and optimizer moments are then taken from it
    (`drawing_from`, `prepare_states`). A piece is never given back: the memory lives as long as
    any tensor taken from it. It may span several buffers (`together`), taken from in order.
    """

    ALIGN = 4096

    def __init__(self, nbytes: int = 0) -> None:
        # zeros: every page written (torch fills with the GIL released: a thread may do it)
        self.buffers = [torch.zeros(int(nbytes), dtype=torch.uint8)] if nbytes > 0 else []
        self.used = [0] * len(self.buffers)

    @classmethod
    def together(cls, *memories: "TouchedMemory | None") -> "TouchedMemory":
        joined = cls()
        for memory in memories:
            if memory is not None:
                joined.buffers += memory.buffers
                joined.used += memory.used
        return joined

    @classmethod
    def reusing(cls, engine: Any, keep: Iterable[torch.Tensor] = ()) -> "TouchedMemory | None":
        """The memory of an engine that trains no further: the flat copy of its model's parameters
        under ZeRO-1/2 in host memory (its largest group's), which a live resize's hand-over does
        not read (it moves the fp32 partition). None when there is none, or when it shares memory
        with a tensor of `keep` (what the hand-over still reads). What is taken from it holds
        whatever was there, not zeros: every taker writes it all."""
        flats = [
            flat for flat in getattr(engine.optimizer, "bit16_groups_flat", None) or []
            if torch.is_tensor(flat) and not flat.is_cuda and flat.is_contiguous()
        ]
        if not flats or is_zero3(engine):
            return None
        flat = max(flats, key=lambda t: t.numel() * t.element_size())
        storage = flat.untyped_storage().data_ptr()
        if any(t.untyped_storage().data_ptr() == storage for t in keep):
            return None
        memory = cls()
        memory.buffers, memory.used = [flat.detach().view(-1).view(torch.uint8)], [0]
        return memory

    @property
    def free_bytes(self) -> int:
        return sum(buffer.numel() - used for buffer, used in zip(self.buffers, self.used))

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """`numel` elements of `dtype` (zeros unless `reusing`), or None when too few bytes are left."""
        size = int(numel) * torch.empty((), dtype=dtype).element_size()
        for index, buffer in enumerate(self.buffers):
            start = -(-self.used[index] // self.ALIGN) * self.ALIGN
            if start + size <= buffer.numel():
                self.used[index] = start + size
                return buffer[start : start + size].view(dtype)
        return None


TOUCHED_MIN_NUMEL = 1 << 12  # smaller tensors are not worth a piece


@contextmanager
def drawing_from(memory: "TouchedMemory | None"):
    """While DeepSpeed's ZeRO-1/2 optimizer is built, its two large allocations (the flat copy of
    the stage's parameters, `flatten_dense_tensors`, and the fp32 partition cloned from it) are
    taken from `memory` when it has room, with the same values; everything else as usual."""
    if memory is None:
        yield
        return
    # DeepSpeed: imported by a rank once its environment is set (`dsinit`), never by this module's importers
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from torch.overrides import TorchFunctionMode

    class Drawn(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch._C._nn.flatten_dense_tensors and not kwargs:
                tensors = list(args[0])
                numel = sum(t.numel() for t in tensors)
                if numel >= TOUCHED_MIN_NUMEL and len({t.dtype for t in tensors}) == 1:
                    flat = memory.take(numel, tensors[0].dtype)
                    if flat is not None:
                        with torch.no_grad():
                            torch.cat([t.reshape(-1) for t in tensors], out=flat)
                        return flat
            elif func is torch.Tensor.clone and len(args) == 1 and not kwargs:
                source = args[0]
                if source.numel() >= TOUCHED_MIN_NUMEL and source.is_contiguous() and not source.is_cuda:
                    copy = memory.take(source.numel(), source.dtype)
                    if copy is not None:
                        with torch.no_grad():
                            copy = copy.view(source.shape).copy_(source)
                        return copy.requires_grad_(source.requires_grad)
            return func(*args, **kwargs)

    original = DeepSpeedZeroOptimizer.__init__

    def init(self, *args, **kwargs):
        with Drawn():
            original(self, *args, **kwargs)

    DeepSpeedZeroOptimizer.__init__ = init
    try:
        yield
    finally:
        DeepSpeedZeroOptimizer.__init__ = original


def prepare_states(engine: Any, states: list[list[str]], memory: "TouchedMemory | None" = None) -> None:
    """Make the optimizer's per-element state tensors of every group (`states[g]`: their names, as
    a checkpoint lists them) before they are written: `restore` fills these in place, so a live
    resize can receive the moments straight into them (`landing_sites`). DeepSpeed's optimizer
    makes them lazily at its first step; a checkpoint's restore sets them. From `memory` where it
    has room."""
    optimizer = engine.optimizer
    for group, linked in enumerate(optimizer_groups(engine)):
        partition = linked.partition
        held = optimizer.optimizer.state.setdefault(partition, {})
        for state in states[group] if group < len(states) else []:
            if not torch.is_tensor(held.get(state)) or held[state].shape != partition.shape:
                taken = memory.take(partition.numel(), partition.dtype) if memory is not None else None
                held[state] = taken.view(partition.shape) if taken is not None else torch.empty_like(partition)


def held_ranges(engine: Any) -> dict[str, tuple[int, int] | None]:
    """Per parameter of this engine's optimizer groups: the elements (start, count) whose
    optimizer state this rank keeps (its piece of the partition), None where it keeps none: what
    `restore` reads of each state besides the weights (`ShardReader.reads_for`'s `held`)."""
    names = engine.optimizer.param_names
    ranges: dict[str, tuple[int, int] | None] = {}
    for linked in optimizer_groups(engine):
        held = {id(piece.parameter): piece for piece in linked.pieces}
        for parameter in linked.parameters:
            piece = held.get(id(parameter))
            ranges[names[parameter]] = (piece.start, piece.numel) if piece is not None else None
    return ranges


def landing_sites(engine: Any) -> dict[str, dict[str, tuple[int, torch.Tensor]]]:
    """Where `restore` puts each parameter's values in this engine, where they can be received
    directly: per parameter name and state, (first element, flat view) meaning elements `first`
    .. `first + len(view)` of the parameter (flattened, whole) land in `view`. 'fp32': the model's
    own copy when it is fp32, whole on this rank (no tensor split) and not ZeRO-3's; a moment: this
    rank's piece of its partition (`prepare_states` made the tensors). A value received anywhere
    else is copied there by `restore`, as from a checkpoint file."""
    optimizer = engine.optimizer
    names = optimizer.param_names
    _, tensor_parallel = tensor_rank(engine)
    zero3 = is_zero3(engine)
    sites: dict[str, dict[str, tuple[int, torch.Tensor]]] = {}
    for linked in optimizer_groups(engine):
        moments = {
            key: value
            for key, value in optimizer.optimizer.state.get(linked.partition, {}).items()
            if torch.is_tensor(value) and value.shape == linked.partition.shape
        }
        held = {id(piece.parameter): piece for piece in linked.pieces}
        for parameter in linked.parameters:
            name = names[parameter]
            entry = sites.setdefault(name, {})
            data = parameter.data
            if (
                not zero3
                and (tensor_parallel == 1 or parameter_split(parameter) is None)
                and data.dtype == torch.float32
                and data.is_contiguous()
            ):
                entry[FP32] = (0, data.reshape(-1))
            piece = held.get(id(parameter))
            if piece is not None:
                for key, moment in moments.items():
                    entry[key] = (piece.start, moment.narrow(0, piece.offset, piece.numel))
    return sites


# --------------------------------------------------------------------------- restore


def uncovered(pieces: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The (start, length) runs of [0, size) that no (start, length) piece covers.

    >>> uncovered([(4, 4), (0, 2), (10, 2)], 16)
    [(2, 2), (8, 2), (12, 4)]
    >>> uncovered([(0, 8)], 8)
    []
    """
    gaps, position = [], 0
    for start, length in sorted(pieces):
        if start > position:
            gaps.append((position, start - position))
        position = max(position, start + length)
    if position < size:
        gaps.append((position, size - position))
    return gaps


def _coordinates(header: RankHeader) -> tuple[int, int, int]:
    return header.stage, header.data_parallel_rank, header.tp_rank


def _restore_group_settings(optimizer: Any, source: RankHeader, group: int, zero3: bool) -> None:
    """The optimizer group's hyperparameters as written (lr, betas, ...), in the types the optimizer keeps."""
    settings = optimizer.optimizer.param_groups[
        optimizer.sub_group_to_group_id[group] if zero3 else group
    ]
    for key, value in source.group_settings[group].items():
        if key in settings:
            settings[key] = tuple(value) if isinstance(settings[key], tuple) else value


def _restore_module_tensors(engine: Any, reader: ShardReader, trained: set[int]) -> None:
    """The persistent buffers and parameters no optimizer group holds, which its pieces do not bring."""
    for name, value in _module_tensors(engine.module, trained).items():
        stored = reader.module_tensor(name)
        if stored is None:
            raise CheckpointError(f"{reader.folder}: holds no module tensor {name!r} (written for another model?)")
        value.copy_(stored)


def _restore_counters(engine: Any, optimizer: Any, source: RankHeader) -> None:
    """The engine's step and sample counters, its learning-rate schedule and its loss scaler."""
    for key, value in source.engine_counters.items():
        setattr(engine, key, value)
    if engine.lr_scheduler is not None and source.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(source.lr_scheduler)
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None and source.loss_scaler:
        for key, value in source.loss_scaler.items():
            if hasattr(scaler, key):
                setattr(scaler, key, value)


def restore(engine: Any, reader: ShardReader, *, restore_rng: bool = True) -> RankHeader:
    """Load a checkpoint written in any layout into this rank's engine. Every rank (no collective).

    Returns the header of the file that rank 0 wrote (step, data position, schedule). Raises
    `CheckpointError` naming the parameter when the checkpoint does not fit this model.
    """
    optimizer = engine.optimizer
    names = optimizer.param_names
    tp_rank, tensor_parallel = tensor_rank(engine)
    source = reader.headers[0]
    groups = optimizer_groups(engine)
    zero3 = is_zero3(engine)
    if len(source.group_settings) != len(groups):
        raise CheckpointError(
            f"{reader.folder}: written with {len(source.group_settings)} optimizer groups, this engine has {len(groups)}"
        )
    trained: set[int] = set()
    with torch.no_grad():
        for group, linked in enumerate(groups):
            partition = linked.partition
            states = reader.states(group)
            # Written piece by piece below; only what no piece covers (alignment padding) is zeroed
            # after, instead of a whole pass of zeros first. Tensors `prepare_states` made are
            # written in place (a live resize received the moments straight into them).
            prepared = optimizer.optimizer.state.get(partition, {})
            flat = {state: _state_tensor(prepared.get(state), partition) for state in states[1:]}
            covered: list[tuple[int, int]] = []
            held = {id(piece.parameter): piece for piece in linked.pieces}
            for parameter in linked.parameters:
                trained.add(id(parameter))
                name = names[parameter]
                values = {FP32: reader.local(name, FP32, parameter_split(parameter), tensor_parallel, tp_rank)}
                if tuple(values[FP32].shape) != parameter_shape(parameter):
                    raise CheckpointError(
                        f"{reader.folder}: parameter {name!r} is {tuple(values[FP32].shape)} there, "
                        f"{parameter_shape(parameter)} in this model (written for another model?)"
                    )
                piece = held.get(id(parameter))
                if zero3:
                    if piece is not None:  # the model's copy is this partition (bf16/fp16: rounded)
                        local = values[FP32].reshape(-1).narrow(0, piece.start, piece.numel)
                        _write(parameter.ds_tensor.data.reshape(-1).narrow(0, 0, piece.numel), local)
                else:
                    _write(parameter.data, values[FP32])  # the model's copy (bf16/fp16: rounded like a step does)
                if piece is None:
                    continue
                start, numel, offset = piece.start, piece.numel, piece.offset
                _write(partition.narrow(0, offset, numel), values[FP32].reshape(-1).narrow(0, start, numel))
                covered.append((offset, numel))
                for state, buffer in flat.items():  # only the elements this rank keeps state for
                    part = reader.part(name, state, parameter_split(parameter), tensor_parallel, tp_rank, start, numel)
                    _write(buffer.narrow(0, offset, numel), part)
            for start, numel in uncovered(covered, partition.numel()):
                for buffer in flat.values():
                    buffer.narrow(0, start, numel).zero_()
            if flat:
                state = dict(flat)
                for key in source.group_scalars[group]:
                    # A copy: what the reader gives may be a view of memory the next checkpoint reuses.
                    state[key] = reader.tensor(0, group_tensor(group, f"state.{key}")).to(partition.device, copy=True)
                optimizer.optimizer.state[partition] = state
                if not zero3 and not hasattr(engine, "optimizer_groups"):
                    for piece in linked.pieces:  # DeepSpeed's views of each piece's moments
                        piece.parameter._hp_mapping.set_optim_state_fragment(partition, state)
                    optimizer._hp_optimizer_states_linked = True
            _restore_group_settings(optimizer, source, group, zero3)
        _restore_module_tensors(engine, reader, trained)
    _restore_counters(engine, optimizer, source)
    if restore_rng:
        # Its own generators when the layout is the one that wrote them (the file of this rank
        # number was written at the same stage, replica and tensor rank), else rank 0's.
        same = reader.world_size == engine.grid.world_size and _coordinates(
            reader.headers[engine.global_rank]
        ) == (engine.stage_id, engine.grid.get_data_parallel_rank(), tp_rank)
        index = engine.global_rank if same else 0
        _restore_rng(reader.headers[index].rng, reader.tensor(index, "rng.torch"))
    return source
