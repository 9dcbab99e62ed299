"""A checkpoint as the ranks hold it: one safetensors file per rank, readable for any layout.

Each rank writes what it already holds, nothing gathered: its fp32 master partition of every
optimizer group and the optimizer's per-element state beside it (Adam's two moments), exactly as
DeepSpeed's ZeRO-1 optimizer keeps them, one flat tensor each; and, in the file's JSON header, an
index of the fragments: which slice of which flat tensor is which piece of which parameter.

    rank-00001.safetensors
      tensors  group0.fp32  group0.exp_avg  group0.exp_avg_sq   the flat partitions (+ padding)
               group0.state.step                                 per-group scalar optimizer state
               module.<name>                                     buffers and frozen parameters
               rng.torch                                         torch's CPU generator state
      header   {"pipectl": RankHeader as JSON}                   fragments, step, data position,
                                                                 learning-rate schedule, loss scale

A fragment says: parameter `name`, as held by pipeline stage `stage` and tensor rank `tp_rank` of
`tensor_parallel` (a slice of `shape`, split by `split`), elements `start` .. `start + numel` of
that slice flattened, lie at `offset` .. `offset + numel` of the rank's flat `group<g>` tensors.
Together the fragments of one parameter cover it once per data-parallel layout: ZeRO-1 spreads a
parameter's optimizer state over the data-parallel ranks, the tensor-parallel ranks hold one
slice each, and a tied module held by two stages appears twice (stage 0's copy is the trained one:
DeepSpeed keeps only the tied weight itself in sync on the other stage).

Reading is re-cutting. `ShardReader.whole(name, state)` assembles a parameter from the fragments
of every file (lowest stage, every tensor rank, every data-parallel piece) and joins its tensor
slices (`TensorSplit.join`); `ShardReader.local(...)` cuts the slice a loading rank needs
(`TensorSplit.cut`). A loading rank reads only the byte ranges of its own parameters (the files
are memory-mapped), so a resume into another pipeline, tensor or data-parallel degree needs no
conversion step and no second copy on disk. A live resize reads the ranks' states out of memory
with the same reader (`ShardReader.in_memory`, `runtime.elastic.live_resize`): one re-cutting routine for both.

Everything here is data: safetensors holds raw tensor bytes and a JSON header, so nothing in a
checkpoint can run code when it is read. No DeepSpeed in this module (`engine_state` maps a
DeepSpeed engine to and from these records).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import struct
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

import torch

from pipectl.artifacts.run import RANK_FILE
from pipectl.errors import CheckpointError
from pipectl.models.tensor_parallel import TensorSplit

HEADER_KEY = "pipectl"
FORMAT_VERSION = 1
FP32 = "fp32"  # the master weights' state name; the optimizer's own states use its key names


def group_tensor(group: int, state: str) -> str:
    """The flat tensor of optimizer group `group` holding `state` ('fp32', 'exp_avg', ...)."""
    return f"group{group}.{state}"


# --------------------------------------------------------------------------- the header


@dataclass(frozen=True)
class Fragment:
    """Elements `start` .. `start + numel` of parameter `name`'s (flattened) slice, stored at
    `offset` .. `offset + numel` of this rank's `group<group>.*` tensors."""

    name: str
    group: int
    offset: int
    start: int
    numel: int
    shape: tuple[int, ...]  # the slice this rank's module holds
    stage: int
    tp_rank: int = 0
    tensor_parallel: int = 1
    split: TensorSplit | None = None  # None: whole on every tensor rank


