"""In-memory recovery of a lost data-parallel replica: the ranks' side (`launch --recover-in-memory`).

Oobleck's observation: with data parallelism every stage's state lives on several replicas, so
the loss of one replica need not send the job back to its last checkpoint. pipectl's ranks train
with ZeRO-1, which keeps each replica's share of Adam's moments (and of the fp32 weights) on that
replica only; so every rank
also keeps a copy of its left neighbour's share (the rank of the previous replica at the same
stage and tensor rank), refreshed after each step (`PeerCopy`: one message each way per state
tensor, host memory), with its own share of the same instant: the engine moves on. When replica r
is lost, replica r + 1 holds a copy of everything r held, and the survivors together hold the whole
state of a step boundary.

How a loss plays out (the launcher's side is `resize/replicas.py`):

    agent       runs one torchrun per replica, so that torchrun, which stops every worker it
                started when one fails, stops only the lost replica's ranks
    survivors   their next collective with a lost rank fails ("Connection closed by peer"); each
                leaves its broken process group and waits for the agent (`await_request`)
    agent       sees the replica's torchrun exit, chooses the layout for the survivors from the
                morph table (the same global batch), rewrites the run files as a resize would and
                writes RUN/resize_requested.json naming the survivors (`LiveResizeRequest`)
    survivors   meet in a new group and hand over what they keep of every old rank's state (their
                own and their copies) at the newest step boundary where all of it is kept
                (`state_exchange.exchange`, the hand-over of a planned live resize), and go on in the new
                layout from there (`recover`): the step in flight when the replica was lost, or at
                most the one before, is trained again

A rank started this way numbers itself from the agent's variables (`adopt_replica_environment`):
its torchrun knows only its replica.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from pipectl.artifacts.layout import Layout
from pipectl.artifacts.morph import LiveResizeRequest

if TYPE_CHECKING:
    from pipectl.models.base import ModelLayers
    from pipectl.runtime.checkpoint.snapshot import Snapshot
    from pipectl.runtime.elastic.live_resize import HandOver, PauseClock

log = logging.getLogger(__name__)

# Set by the replicas agent for each replica's torchrun: the job's numbering of its ranks.
RANK_OFFSET_VARIABLE = "PIPECTL_RANK_OFFSET"
WORLD_SIZE_VARIABLE = "PIPECTL_WORLD_SIZE"
MASTER_ADDR_VARIABLE = "PIPECTL_MASTER_ADDR"
MASTER_PORT_VARIABLE = "PIPECTL_MASTER_PORT"

# What gloo and torch say when the peer at the other end of a connection is gone.
PEER_LOSS_WORDS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "socket closed",
    "read error",
    "write error",
)
REQUEST_WAIT_SECONDS = 90.0  # torchrun gives a lost replica's other ranks 30 s to exit before the agent knows
TAG_BASE = 0x5000  # message tags of the peer copy (the pipeline's own sends are all done by then)


def adopt_replica_environment() -> bool:
    """In a rank the replicas agent started: RANK, WORLD_SIZE and the group's address from the
    agent's variables (its torchrun numbered it within its replica only). Returns whether it was."""
    offset = os.environ.get(RANK_OFFSET_VARIABLE)
    if offset is None:
        return False
    rank = int(offset) + int(os.environ.get("LOCAL_RANK", "0"))
    world = os.environ[WORLD_SIZE_VARIABLE]
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),  # one host: the job's local ranks are its ranks
        WORLD_SIZE=world,
        LOCAL_WORLD_SIZE=world,
        MASTER_ADDR=os.environ[MASTER_ADDR_VARIABLE],
        MASTER_PORT=os.environ[MASTER_PORT_VARIABLE],
    )
    # The job's group has a store of its own (rank 0's), not this replica's torchrun's.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    return True


def under_agent() -> bool:
    """Whether this rank was started by the replicas agent (its loss and its peers' are recoverable)."""
    return RANK_OFFSET_VARIABLE in os.environ


def says_peer_loss(text: str) -> bool:
    """Whether an error's text (or a failure record's message) says a peer is gone.

    >>> says_peer_loss("Connection reset by peer"), says_peer_loss("loss is nan")
    (True, False)
    """
    return any(words in text.lower() for words in PEER_LOSS_WORDS)


def is_peer_loss(error: BaseException) -> bool:
    """Whether `error` (or what caused it) says a peer of a collective or a send is gone.

    >>> is_peer_loss(RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:41234"))
    True
    >>> is_peer_loss(MemoryError())
    False
    """
    seen = 0
    while error is not None and seen < 8:
        if says_peer_loss(str(error)):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def leave_broken_group() -> None:
    """Destroy this rank's process groups after a peer was lost: its sockets close, so that the
    survivors still waiting on this rank fail at once instead of at their collective timeout."""
    import torch.distributed as dist

    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # a broken group may not tear down cleanly; it is dropped either way
        log.warning("leaving the broken process group: %s", exc)


def await_request(run_dir: os.PathLike[str] | str, generation: int, stop: Any, timeout_seconds: float) -> LiveResizeRequest | None:
    """The agent's recovery request (newer than `generation`), or None if none comes within
    `timeout_seconds` or this rank is told to stop (its own replica is being ended)."""
    from pipectl.rundir.live_requests import read_request, request_path

    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        if request_path(run_dir).is_file():
            try:
                request = read_request(run_dir)
            except Exception as exc:  # being written, or damaged: the agent writes atomically
                log.debug("recovery request not read yet: %s", exc)
            else:
                if request.recovery and request.generation > generation:
                    return request
        time.sleep(0.05)
    return None


