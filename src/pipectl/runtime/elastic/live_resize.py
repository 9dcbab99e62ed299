"""Live resize: the running job moves to another layout at a step boundary, in the same processes.

VirtualFlow's promise (Or et al., MLSys 2022; docs/design.md, 'Resize and recovery'): a job's devices change while it runs, and it is not restarted.
`pipectl resize RUN --devices N` (live by default for a job running here) writes the run files of
the new layout (plan.json, job.json, ds_config.json: what a restart would write) into RUN/live/next
(`STAGED_DIR`; rank 0 moves them into the run after the first step on the new layout), starts the
ranks that join (if N grows), waits until they have imported torch and DeepSpeed and built a
throw-away engine (`warm_up`), then writes RUN/resize_requested.json (`LiveResizeRequest`). At the
next step boundary the running ranks see it (it rides on the vote every boundary already has) and
hand over:

    old ranks   take their state (`snapshot.HostSnapshot`: weights, Adam's moments, schedule,
                RNG, the step: the instant a checkpoint holds; a CPU engine's tensors as they are,
                a GPU's copied to host memory)

When no rank leaves (a grow, or the same ranks in another layout) and the engine is on the CPU:

    all         re-form the process group as the new layout's world (the joining ranks have been
                waiting to enter it: `meet`) and build the new stage's engine at once (parameters
                undrawn, no model broadcast: every one is restored next). Its large tensors come
                from memory touched already (`engine_state.TouchedMemory`: a joining rank touched
                it before it said it was ready; a staying rank reuses its old engine's flat copy
                of the parameters, which the hand-over does not read), since the first write to
                fresh pages, not the copy, is what costs (page faults)
    all         learn every old rank's header (fragments: which slice of which flat tensor is
                which piece of which parameter) and every new rank's pieces (which elements of
                each parameter it keeps Adam's moments for) with one all-gather
    each        works out what its new stage's restore will read (`ShardReader.reads_for`, the
                reader's own choice of pieces) and receives exactly those element ranges, one
                message per fragment, straight into the engine's own tensors where the restore
                would write them (`engine_state.landing_sites`: the model's fp32 weights, its
                piece of Adam's moments, made beforehand by `engine_state.prepare_states`); the
                rest (a cut for a tensor split, buffers, RNG) into one receive buffer
    all         restore through `engine_state.restore` with the checkpoint's own re-cutting reader
                (`ShardReader.in_memory`), which finds the received values where they belong and
                copies only what is not there yet (the fp32 partition from the weights; a staying
                rank's own pieces)

A running rank that sees the request starts touching the memory its next engine takes
(`Preparation`, a thread, while the job trains on); the ranks take the resize at the first step
boundary where none is still preparing. On the CPU the old engine is let go after the first step
on the new layout, not in the pause.

Otherwise (ranks leave; or a GPU engine, whose device memory is freed first):

    all         meet in one process group: the old one when no rank joins, else the new layout's
                world (`meet`)
    all         learn every old rank's header with one all-gather
    each        receives exactly the element ranges its restore reads from the ranks holding
                them, point to point (one message per contiguous range, sent from the state
                itself, received into one buffer read in place), never through the disk
    leaving     ranks then exit 0
    staying     ranks re-form the process group for the new world and build the new stage's
                engine; all restore through `engine_state.restore`, reading the moved pieces with
                the checkpoint's own re-cutting reader (`ShardReader.in_memory`)

and training goes on at the next step with the same global batch (the data order is a function of
the step). Rank numbers are kept: a shrink keeps ranks 0 .. N-1, a grow adds ranks W .. N-1. Rank 0
appends the morph to RUN/morphs.jsonl after the first step on the new layout: path "live", the
pause (last step completed -> first step begun), its phases and the bytes moved; every rank logs
its phases.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from pipectl.artifacts.layout import Layout
from pipectl.artifacts.morph import LiveResizeRequest, MorphRecord
from pipectl.artifacts.plan import Plan
from pipectl.artifacts.run import JOB_FILE, JobSpec
from pipectl.errors import LaunchError
from pipectl.io import load_model

if TYPE_CHECKING:  # torch: only in the ranks (the CLI's resize reads this module's file names)
    from pipectl.models.base import ModelLayers
from pipectl.rundir.live_requests import RESIZE_PID_VARIABLE, files_of, read_request, ready_path, request_path
from pipectl.runtime.elastic.state_exchange import exchange

log = logging.getLogger(__name__)


class JoinAbandoned(LaunchError):
    """The live resize that started this joining rank ended before it asked the job to move: the
    rank leaves (exit 0, no failure record); the job never knew of it."""


# --------------------------------------------------------------------------- the hand-over


class PauseClock:
    """Seconds per phase of a live resize's pause, on one rank (for its log and rank 0's record)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - started

    def describe(self) -> str:
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases.items())


