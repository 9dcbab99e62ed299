"""What a live resize moves, and the exchange that moves it: every rank of the group learns who
holds which old rank's state, then each receives exactly the element ranges its new stage's restore
reads, point to point, never through the disk (`live_resize` drives it; its module docstring tells
the whole hand-over).

A range travels in one message (merged ranges, or one per fragment when the receiver's engine is
built, so that each lands where that engine keeps it: `engine_state.landing_sites`); what lands
nowhere in the engine goes into one receive buffer that the restore reads in place
(`ReceivedPieces`). Sender and receiver list a pair's messages alike, so a message's position is
its tag.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from pipectl.artifacts.layout import Layout
from pipectl.errors import LaunchError

if TYPE_CHECKING:  # torch: only in the ranks
    from pipectl.models.base import ModelLayers

MEMORY_LABEL = "the running ranks' memory (live resize)"


# --------------------------------------------------------------------------- what moves


def held_names(names: Iterable[str], model: ModelLayers, layout: Layout, rank: int) -> list[str]:
    """Of the parameter and module-tensor `names` (DeepSpeed's `PipelineModule` names: a layer's
    under its index, a tied module's under `tied_modules.KEY`), those rank `rank` of `layout` holds."""
    from pipectl.runtime.engines.pipeline import planned_topology

    topology = planned_topology(layout.pipeline_parallel, layout.data_parallel, layout.tensor_parallel)
    start, stop = layout.stage_layers[topology.get_coord(rank).pipe]
    ties = {layer.tie_key for layer in model.layers[start:stop] if layer.tie_key is not None}
    held = []
    for name in names:
        head, _, rest = name.partition(".")
        if head == "tied_modules":
            if rest.partition(".")[0] in ties:
                held.append(name)
        elif head.isdigit() and start <= int(head) < stop:
            held.append(name)
    return held


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # torch dtype name without 'torch.'
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _part(tensor, start: int, stop: int):
    flat = tensor.reshape(-1)
    return flat if stop < 0 else flat[start:stop]


def _range_numel(info: TensorInfo, start: int, stop: int) -> int:
    return info.numel if stop < 0 else stop - start


def merged(reads: Sequence[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Adjacent element ranges of one tensor joined (a rank that needs a whole partition gets one
    range per flat tensor): fewer messages. `reads` sorted, as `ShardReader.reads_for` gives them.

        >>> merged([("g.fp32", 0, 4), ("g.fp32", 4, 9), ("g.fp32", 12, 15), ("rng", 0, -1)])
        [('g.fp32', 0, 9), ('g.fp32', 12, 15), ('rng', 0, -1)]
    """
    joined: list[tuple[str, int, int]] = []
    for key, start, stop in reads:
        if joined and joined[-1][0] == key and joined[-1][2] == start and start >= 0 and stop >= 0:
            joined[-1] = (key, joined[-1][1], stop)
        else:
            joined.append((key, start, stop))
    return joined


ALIGN = 64  # bytes: every received range starts aligned, so it is viewed in its dtype without a copy


def placement(reads: Sequence[tuple[str, int, int]], infos: dict[str, TensorInfo]) -> tuple[list[tuple[int, int]], int]:
    """Where each range lies in the receive buffer: (byte offset, byte size) each, and the total."""
    places, offset = [], 0
    for key, start, stop in reads:
        size = _range_numel(infos[key], start, stop) * _dtype(infos[key].dtype).itemsize
        places.append((offset, size))
        offset += -(-size // ALIGN) * ALIGN
    return places, offset


def byte_view(tensor, start: int, stop: int):
    """Elements `start`..`stop` (stop -1: all) of `tensor`, as the bytes a message carries: a view,
    never a copy (every range is a contiguous piece of a flat tensor)."""
    import torch

    return _part(tensor, start, stop).view(torch.uint8)


class HeldTensors:
    """A rank's own snapshot, read in place (a `shards.RankSource`)."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def get_tensor(self, key: str):
        return self.tensors[key]

    def get_slice(self, key: str):
        return self.tensors[key].reshape(-1)


class ReceivedPieces:
    """Element ranges of another rank's tensors as received (a `shards.RankSource`): each range
    where it landed, in a receive buffer laid out by `placement` or straight in the engine's own
    tensors (`engine_state.landing_sites`), read in place."""

    def __init__(self, infos: dict[str, TensorInfo]) -> None:
        self.infos = infos
        self.pieces: dict[str, list[tuple[int, int, Any]]] = {}

    @classmethod
    def in_buffer(cls, buffer, reads: Sequence[tuple[str, int, int]], infos: dict[str, TensorInfo]) -> "ReceivedPieces":
        """`reads` received into one buffer laid out by `placement`."""
        received = cls(infos)
        places, total = placement(reads, infos)
        if buffer.numel() != total:
            raise LaunchError(f"live resize: a {buffer.numel()}-byte buffer for {total} bytes of pieces")
        for (key, start, stop), (offset, size) in zip(reads, places):
            received.add(key, start, stop, buffer[offset : offset + size])
        return received

    def add(self, key: str, start: int, stop: int, landed) -> None:
        """Elements `start` .. `stop` (stop -1: all) of `key`, received into the bytes `landed`."""
        info = self.infos[key]
        first, last = (0, info.numel) if stop < 0 else (start, stop)
        self.pieces.setdefault(key, []).append((first, last, landed.view(_dtype(info.dtype))))

    def get_tensor(self, key: str):
        info = self.infos[key]
        for first, last, values in self.pieces.get(key, []):
            if first == 0 and last == info.numel:
                return values.view(info.shape)
        raise KeyError(f"{key}: not received whole")

    def get_slice(self, key: str):
        return _Pieces(key, self.pieces.get(key, []))


class _Pieces:
    def __init__(self, key: str, pieces: list[tuple[int, int, Any]]) -> None:
        self.key = key
        self.pieces = pieces

    def __getitem__(self, index: slice):
        for first, last, values in self.pieces:
            if first <= index.start and index.stop <= last:
                return values[index.start - first : index.stop - first]
        raise KeyError(f"{self.key}[{index.start}:{index.stop}]: not received")


def exchange(
    held: Sequence[Any],
    layout: Layout,
    model: ModelLayers,
    old_ranks: Sequence[int] | None = None,
    into: tuple[Any, Any] | None = None,
):
    """Every rank of the current process group: learn which rank holds which old rank's state at
    which step (`held`: the `Snapshot`s this rank offers, each naming its old rank and step in its
    header: its own state, and after a loss the copies it keeps; none for a joining rank), take the
    newest step at which some rank holds every old rank's state, then send and receive exactly what
    each rank of `layout` restores. `old_ranks`: the old rank each rank of this group was (default:
    the same number). `into`: (engine, `engine_state.TouchedMemory` or None) of this rank's new
    layout, built already; given by every rank of the group or by none. Then each range moves in
    its own message (one fragment of one state) and is received straight into the engine's tensor
    that the restore writes it to (`engine_state.landing_sites`: the model's fp32 weights, this
    rank's piece of Adam's moments, made here by `engine_state.prepare_states`), so the restore
    finds it in place and copies nothing; the rest (a cut for a tensor split, buffers, RNG) lands in
    a receive buffer as without `into`. Returns (reader over the received state or None for a
    leaving rank, bytes moved by all ranks)."""
    import torch
    import torch.distributed as dist

    from pipectl.runtime.checkpoint.shards import ShardReader  # torch: only in the ranks

    me = dist.get_rank()
    offers, held_by = _gather_offers(held, into, old_ranks)
    step, old_world = _newest_complete_step(offers)
    holder = [offers[(old, step)][0] for old in range(old_world)]
    ordered = [offers[(old, step)][1] for old in range(old_world)]
    infos = [
        {key: TensorInfo(dtype, tuple(shape)) for key, (dtype, shape) in offers[(old, step)][2].items()}
        for old in range(old_world)
    ]
    mine_at = {(s.header.rank, s.header.step): s for s in held}
    mine = {old: mine_at[(old, step)] for old in range(old_world) if holder[old] == me}  # what this rank serves
    routes = _Routes(_reads_by_rank(ordered, held_by, model, layout), holder, merge=into is None)

    # One message per range (merged ones; one per fragment when the receivers' engines are built,
    # so each can land where its engine keeps it), sent from the held state itself.
    works, sent = [], 0
    for rank in routes.plan:
        if rank != me:
            for tag, (old, key, start, stop) in enumerate(routes.messages(me, rank)):
                message = byte_view(mine[old].tensors[key], start, stop)
                works.append(dist.isend(message, dst=rank, tag=tag))
                sent += message.numel()
    sources: list[Any] = [None] * old_world
    if me < layout.world_size:
        landing = _Landing(into, ordered) if into is not None else None
        works += _post_receives(me, routes, mine, infos, landing, sources)
    for work in works:
        work.wait()
    total = torch.tensor([sent], dtype=torch.int64)  # exact: a float32 sum rounds gigabytes
    dist.all_reduce(total)
    reader = ShardReader.in_memory(MEMORY_LABEL, sources, ordered) if me < layout.world_size else None
    return reader, int(total.item())


def _gather_offers(
    held: Sequence[Any], into: tuple[Any, Any] | None, old_ranks: Sequence[int] | None
) -> tuple[dict[tuple[int, int], tuple[int, Any, Any]], list[Any]]:
    """One all-gather: (old rank, step) -> (the rank holding that state, its header, its tensors'
    dtypes and shapes), a rank's own state preferred to anyone's copy of it; and per rank of the
    group, the elements of each parameter it keeps Adam's moments for (None: engine not built)."""
    import torch.distributed as dist

    from pipectl.runtime.checkpoint import engine_state  # torch: only in the ranks
    from pipectl.runtime.checkpoint.shards import RankHeader

    offered_here = [
        (s.header.to_json(), {key: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for key, t in s.tensors.items()})
        for s in held
    ]
    # With its engine built, a rank also says which elements of each parameter it keeps Adam's
    # moments for: only those of the moments move to it.
    held_here = engine_state.held_ranges(into[0]) if into is not None else None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (offered_here, held_here))
    offers: dict[tuple[int, int], tuple[int, RankHeader, Any]] = {}
    for rank, (offered, _) in enumerate(gathered):
        for text, layouts in offered:
            header = RankHeader.from_json(text)
            key = (header.rank, header.step)
            own = header.rank == (old_ranks[rank] if old_ranks is not None and rank < len(old_ranks) else rank)
            if key not in offers or own:  # a rank's own state before anyone's copy of it
                offers[key] = (rank, header, layouts)
    return offers, [held for _, held in gathered]


def _newest_complete_step(offers: dict[tuple[int, int], Any]) -> tuple[int, int]:
    """(The newest step at which some rank holds every old rank's state, the old world size)."""
    worlds = {header.world_size for _, header, _ in offers.values()}
    if len(worlds) != 1:
        raise LaunchError(f"live resize: the states offered come from layouts of {sorted(worlds) or 'no'} ranks")
    old_world = worlds.pop()
    steps = sorted({step for _, step in offers}, reverse=True)
    step = next((s for s in steps if all((old, s) in offers for old in range(old_world))), None)
    if step is None:
        held_at = {s: sorted(old for old, at in offers if at == s) for s in steps}
        raise LaunchError(
            f"live resize: no step at which the state of every one of the {old_world} old ranks is held "
            f"(ranks held per step: {held_at})"
        )
    return step, old_world


def _reads_by_rank(
    ordered: Sequence[Any], held_by: Sequence[Any], model: ModelLayers, layout: Layout
) -> dict[int, dict[int, list[tuple[str, int, int]]]]:
    """New rank -> old rank -> the (key, start, stop) ranges its restore reads (`ShardReader.reads_for`)."""
    from pipectl.runtime.checkpoint.shards import ShardReader  # torch: only in the ranks

    old_world = len(ordered)
    index = ShardReader.in_memory(MEMORY_LABEL, [None] * old_world, ordered)
    names = set(index.parameter_names())
    for header in ordered:
        names.update(header.module_tensors)
    return {
        rank: index.reads_for(
            held_names(sorted(names), model, layout, rank),
            rng_of={0, rank} & set(range(old_world)),
            held=held_by[rank] if rank < len(held_by) else None,
        )
        for rank in range(layout.world_size)
    }


@dataclass
class _Routes:
    """Who sends whom which ranges: `plan` (new rank -> old rank -> ranges) served by `holder[old]`."""

    plan: dict[int, dict[int, list[tuple[str, int, int]]]]
    holder: list[int]
    merge: bool  # merged ranges; not when the receivers' engines are built (one per fragment)

    def ranges(self, reads: Sequence[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
        return merged(reads) if self.merge else list(reads)  # every rank of the group alike

    def messages(self, sender: int, receiver: int) -> list[tuple[int, str, int, int]]:
        """The ranges `sender` sends `receiver`, old rank by old rank: both sides list them alike,
        so a range's position is its tag."""
        reads = self.plan.get(receiver, {})
        return [(old, *piece) for old in sorted(reads) if self.holder[old] == sender for piece in self.ranges(reads[old])]


def _post_receives(
    me: int, routes: _Routes, mine: dict[int, Any], infos: list[dict[str, TensorInfo]],
    landing: "_Landing | None", sources: list[Any],
) -> list[Any]:
    """Post this rank's receives, each straight into its landing site in the new engine or into
    one receive buffer per old rank; fill `sources` (per old rank: what the restore reads) and
    return the pending receives."""
    import torch
    import torch.distributed as dist

    received: dict[int, ReceivedPieces] = {}
    destinations: dict[tuple[int, str, int, int], Any] = {}  # message -> the bytes it is received into
    for old in routes.plan[me]:
        if routes.holder[old] == me:
            sources[old] = HeldTensors(mine[old].tensors)
            continue
        received[old] = sources[old] = ReceivedPieces(infos[old])
        reads = routes.ranges(routes.plan[me][old])
        sites = [landing.site(old, key, start, stop, infos[old][key]) if landing else None for key, start, stop in reads]
        # What lands nowhere in the engine: one receive buffer, read in place by the restore.
        rest = [read for read, site in zip(reads, sites) if site is None]
        places, total = placement(rest, infos[old])
        buffer = torch.empty(total, dtype=torch.uint8)
        spots = iter(places)
        for (key, start, stop), site in zip(reads, sites):
            if site is None:
                offset, size = next(spots)
                site = buffer[offset : offset + size]
            else:
                site = site.view(torch.uint8)
            received[old].add(key, start, stop, site)
            destinations[(old, key, start, stop)] = site
    works = []
    for sender in sorted({routes.holder[old] for old in received}):
        for tag, message in enumerate(routes.messages(sender, me)):
            works.append(dist.irecv(destinations[message], src=sender, tag=tag))
    return works


class _Landing:
    """Where a received range can land in this rank's new engine: the fragment it carries (from
    the sender's header) matched with the engine's `landing_sites`."""

    def __init__(self, into: tuple[Any, Any], headers: Sequence[Any]) -> None:
        from pipectl.runtime.checkpoint import engine_state  # torch: only in the ranks

        engine, memory = into
        engine_state.prepare_states(engine, headers[0].group_states, memory)
        self.sites = engine_state.landing_sites(engine)
        self.fragments: list[dict[int, tuple[list[int], list[Any]]]] = []  # per old rank, per group: offsets, fragments
        for header in headers:
            groups: dict[int, list[Any]] = {}
            for fragment in sorted(header.fragments, key=lambda f: f.offset):
                groups.setdefault(fragment.group, []).append(fragment)
            self.fragments.append({group: ([f.offset for f in listed], listed) for group, listed in groups.items()})

    def site(self, old: int, key: str, start: int, stop: int, info: TensorInfo):
        """The engine's elements range (`key`, `start`, `stop`) of old rank `old` is received into,
        or None."""
        group, _, state = key.partition(".")
        if stop < 0 or not group.startswith("group") or not group[5:].isdigit():
            return None
        offsets, fragments = self.fragments[old].get(int(group[5:]), ([], []))
        at = bisect.bisect_right(offsets, start) - 1
        fragment = fragments[at] if at >= 0 else None
        if fragment is None or stop > fragment.offset + fragment.numel:
            return None
        first_element = fragment.start + start - fragment.offset  # of the parameter, flattened
        if fragment.tensor_parallel != 1:
            return None
        first, view = self.sites.get(fragment.name, {}).get(state, (0, None))
        if view is None or view.dtype != _dtype(info.dtype):
            return None
        if first_element < first or first_element + (stop - start) > first + view.numel():
            return None
        return view.narrow(0, first_element - first, stop - start)