@dataclass
class RankHeader:
    """What a rank file holds besides its tensors (stored as JSON in the safetensors header)."""

    rank: int
    stage: int
    step: int
    world_size: int = 1
    data_parallel_rank: int = 0
    tp_rank: int = 0
    tensor_parallel: int = 1
    fragments: list[Fragment] = field(default_factory=list)
    group_states: list[list[str]] = field(default_factory=list)  # per group: the per-element states
    group_scalars: list[list[str]] = field(default_factory=list)  # per group: 0-d optimizer states
    group_settings: list[dict[str, Any]] = field(default_factory=list)  # lr, betas, ... (numbers)
    module_tensors: list[str] = field(default_factory=list)  # buffers and frozen parameters
    engine_counters: dict[str, int] = field(default_factory=dict)
    lr_scheduler: dict[str, Any] | None = None
    loss_scaler: dict[str, Any] | None = None
    rng: dict[str, Any] = field(default_factory=dict)  # python, numpy (torch's is the tensor rng.torch)
    data_position: dict[str, int] = field(default_factory=dict)
    format: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "RankHeader":
        raw = json.loads(text)
        if raw.get("format") != FORMAT_VERSION:
            raise ValueError(f"format {raw.get('format')!r}, this pipectl reads format {FORMAT_VERSION}")
        fragments = []
        for entry in raw.pop("fragments"):
            split = entry.pop("split")
            fragments.append(
                Fragment(**{**entry, "shape": tuple(entry["shape"])}, split=TensorSplit(**split) if split else None)
            )
        return cls(**raw, fragments=fragments)


# --------------------------------------------------------------------------- writing


# safetensors' names of the dtypes a checkpoint holds (the format: github.com/huggingface/safetensors,
# README "Format": 8 bytes of header length, the JSON header padded to 8 bytes, then the tensors' bytes).
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
# Bytes handed to the disk and to the hash at a time: large enough that a write and a hash update
# each cost one system call or one C loop, small enough that the two overlap over a shard.
WRITE_CHUNK_BYTES = 16 << 20
# Written bytes handed to the kernel's writeback at a time. Below the kernel's dirty threshold (a
# tenth of the host's memory by default: 12 GiB on a 128 GiB GPU host) nothing reaches the disk
# until the closing fsync, so a write took its copy into the page cache plus the flush, one after
# the other. Started as the file grows, the flush runs beside the copy and the hash (the flush-
# behind of PostgreSQL's checkpoint_flush_after and RocksDB's bytes_per_sync).
FLUSH_BEHIND_BYTES = 64 << 20


@dataclass(frozen=True)
class WrittenFile:
    """A rank file as written: its size and the sha256 of its bytes."""

    size: int
    sha256: str


def write_rank_file(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], header: RankHeader) -> WrittenFile:
    """Write one rank's tensors and header to `path` in the safetensors format, fsync it; its size
    and sha256.

    The bytes are hashed as they are written, on a second thread (hashlib and the write both run
    without the GIL): the save is bounded by the slower of the disk and one core's sha256, not by
    their sum plus a second read of the file. The file gets the user's umask, as every other file
    of the run (a group that shares the run directory shares its checkpoints); safetensors' own
    loader reads it (`ShardReader`)."""
    ordered = sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0]))  # aligned offsets
    views = [_byte_view(name, tensor) for name, tensor in ordered]
    head = _safetensors_header(ordered, [len(view) for view in views], {HEADER_KEY: header.to_json()})
    digest = hashlib.sha256()
    chunks: queue.Queue[memoryview | None] = queue.Queue(maxsize=4)
    hasher = threading.Thread(target=_hash_chunks, args=(chunks, digest), daemon=True, name="pipectl-hash")
    hasher.start()
    size = 0
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            flushed = 0
            for chunk in _chunks([memoryview(head), *views]):
                chunks.put(chunk)
                size += _write_all(descriptor, chunk)
                if size - flushed >= FLUSH_BEHIND_BYTES:
                    _flush_behind(descriptor, flushed, size - flushed)
                    flushed = size
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    finally:
        chunks.put(None)
        hasher.join()
    return WrittenFile(size, digest.hexdigest())


def _byte_view(name: str, tensor: torch.Tensor) -> memoryview:
    if tensor.dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"cannot write tensor '{name}': dtype {tensor.dtype} has no safetensors name")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _safetensors_header(ordered: list[tuple[str, torch.Tensor]], sizes: list[int], metadata: dict[str, str]) -> bytes:
    """The length prefix and the JSON header, padded with spaces to 8 bytes as safetensors pads it."""
    entries: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for (name, tensor), nbytes in zip(ordered, sizes):
        entries[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + nbytes]}  # fmt: skip
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _chunks(views: list[memoryview]) -> Iterable[memoryview]:
    for view in views:
        for start in range(0, len(view), WRITE_CHUNK_BYTES):
            yield view[start : start + WRITE_CHUNK_BYTES]