@dataclass
class HandOver:
    """What a rank of the new layout brings out of the hand-over: the old layout's state (the
    pieces it restores), and figures for the morph record."""

    request: LiveResizeRequest
    reader: Any  # shards.ShardReader over memory
    bytes_moved: int  # by all ranks together
    clock: PauseClock = field(default_factory=PauseClock)
    last_step_unix: float = 0.0  # when this rank finished its last step on the old layout
    host: Any = None  # the checkpointer's HostSnapshot a GPU engine was copied into (else None)
    built: Any = None  # (model, engine) of the new layout, built before the state moved into it
    retired: Any = None  # the old layout's session, let go after the first new step (worker)
    restored: float | None = None  # perf_counter when the restore ended (the "resume" phase's start)


def reform(
    address: str, port: int, world: int, rank: int, timeout_seconds: float | None, wait_seconds: float | None = None,
    give_up: Callable[[], None] | None = None,
) -> None:
    """Leave the current process group (if any) and enter the new layout's: `world` ranks meeting
    at `address:port`, rank 0 hosting the store (`meet`; `wait_seconds`: how long a rank other than
    0 waits for it to listen, default `timeout_seconds`)."""
    import torch.distributed as dist

    from pipectl.runtime.engines import dsinit

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
    )
    # torchrun's ranks meet in its agent's store; the new group has a store of its own.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    dsinit.init_distributed(timeout_seconds, store=meet(address, port, world, rank, timeout_seconds, wait_seconds, give_up))


PROBE_SECONDS = 0.005
JOIN_WAIT_TIMEOUTS = 3  # a joining rank waits this many collective timeouts for the running ranks


