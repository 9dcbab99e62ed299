"""One rank's training state copied to host memory at a step boundary: `HostSnapshot.capture`.

The host buffers are allocated once and reused (pinned when the engine runs on a GPU), so the
training loop pauses only for the copy; on a GPU the copies run on a side stream beside the next
step (`SideCopies`). What is copied, and the inverse, are `engine_state`'s: the optimizer's flat
fp32 partitions and their states, the module's other tensors, the counters, schedule, loss scale
and RNG.
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from pipectl.runtime.checkpoint.engine_state import (
    ENGINE_COUNTERS,
    _module_tensors,
    _numbers,
    optimizer_groups,
    parameter_shape,
    parameter_split,
    tensor_rank,
)
from pipectl.runtime.checkpoint.shards import FP32, Fragment, RankHeader, group_tensor


@dataclass
class Snapshot:
    """One rank's state at one step boundary, in host memory: ready for `shards.write_rank_file`
    once `wait()` returns (at once, unless the copies run on a side stream: `HostSnapshot.capture`)."""

    tensors: dict[str, torch.Tensor]
    header: RankHeader
    copied: Any = None  # a CUDA event recorded after the side stream's last copy; None: copied already

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def wait(self) -> None:
        """Block until every tensor has landed in host memory."""
        if self.copied is not None:
            self.copied.synchronize()


class SideCopies:
    """Device-to-host copies on a stream of their own, overlapped with the next step.

    The stream first waits for everything the training stream has queued, the optimizer step
    included, so each copy reads the state after that step. What the next step's forward and
    backward may write (a module's buffers, e.g. a norm's running statistics) is copied first and
    the training stream waits for that (`fence_training`: small); the optimizer state, which only
    the next optimizer step writes, is copied after, and that step waits for the event `done`
    returns (`executor.wait_for_snapshot`). The host buffers are pinned, so the copies run on the
    copy engines, beside the compute.
    """

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())

    def fence_training(self) -> None:
        """The training stream waits for the copies enqueued so far."""
        torch.cuda.current_stream().wait_event(self.stream.record_event())

    def done(self) -> Any:
        return self.stream.record_event()


class HostSnapshot:
    """Host buffers reused from one checkpoint to the next (pinned when the engine is on a GPU).

    With `copy=False` a tensor already in host memory is taken as it is, not copied: for an engine
    that trains no further (a live resize hands its state over and drops it: its pause saves a copy
    of every tensor).

    The buffers of one snapshot are overwritten by the next `capture`: a caller must have finished
    writing a snapshot before taking another (the checkpointer keeps at most one save in flight).
    """

    def __init__(self, *, copy: bool = True) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.copy = copy

    def _copy(self, key: str, source: torch.Tensor) -> torch.Tensor:
        source = source.detach()
        if not self.copy and not source.is_cuda:
            return source  # host memory already, and its engine is done with it (a live resize)
        buffer = self._buffers.get(key)
        if not _holds(buffer, source):
            buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
            self._buffers[key] = buffer
        buffer.copy_(source, non_blocking=source.is_cuda)
        return buffer

    def covers(self, engine: Any) -> bool:
        """Whether every optimizer state tensor of `engine` has its host buffer already. Adam's
        moments appear at the first optimizer step, after `Checkpointer.prepare`: without their
        buffers the first checkpoint would allocate two thirds of its bytes in its pause (pinned
        allocation of gigabytes takes seconds on a GPU host)."""
        return all(
            _holds(self._buffers.get(group_tensor(group, key)), value)
            for group, linked in enumerate(optimizer_groups(engine))
            for key, value, per_element in _optimizer_states(engine, linked.partition)
            if per_element
        )

    def capture(self, engine: Any, step: int, data_position: dict[str, int], *, overlap: bool = False) -> Snapshot:
        """Copy this rank's weights, optimizer state, schedule, loss scale and RNG. Every rank,
        at a step boundary (no collective). With `overlap` and state on a GPU, the copies run on a
        side stream (`SideCopies`): the snapshot's `copied` event says when they have landed, and
        the engine's next optimizer step must wait for it; otherwise they have landed on return."""
        side = SideCopies() if overlap and _on_cuda(engine) else None
        optimizer = engine.optimizer
        names = optimizer.param_names
        stage = engine.stage_id
        tp_rank, tensor_parallel = tensor_rank(engine)
        tensors: dict[str, torch.Tensor] = {}
        header = RankHeader(
            rank=engine.global_rank,
            stage=stage,
            step=step,
            world_size=engine.grid.world_size,
            data_parallel_rank=engine.grid.get_data_parallel_rank(),
            tp_rank=tp_rank,
            tensor_parallel=tensor_parallel,
            data_position=dict(data_position),
        )
        trained: set[int] = set()
        state_sources: list[tuple[str, torch.Tensor]] = []  # what only the optimizer step writes
        for group, linked in enumerate(optimizer_groups(engine)):
            partition = linked.partition
            state_sources.append((group_tensor(group, FP32), partition))
            states, scalars = [], []
            for key, value, per_element in _optimizer_states(engine, partition):
                state_sources.append((group_tensor(group, key if per_element else f"state.{key}"), value))
                (states if per_element else scalars).append(key)
            header.group_states.append(states)
            header.group_scalars.append(scalars)
            header.group_settings.append(_numbers(linked.settings))
            trained.update(id(parameter) for parameter in linked.parameters)
            for piece in linked.pieces:
                header.fragments.append(
                    Fragment(
                        name=names[piece.parameter],
                        group=group,
                        offset=piece.offset,
                        start=piece.start,
                        numel=piece.numel,
                        shape=parameter_shape(piece.parameter),
                        stage=stage,
                        tp_rank=tp_rank,
                        tensor_parallel=tensor_parallel,
                        split=parameter_split(piece.parameter),
                    )
                )
        module_sources = []
        for name, value in _module_tensors(engine.module, trained).items():
            module_sources.append((f"module.{name}", value))
            header.module_tensors.append(name)
        self._copy_all(tensors, module_sources, side)
        if side is not None:
            side.fence_training()  # the next forward may write a module's buffers
        self._copy_all(tensors, state_sources, side)
        header.engine_counters = {key: int(getattr(engine, key)) for key in ENGINE_COUNTERS}
        if engine.lr_scheduler is not None:
            header.lr_scheduler = engine.lr_scheduler.state_dict()
        scaler = getattr(optimizer, "loss_scaler", None)
        if scaler is not None:
            header.loss_scaler = _numbers(vars(scaler))
        header.rng = _rng_state()
        tensors["rng.torch"] = self._copy("rng.torch", torch.get_rng_state())
        if side is not None:
            return Snapshot(tensors=tensors, header=header, copied=side.done())
        if any(t.is_pinned() for t in tensors.values()) and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies have landed
        return Snapshot(tensors=tensors, header=header)

    def _copy_all(self, tensors: dict[str, torch.Tensor], sources: list[tuple[str, torch.Tensor]],
                  side: SideCopies | None) -> None:  # fmt: skip
        with torch.cuda.stream(side.stream) if side is not None else nullcontext():
            for key, source in sources:
                tensors[key] = self._copy(key, source)


def _holds(buffer: torch.Tensor | None, source: torch.Tensor) -> bool:
    """Whether `buffer` can take a copy of `source` as it is (else a new one is allocated)."""
    return buffer is not None and buffer.shape == source.shape and buffer.dtype == source.dtype


def _optimizer_states(engine: Any, partition: torch.Tensor) -> list[tuple[str, torch.Tensor, bool]]:
    """The optimizer's tensors kept for a flat partition: (key, tensor, per element), per element
    when shaped as the partition (Adam's moments), else a 0-d scalar (its step); others are not
    checkpointed."""
    states = engine.optimizer.optimizer.state.get(partition, {})
    return [
        (key, value, value.shape == partition.shape)
        for key, value in states.items()
        if torch.is_tensor(value) and (value.shape == partition.shape or value.dim() == 0)
    ]


def _on_cuda(engine: Any) -> bool:
    return torch.cuda.is_available() and torch.device(getattr(engine, "device", "cpu")).type == "cuda"


def _rng_state() -> dict[str, Any]:
    import numpy as np

    version, keys, gauss = random.getstate()
    name, np_keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "python": [version, list(keys), gauss],
        "numpy": [name, [int(k) for k in np_keys], int(position), int(has_gauss), float(cached)],
    }