def _hash_chunks(chunks: queue.Queue, digest: Any) -> None:
    while (chunk := chunks.get()) is not None:
        digest.update(chunk)


def _flush_behind(descriptor: int, offset: int, length: int) -> None:
    """Start writing back `length` bytes at `offset` without waiting (Linux: POSIX_FADV_DONTNEED
    starts the writeback of dirty pages, then drops the range's clean ones); the closing fsync still
    waits for all of it. A no-op where the call is missing or refused."""
    try:
        os.posix_fadvise(descriptor, offset, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def _write_all(descriptor: int, chunk: memoryview) -> int:
    written = 0
    while written < len(chunk):  # a write may take fewer bytes than offered
        written += os.write(descriptor, chunk[written:])
    return written


# --------------------------------------------------------------------------- reading


class RankSource(Protocol):
    """One rank's tensors as a reader sees them: a safetensors file (`safe_open`) or memory."""

    def get_tensor(self, key: str) -> torch.Tensor: ...

    def get_slice(self, key: str) -> Any: ...  # indexable with [start:stop] along the flat tensor


class ShardReader:
    """Every rank file of a checkpoint folder, memory-mapped; parameters assembled on demand.

    >>> ShardReader("/nonexistent")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pipectl.errors.CheckpointError: /nonexistent: no rank files (rank-NNNNN.safetensors)
    """

    def __init__(self, folder: str | os.PathLike[str], files: Iterable[str] | None = None) -> None:
        from safetensors import safe_open

        folder = Path(folder)
        names = sorted(files) if files is not None else sorted(
            p.name for p in folder.glob("rank-*.safetensors") if RANK_FILE.fullmatch(p.name)
        )
        names = [n for n in names if RANK_FILE.fullmatch(Path(n).name)]
        if not names:
            raise CheckpointError(f"{folder}: no rank files (rank-NNNNN.safetensors)")
        handles, headers = [], []
        for name in names:
            path = folder / name
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
                header = RankHeader.from_json((handle.metadata() or {})[HEADER_KEY])
            except Exception as exc:  # a damaged or foreign file: named, never a traceback
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CheckpointError(f"{path}: not a pipectl rank file ({reason})") from None
            handles.append(handle)
            headers.append(header)
        self._index(folder, handles, headers)

    @classmethod
    def in_memory(cls, label: str, sources: Sequence[RankSource], headers: Sequence[RankHeader]) -> "ShardReader":
        """The same reader over rank states held in memory (a live resize: `runtime.elastic.live_resize`), one
        `RankSource` and header per rank of the layout that holds them; `label` names them in errors."""
        reader = cls.__new__(cls)
        reader._index(label, list(sources), list(headers))
        return reader

    def _index(self, folder: Path | str, sources: list[Any], headers: list[RankHeader]) -> None:
        self.folder = folder
        self._files = sources
        self.headers = headers
        self._by_name: dict[str, list[tuple[int, Fragment]]] = {}
        for index, header in enumerate(self.headers):
            for fragment in header.fragments:
                self._by_name.setdefault(fragment.name, []).append((index, fragment))
        self.step = self.headers[0].step
        self.world_size = len(self.headers)

    def parameter_names(self) -> list[str]:
        return sorted(self._by_name)

    def states(self, group: int = 0) -> list[str]:
        """'fp32' and the optimizer's per-element states of `group` (empty before its first step)."""
        return [FP32, *self.headers[0].group_states[group]] if group < len(self.headers[0].group_states) else [FP32]

    def tensor(self, rank_index: int, key: str) -> torch.Tensor:
        return self._files[rank_index].get_tensor(key)

    def module_tensor(self, name: str) -> torch.Tensor | None:
        """A buffer or frozen parameter, from the lowest stage that holds it (None if none does)."""
        holder = self.module_tensor_holder(name)
        return None if holder is None else self.tensor(holder, f"module.{name}")

    def _slices(self, name: str) -> tuple[Fragment, list[list[tuple[int, Fragment]]]]:
        """The fragments `whole` reads for `name`: those of the lowest stage holding it, per tensor
        slice (a tied module's other copies are not the trained one); and its first fragment."""
        holders = self._by_name.get(name)
        if not holders:
            raise CheckpointError(f"{self.folder}: holds no parameter {name!r} (written for another model?)")
        stage = min(fragment.stage for _, fragment in holders)
        first = next(fragment for _, fragment in holders if fragment.stage == stage)
        slices = [
            [(i, f) for i, f in holders if f.stage == stage and f.tp_rank == tp_rank]
            for tp_rank in range(first.tensor_parallel)
        ]
        return first, slices

    def whole(self, name: str, state: str = FP32) -> torch.Tensor:
        """Parameter `name`'s `state` as one tensor: every data-parallel piece, every tensor slice."""
        first, slices = self._slices(name)
        joined = [self._assemble(name, state, tp_rank, pieces) for tp_rank, pieces in enumerate(slices)]
        return first.split.join(joined) if first.split and len(joined) > 1 else joined[0]

    def module_tensor_holder(self, name: str) -> int | None:
        """The index of the file `module_tensor` reads `name` from: the lowest stage holding it."""
        holders = [(h.stage, i) for i, h in enumerate(self.headers) if name in h.module_tensors]
        return min(holders)[1] if holders else None

    def reads_for(
        self,
        names: Iterable[str],
        rng_of: Iterable[int] = (0,),
        held: dict[str, tuple[int, int] | None] | None = None,
    ) -> dict[int, list[tuple[str, int, int]]]:
        """What restoring the parameters and module tensors `names` reads, per rank index: element
        ranges `(key, start, stop)` of its flat tensors (stop -1: the whole tensor). Also rank 0's
        scalar optimizer states (every restore reads them) and the torch RNG of the ranks in
        `rng_of`. `held`: per parameter, the elements (start, count) of it whose optimizer state
        the restoring rank keeps (None: none), read with `part` where it can; without `held`, every
        state whole. A live resize moves exactly these ranges (`runtime.elastic.live_resize`); this is the one place
        that knows what `whole`, `part` and `module_tensor` read, so both paths read the same pieces.
        """
        reads: dict[int, list[tuple[str, int, int]]] = {}
        header = self.headers[0]
        for name in names:
            if name in self._by_name:
                first, slices = self._slices(name)
                for pieces in slices:
                    for index, fragment in pieces:
                        for state in self.states(fragment.group):
                            key = group_tensor(fragment.group, state)
                            lo, hi = fragment.offset, fragment.offset + fragment.numel
                            if state != FP32 and held is not None and name in held:
                                if held[name] is None:  # no state of it kept there
                                    continue
                                if self._partable(first, pieces):
                                    start, count = held[name]
                                    lo = fragment.offset + max(0, start - fragment.start)
                                    hi = fragment.offset + min(fragment.numel, start + count - fragment.start)
                                    if lo >= hi:
                                        continue
                            reads.setdefault(index, []).append((key, lo, hi))
            holder = self.module_tensor_holder(name)
            if holder is not None:
                reads.setdefault(holder, []).append((f"module.{name}", 0, -1))
        for group, scalars in enumerate(header.group_scalars):
            reads.setdefault(0, []).extend((group_tensor(group, f"state.{key}"), 0, -1) for key in scalars)
        for index in rng_of:
            reads.setdefault(index, []).append(("rng.torch", 0, -1))
        return {index: sorted(set(ranges)) for index, ranges in reads.items()}

    def _partable(self, first: Fragment, pieces: Sequence[tuple[int, Fragment]]) -> bool:
        """Whether `part` reads a range of `name` from its first tensor slice alone (it was whole on
        every tensor rank that wrote it)."""
        return first.split is None or first.tensor_parallel == 1

    def part(
        self, name: str, state: str, split: TensorSplit | None, tensor_parallel: int, rank: int, start: int, count: int
    ) -> torch.Tensor:
        """Elements `start` .. `start + count` of `local(...)` flattened, reading only the fragments
        that hold them where the parameter is whole both where it was written and here (else cut
        from `local`)."""
        first, slices = self._slices(name)
        if (split is not None and tensor_parallel > 1) or not self._partable(first, slices[0]):
            return self.local(name, state, split, tensor_parallel, rank).reshape(-1).narrow(0, start, count)
        parts, covered = [], []
        for index, fragment in sorted(slices[0], key=lambda item: item[1].start):
            lo, hi = max(start, fragment.start), min(start + count, fragment.start + fragment.numel)
            if lo < hi:
                source = self._files[index].get_slice(group_tensor(fragment.group, state))
                parts.append(source[fragment.offset + lo - fragment.start : fragment.offset + hi - fragment.start])
                covered.append((lo, hi))
        if sum(hi - lo for lo, hi in covered) != count:
            raise CheckpointError(
                f"{self.folder}: the files hold {sum(hi - lo for lo, hi in covered):,} of elements {start:,} .. "
                f"{start + count:,} of {name!r}; a rank's file is missing"
            )
        if len(parts) == 1:
            return parts[0]
        joined = _adjacent(parts, count)
        if joined is not None:
            return joined
        flat = torch.empty(count, dtype=parts[0].dtype)
        for (lo, hi), values in zip(covered, parts):
            flat[lo - start : hi - start] = values
        return flat

    def local(self, name: str, state: str, split: TensorSplit | None, tensor_parallel: int, rank: int) -> torch.Tensor:
        """The slice of `name` that tensor rank `rank` of `tensor_parallel` holds (split by `split`)."""
        whole = self.whole(name, state)
        return split.cut(whole, tensor_parallel, rank) if split is not None else whole

    def _assemble(self, name: str, state: str, tp_rank: int, pieces: list[tuple[int, Fragment]]) -> torch.Tensor:
        if not pieces:
            raise CheckpointError(f"{self.folder}: no file holds tensor slice {tp_rank} of {name!r}")
        shape = pieces[0][1].shape
        if len(pieces) == 1 and pieces[0][1].start == 0 and pieces[0][1].numel == math.prod(shape):
            # One fragment holds it all (one data-parallel rank, or a parameter no ZeRO boundary
            # cuts): its values as read, with no copy. Callers only read what they are given.
            index, fragment = pieces[0]
            source = self._files[index].get_slice(group_tensor(fragment.group, state))
            return source[fragment.offset : fragment.offset + fragment.numel].view(shape)
        ordered = sorted(pieces, key=lambda item: item[1].start)
        parts = [
            self._files[index].get_slice(group_tensor(fragment.group, state))[fragment.offset : fragment.offset + fragment.numel]
            for index, fragment in ordered
        ]
        joined = _adjacent(parts, math.prod(shape))
        if joined is not None:  # the pieces lie end to end in one tensor (received there: a live resize)
            return joined.view(shape)
        flat = None
        covered = 0
        for (index, fragment), values in zip(ordered, parts):
            if flat is None:
                flat = torch.empty(math.prod(shape), dtype=values.dtype)
            flat[fragment.start : fragment.start + fragment.numel] = values
            covered += fragment.numel
        if covered != math.prod(shape):
            raise CheckpointError(
                f"{self.folder}: the files hold {covered:,} of the {math.prod(shape):,} elements of {name!r} "
                f"(tensor slice {tp_rank}); a rank's file is missing"
            )
        return flat.view(shape)


def _adjacent(parts: list[torch.Tensor], numel: int) -> torch.Tensor | None:
    """One flat view over `parts` when they lie end to end in one storage and cover `numel`
    elements (else None): then nothing need be copied to join them."""
    if not parts or sum(p.numel() for p in parts) != numel or not all(torch.is_tensor(p) for p in parts):
        return None
    first = parts[0]
    position = first.data_ptr()
    for part in parts:
        if (
            part.dtype != first.dtype
            or not part.is_contiguous()
            or part.data_ptr() != position
            or part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
        ):
            return None
        position += part.numel() * part.element_size()
    return first.as_strided((numel,), (1,), first.storage_offset())


def whole_state(folder: str | os.PathLike[str], states: Iterable[str] = (FP32,)) -> dict[str, torch.Tensor]:
    """Every parameter whole, keyed 'name/state' (for comparisons and exports)."""
    reader = ShardReader(folder)
    return {f"{name}/{state}": reader.whole(name, state) for name in reader.parameter_names() for state in states}