def meet(
    address: str, port: int, world: int, rank: int, timeout_seconds: float | None, wait_seconds: float | None = None,
    give_up: Callable[[], None] | None = None,
):
    """The new group's store: rank 0 serves it, the others connect once it listens. A joining rank
    waits here from the moment it is ready; it probes the port every 5 ms with a plain TCP connect
    instead of waiting in the store client's own retry loop, whose back-off (about 0.5 s between
    tries, measured) would be paid by every rank in the pause."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_seconds or 1800.0)
    if rank == 0:
        return dist.TCPStore(address, port, world, is_master=True, timeout=timeout, wait_for_workers=False)
    wait = wait_seconds if wait_seconds is not None else timeout.total_seconds()
    deadline = time.monotonic() + wait
    while True:
        try:
            socket.create_connection((address, port), timeout=1.0).close()
            break
        except OSError as exc:  # not listening yet
            if give_up is not None:
                give_up()
            if time.monotonic() > deadline:
                raise LaunchError(f"live resize: nothing listens at {address}:{port} after {wait:.0f} s ({exc})") from None
            time.sleep(PROBE_SECONDS)
    return dist.TCPStore(address, port, world, is_master=False, timeout=timeout)


def hand_over(
    engine: Any,
    step: int,
    data_position: dict[str, int],
    request: LiveResizeRequest,
    layout: Layout,
    model: ModelLayers,
    timeout_seconds: float | None,
    clock: PauseClock,
    host: Any = None,
    build: Callable[[Any], tuple[Any, Any]] | None = None,
    prepared: Any = None,
) -> HandOver | None:
    """A running rank at a step boundary: give its state to the new layout (`layout`, `model`: the
    job as the rewritten run files describe it). Returns None for a rank that leaves (its state
    has been sent; it exits 0), else what it restores from. Every old rank together. `host`: the
    checkpointer's `HostSnapshot`, whose buffers a GPU engine's state is copied into (allocated and
    touched already; kept by the next layout's checkpointer). `build(memory)`: builds this rank's
    engine of the new layout (its (model, engine), parameters undrawn); when no rank leaves, the
    ranks re-form the group, build it, and receive the state straight into it (`exchange`'s
    `into`; `HandOver.built`), its large tensors taken from `prepared` (`Preparation`'s memory)
    first."""
    import torch.distributed as dist

    from pipectl.runtime.checkpoint.engine_state import TouchedMemory, device_kind
    from pipectl.runtime.checkpoint.snapshot import HostSnapshot

    rank, old_world = dist.get_rank(), dist.get_world_size()
    if old_world != request.from_devices:
        raise LaunchError(f"live resize from {request.from_devices} ranks, but {old_world} are running")
    # The engine trains no further: a CPU engine's tensors are taken as they are; a GPU's are
    # copied into the checkpointer's host buffers (allocated and touched already), which the next
    # layout's checkpointer keeps.
    host = host if device_kind(engine) == "cuda" and host is not None else HostSnapshot(copy=False)
    handed = HandOver(request, None, 0, clock, host=host if host.copy else None)
    with clock.phase("capture"):
        snapshot = host.capture(engine, step, data_position)
    if request.to_devices >= old_world and build is not None and device_kind(engine) != "cuda":
        # Nobody leaves: every rank of the old group is one of the new. The new group first, then
        # the new stage's engine, then the state straight into it. (Not on a GPU: there the old
        # engine's device memory is let go before the new one is built.)
        with clock.phase("group"):
            reform(request.master_addr, request.master_port, request.to_devices, rank, timeout_seconds)
        with clock.phase("build"):
            # The old engine's flat copy of its parameters is touched memory the hand-over does not
            # read: the new engine's large tensors are taken from it first.
            memory = TouchedMemory.together(prepared, TouchedMemory.reusing(engine, snapshot.tensors.values()))
            handed.built = build(memory)
        with clock.phase("exchange"):
            handed.reader, handed.bytes_moved = exchange([snapshot], layout, model, into=(handed.built[1], memory))
        return handed
    if request.to_devices > old_world:  # ranks join: move the state inside the new world
        with clock.phase("group"):
            reform(request.master_addr, request.master_port, request.to_devices, rank, timeout_seconds)
        with clock.phase("exchange"):
            handed.reader, handed.bytes_moved = exchange([snapshot], layout, model)
        return handed
    # The old group holds every rank that gives or takes.
    return exchange_then_regroup(handed, [snapshot], layout, model, rank, timeout_seconds)


def exchange_then_regroup(
    handed: HandOver,
    held: Sequence[Any],
    layout: Layout,
    model: ModelLayers,
    rank: int,
    timeout_seconds: float | None,
    old_ranks: Sequence[int] | None = None,
) -> HandOver | None:
    """In a group of every rank that gives or takes: `exchange`, then leave (a rank of this group the
    new layout does not use: None) or re-form the group as the new layout's (`handed.request`)."""
    import torch.distributed as dist

    request = handed.request
    with handed.clock.phase("exchange"):
        handed.reader, handed.bytes_moved = exchange(held, layout, model, old_ranks)
    if rank >= request.to_devices:
        dist.destroy_process_group()
        return None
    with handed.clock.phase("group"):
        reform(request.master_addr, request.master_port, request.to_devices, rank, timeout_seconds)
    return handed


def warm_up(ds_config: dict[str, Any]) -> None:
    """Build and drop a DeepSpeed pipeline engine for a one-layer model on a private one-rank group,
    with the job's optimizer, ZeRO stage and precision: what an engine imports and sets up the
    first time it is built (most of it DeepSpeed's optimizer check importing torch's inductor) is
    then done before the hand-over, not in the running job's pause."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    from pipectl.runtime.engines import dsinit

    dsinit.set_rank_environment()
    dsinit.skip_shared_memory_op_build()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)  # adopts this group
    try:
        module = PipelineModule([LayerSpec(torch.nn.Linear, 4, 4)], num_stages=1, loss_fn=torch.nn.MSELoss())
        config = {
            key: ds_config[key]
            for key in ("optimizer", "zero_optimization", "bf16", "fp16", "gradient_clipping")
            if key in ds_config
        }
        config.update(train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
        deepspeed.initialize(model=module, config=config, model_parameters=list(module.parameters()))
    finally:
        dist.destroy_process_group()


def engine_bytes(layout: Layout, model: ModelLayers, rank: int) -> int:
    """About how many bytes the large tensors of rank `rank`'s engine of `layout` take under
    ZeRO-1/2: the flat copy of its stage's trained parameters and, for its data-parallel share, the
    fp32 partition and Adam's two moments (4-byte elements, alignment slack included). Counted on
    the meta device. 0 with a tensor split (what a rank holds then is not counted here)."""
    from pipectl.models.base import on_meta_device  # torch: only in the ranks
    from pipectl.runtime.engines.pipeline import planned_topology

    if layout.tensor_parallel > 1:
        return 0
    topology = planned_topology(layout.pipeline_parallel, layout.data_parallel, layout.tensor_parallel)
    start, stop = layout.stage_layers[topology.get_coord(rank).pipe]
    numel, ties = 0, set()
    with on_meta_device():
        for layer in model.layers[start:stop]:
            if layer.tie_key is not None:
                if layer.tie_key in ties:
                    continue
                ties.add(layer.tie_key)
            numel += sum(p.numel() for p in layer.build().parameters() if p.requires_grad)
    share = -(-numel // layout.data_parallel)
    return int(4 * (numel + 3 * share) * 1.01) + (16 << 20)


class Preparation:
    """A running rank's memory for its engine after a live resize (`engine_state.TouchedMemory`,
    `engine_bytes` of the layout the rewritten run files describe), touched in a thread while the
    job trains on. The ranks take the resize at the first step boundary where no rank is still
    preparing (`checkpoint.ranks.step_boundary`), so the pause writes into no fresh page."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, generation: int) -> None:
        self.generation = generation
        self.memory: Any = None
        self._thread = None
        try:
            nbytes = _prepared_bytes(Path(run_dir), rank)
        except Exception as exc:  # the hand-over then allocates as it goes
            log.warning("live resize: no memory prepared (%s)", exc)
            nbytes = 0
        if nbytes > 0:
            self._thread = threading.Thread(target=self._touch, args=(nbytes,), name="live-resize-memory", daemon=True)
            self._thread.start()

    def _touch(self, nbytes: int) -> None:
        from pipectl.runtime.checkpoint.engine_state import TouchedMemory  # torch: only in the ranks

        try:
            self.memory = TouchedMemory(nbytes)
        except Exception as exc:  # out of memory: the hand-over allocates as it goes
            log.warning("live resize: could not prepare %d MiB (%s)", nbytes >> 20, exc)

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def take(self) -> Any:
        """The touched memory (None if there is none), once."""
        if self._thread is not None:
            self._thread.join()
        memory, self.memory = self.memory, None
        return memory


def _prepared_bytes(run_dir: Path, rank: int) -> int:
    """`engine_bytes` for this rank in the layout of the pending request's run files; 0 where the
    hand-over builds its engine only after the exchange (ranks leave) or the rank leaves."""
    from pipectl.models import build_model  # torch: only in the ranks

    request = read_request(run_dir)
    if request.to_devices < request.from_devices or rank >= request.to_devices:
        return 0
    files = files_of(run_dir, request)
    job = load_model(JobSpec, files / JOB_FILE)
    plan = load_model(Plan, files / job.plan_file)
    layout = Layout.from_candidate(plan.chosen)
    if layout.world_size != request.to_devices:
        return 0
    return engine_bytes(layout, build_model(job.model, allow_shape_only=True), rank)


def join(
    run_dir: str | os.PathLike[str],
    layout: Layout,
    model: ModelLayers,
    ds_config: dict[str, Any],
    timeout_seconds: float | None,
    build: Callable[[Any], tuple[Any, Any]] | None = None,
) -> HandOver:
    """A joining rank (started by `pipectl resize --live`, RANK/WORLD_SIZE/MASTER_* of the new
    layout in its environment): warm up, touch the memory its engine will take
    (`engine_state.TouchedMemory`, `engine_bytes`), say it is ready, wait for the running ranks in
    the new world, then build its engine (`build(memory)`: its (model, engine)) and receive its
    share straight into it (`HandOver.built`). Without `build`, into a receive buffer."""
    from pipectl.runtime.checkpoint.engine_state import TouchedMemory  # torch: only in the ranks

    warm_up(ds_config)
    rank = int(os.environ["RANK"])
    memory = TouchedMemory(engine_bytes(layout, model, rank)) if build is not None else None
    path = ready_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n")
    # Returns when the running ranks have reached the hand-over (their request names the group):
    # the boundary after the one where they saw the request, once they have prepared their memory
    # (`Preparation`) during one more step; so up to two steps, each within the collective timeout.
    wait = JOIN_WAIT_TIMEOUTS * (timeout_seconds or 1800.0)
    reform(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), layout.world_size, rank, timeout_seconds, wait,
           give_up=_resize_ended_unasked(run_dir))
    request = read_request(run_dir)
    if request.to_devices != layout.world_size:
        raise LaunchError(f"live resize to {request.to_devices} ranks, but the run files describe {layout.world_size}")
    handed = HandOver(request, None, 0)
    if build is not None:
        with handed.clock.phase("build"):
            handed.built = build(memory)
    with handed.clock.phase("exchange"):
        into = (handed.built[1], memory) if handed.built is not None else None
        handed.reader, handed.bytes_moved = exchange([], layout, model, into=into)
    return handed