class PeerCopy:
    """This rank's copies, in host memory, of its own state and of its left neighbour's (same stage
    and tensor rank, previous replica) at the last two step boundaries where both were complete.

    Each `refresh` copies the engine's state, sends it to the right neighbour and receives the left
    one's, into the buffers of the older of the two kept boundaries. A rank lost during a refresh
    leaves the survivors the boundary before, complete on every rank: the engine's own state may
    already be a step further (or half updated, if the loss came inside the optimizer step), so a
    recovery never reads it. 2 x (own + neighbour's) = 48 B per parameter / d of host memory."""

    def __init__(self, layout: Layout, rank: int) -> None:
        import torch.distributed as dist

        from pipectl.runtime.checkpoint.snapshot import HostSnapshot
        from pipectl.runtime.engines.pipeline import planned_topology

        topology = planned_topology(layout.pipeline_parallel, layout.data_parallel, layout.tensor_parallel)
        coord = topology.get_coord(rank)
        d = layout.data_parallel

        def peer(offset: int) -> int:
            return topology.get_rank(**{**coord._asdict(), "data": (coord.data + offset) % d})

        self.right, self.left = peer(1), peer(-1)
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self._own = (HostSnapshot(), HostSnapshot())  # a real copy: the engine moves on
        self._theirs: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
        self.kept: list[tuple[int, int, list[Snapshot]]] = []  # (step, buffer set, [own, neighbour's]), oldest first

    def snapshots(self) -> list[Snapshot]:
        """Every state kept: this rank's own and its neighbour's, at each kept boundary."""
        return [snapshot for _, _, pair in self.kept for snapshot in pair]

    def refresh(self, engine: Any, step: int, data_position: dict[str, int]) -> None:
        """Keep this rank's state at `step` and its left neighbour's (sending it to the right one).
        Every rank of the job together (pairwise messages only)."""
        import torch

        from pipectl.runtime.checkpoint.snapshot import Snapshot
        from pipectl.runtime.checkpoint.shards import RankHeader

        slot = 1 - self.kept[-1][1] if self.kept else 0
        self.kept = [entry for entry in self.kept if entry[1] != slot]  # its buffers are rewritten now
        own = self._own[slot].capture(engine, step, data_position)
        keys = sorted(own.tensors)
        layouts = [[key, str(own.tensors[key].dtype).removeprefix("torch."), list(own.tensors[key].shape)] for key in keys]
        meta = json.dumps({"header": own.header.to_json(), "tensors": layouts}).encode()
        length = self._swap(torch.tensor([len(meta)], dtype=torch.int64), torch.empty(1, dtype=torch.int64), 0)
        text = self._swap(torch.frombuffer(bytearray(meta), dtype=torch.uint8), torch.empty(int(length.item()), dtype=torch.uint8), 1)
        theirs = json.loads(bytes(text.numpy()).decode())
        buffers, tensors = self._theirs[slot], {}
        for key, dtype, shape in theirs["tensors"]:
            buffer = buffers.get(key)
            if buffer is None or list(buffer.shape) != shape or str(buffer.dtype).removeprefix("torch.") != dtype:
                buffer = buffers[key] = torch.empty(shape, dtype=getattr(torch, dtype))
            tensors[key] = buffer
        works = [self._send(own.tensors[key], 2 + i) for i, key in enumerate(keys)]
        works += [self._recv(tensors[key], 2 + i) for i, (key, _, _) in enumerate(theirs["tensors"])]
        for work in works:
            work.wait()
        neighbour = Snapshot(tensors=tensors, header=RankHeader.from_json(theirs["header"]))
        self.kept.append((step, slot, [own, neighbour]))

    def _send(self, tensor, tag: int):
        import torch.distributed as dist

        return dist.isend(tensor, dst=self.right, tag=TAG_BASE + tag, group=self.group)

    def _recv(self, tensor, tag: int):
        import torch.distributed as dist

        return dist.irecv(tensor, src=self.left, tag=TAG_BASE + tag, group=self.group)

    def _swap(self, outgoing, incoming, tag: int):
        works = [self._send(outgoing, tag), self._recv(incoming, tag)]
        for work in works:
            work.wait()
        return incoming


def recover(
    peers: PeerCopy,
    request: LiveResizeRequest,
    layout: Layout,
    model: ModelLayers,
    timeout_seconds: float | None,
    clock: PauseClock,
) -> HandOver | None:
    """A survivor, its old group left: meet the other survivors, offer every state it keeps (its own
    and its neighbour's, at the last two boundaries) and receive what its rank of `layout` restores,
    from the newest boundary at which the survivors hold every old rank's state (`state_exchange.exchange`).
    Returns None for a survivor the new layout does not use (it exits 0). Raises `LaunchError`
    when there is no such boundary (the job then fails, and `launch --resume` restarts it from its
    last checkpoint)."""
    from pipectl.runtime.elastic.live_resize import HandOver, exchange_then_regroup, reform
    from pipectl.runtime.elastic.state_exchange import exchange

    me = request.survivors.index(int(os.environ["RANK"]))
    handed = HandOver(request, None, 0, clock)
    survivors = len(request.survivors)
    if request.to_devices < survivors:  # all meet to hand over, then the new layout's ranks regroup
        with clock.phase("group"):
            reform(request.master_addr, request.meeting_port, survivors, me, timeout_seconds)
        return exchange_then_regroup(handed, peers.snapshots(), layout, model, me, timeout_seconds, request.survivors)
    with clock.phase("group"):  # every survivor is a rank of the new layout: meet as that
        reform(request.master_addr, request.master_port, survivors, me, timeout_seconds)
    with clock.phase("exchange"):
        handed.reader, handed.bytes_moved = exchange(peers.snapshots(), layout, model, request.survivors)
    return handed