def _resize_ended_unasked(run_dir: str | os.PathLike[str]) -> Callable[[], None]:
    """For a joining rank waiting to enter the job: raise `JoinAbandoned` once the resize that
    started it (`RESIZE_PID_VARIABLE`) has ended without writing its request. A request written
    is the resize's commitment: the running ranks take it and wait for this rank, with or without
    the command that asked (looked at every quarter second)."""
    from pipectl.rundir.heartbeats import pid_alive

    text = os.environ.get(RESIZE_PID_VARIABLE, "")
    pid = int(text) if text.isdigit() else None
    looked = [0.0]

    def give_up() -> None:
        now = time.monotonic()
        if pid is None or now - looked[0] < 0.25:
            return
        looked[0] = now
        if not pid_alive(pid) and not request_path(run_dir).exists():
            raise JoinAbandoned(f"the live resize that started this rank (pid {pid}) ended before asking the job to move")

    return give_up


def finished_record(
    request: LiveResizeRequest,
    *,
    resume_step: int,
    pause_seconds: float,
    bytes_moved: int,
    first_step_unix: float,
    clock: PauseClock,
) -> MorphRecord:
    """The request's morph record with what the ranks measured (rank 0, after the first step)."""
    return request.record.model_copy(
        update={
            "pause_phases": {name: round(seconds, 4) for name, seconds in clock.phases.items()},
            "path": "live",
            "resume_step": resume_step,
            "stopped_running_job": False,
            "first_step_unix": first_step_unix,
            "downtime_seconds": max(0.0, first_step_unix - request.record.requested_unix),
            "pause_seconds": max(0.0, pause_seconds),
            "bytes_moved": bytes_moved,
        }
    )
