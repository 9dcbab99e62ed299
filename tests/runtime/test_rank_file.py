"""A rank file written in chunks and hashed as it is written: safetensors' own reader reads it."""

from __future__ import annotations

import hashlib
import os
import stat
import threading

import pytest
import torch
from safetensors import safe_open

from pipectl.errors import CheckpointError
from pipectl.runtime.checkpoint import shards
from pipectl.runtime.checkpoint.shards import HEADER_KEY, Fragment, RankHeader, write_rank_file


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "group0.fp32": torch.randn(1000, generator=generator),
        "group0.exp_avg": torch.randn(33, 7, generator=generator).to(torch.bfloat16),
        "module.half": torch.randn(5, generator=generator).to(torch.float16),
        "group0.state.step": torch.tensor(12.0),  # 0-d
        "rng.torch": torch.get_rng_state(),  # uint8
        "module.mask": torch.tensor([True, False, True]),
        "module.ids": torch.arange(9, dtype=torch.int64),
        "module.empty": torch.zeros(0, 4),
    }


def _header() -> RankHeader:
    fragment = Fragment(name="0.weight", group=0, offset=0, start=0, numel=1000, shape=(1000,), stage=0)
    return RankHeader(rank=1, stage=0, step=7, world_size=2, fragments=[fragment])


@pytest.mark.parametrize("chunk_bytes", [shards.WRITE_CHUNK_BYTES, 7])
def test_every_tensor_and_the_header_read_back_with_the_hash_of_the_bytes_on_disk(tmp_path, monkeypatch, chunk_bytes):
    monkeypatch.setattr(shards, "WRITE_CHUNK_BYTES", chunk_bytes)  # 7: every chunk boundary mid-element
    tensors = _tensors()
    path = tmp_path / "rank-00001.safetensors"
    written = write_rank_file(path, tensors, _header())
    data = path.read_bytes()
    assert written.size == len(data) == path.stat().st_size
    assert written.sha256 == hashlib.sha256(data).hexdigest()
    with safe_open(str(path), framework="pt") as handle:
        assert set(handle.keys()) == set(tensors)
        for name, tensor in tensors.items():
            read = handle.get_tensor(name)
            assert read.dtype == tensor.dtype and read.shape == tensor.shape and torch.equal(read, tensor), name
        assert RankHeader.from_json(handle.metadata()[HEADER_KEY]) == _header()


def test_the_written_bytes_are_handed_to_writeback_as_the_file_grows(tmp_path, monkeypatch):
    """Each flush-behind covers the bytes written since the one before, from the start of the file:
    the disk works while the rest is copied, instead of all of it in the closing fsync."""
    monkeypatch.setattr(shards, "WRITE_CHUNK_BYTES", 512)
    monkeypatch.setattr(shards, "FLUSH_BEHIND_BYTES", 1024)
    ranges = []
    monkeypatch.setattr(shards, "_flush_behind", lambda _descriptor, offset, length: ranges.append((offset, length)))
    written = write_rank_file(tmp_path / "r.safetensors", _tensors(), _header())
    assert len(ranges) >= 3 and ranges[0][0] == 0
    assert all(offset + length == following for (offset, length), (following, _) in zip(ranges, ranges[1:]))
    assert all(length >= 1024 for _offset, length in ranges)
    assert written.size - sum(length for _offset, length in ranges) < 1024 + 512


def test_the_file_takes_the_users_umask_and_no_thread_outlives_the_write(tmp_path):
    old = os.umask(0o027)
    try:
        before = threading.active_count()
        write_rank_file(tmp_path / "r.safetensors", _tensors(), _header())
        assert threading.active_count() == before
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.safetensors").stat().st_mode) == 0o640


def test_a_failed_write_raises_and_leaves_no_thread_behind(tmp_path):
    before = threading.active_count()
    with pytest.raises(FileNotFoundError):
        write_rank_file(tmp_path / "missing" / "r.safetensors", _tensors(), _header())
    assert threading.active_count() == before
    with pytest.raises(CheckpointError, match="complex64"):
        write_rank_file(tmp_path / "r.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)}, _header())


def test_the_host_buffers_of_state_the_first_step_creates_are_allocated_before_a_checkpoint():
    """Adam's moments appear at the first optimizer step: `covers` says their buffers are missing."""
    from types import SimpleNamespace

    from pipectl.runtime.checkpoint.shards import group_tensor
    from pipectl.runtime.checkpoint.snapshot import HostSnapshot

    partition = torch.zeros(6)
    linked = SimpleNamespace(partition=partition)
    state: dict = {}
    engine = SimpleNamespace(optimizer_groups=lambda: [linked], optimizer=SimpleNamespace(optimizer=SimpleNamespace(state=state)))
    host = HostSnapshot()
    assert host.covers(engine)  # before the first step: no state, nothing to allocate
    state[partition] = {"exp_avg": torch.zeros(6), "exp_avg_sq": torch.zeros(6), "step": torch.tensor(1.0)}
    assert not host.covers(engine)
    host._copy(group_tensor(0, "exp_avg"), state[partition]["exp_avg"])
    assert not host.covers(engine)
    host._copy(group_tensor(0, "exp_avg_sq"), state[partition]["exp_avg_sq"])
    assert host.covers(engine)  # the 0-d step is copied in the pause: no buffer worth allocating early
    state[partition]["exp_avg"] = torch.zeros(6, dtype=torch.float64)
    assert not host.covers(engine)


@pytest.mark.gpu
def test_side_stream_copies_hold_the_state_of_the_step_before_the_next_update():
    """A checkpoint's copies run beside the next step; the update that step makes waits for them,
    and that wait is the step's checkpoint phase, timed by the GPU's events."""
    from pipectl.runtime.checkpoint.snapshot import HostSnapshot, SideCopies
    from pipectl.runtime.engines.executor import TIMED_PHASES, DeviceTimes, TimedActions, wait_for_snapshot

    state = torch.randn(64 << 20, device="cuda")  # 256 MiB: the copy outlasts the enqueueing
    state.mul_(2.0)  # the optimizer step the checkpoint follows, still queued
    expected = (state.cpu())
    host, tensors = HostSnapshot(), {}
    side = SideCopies()
    host._copy_all(tensors, [("group0.fp32", state)], side)
    engine = TimedActions()
    engine.executed, engine.compute_slowdown, engine.device_times = [], 1.0, DeviceTimes()
    engine.phase_seconds, engine.snapshot_copied = dict.fromkeys(TIMED_PHASES, 0.0), side.done()
    wait_for_snapshot(engine)  # the next optimizer step
    state.add_(1.0)
    engine_copied = engine.snapshot_copied
    torch.cuda.synchronize()
    assert engine_copied is None and tensors["group0.fp32"].is_pinned()
    assert torch.equal(tensors["group0.fp32"], expected)
    engine.device_times.apply(engine)
    assert engine.phase_seconds["checkpoint"] > 0 and engine.phase_seconds["optimizer"] == 0


@pytest.mark.gpu
def test_a_gpu_ranks_action_times_are_the_gpus_not_the_hosts():
    """The host returns as soon as the kernels are queued; the events say how long the GPU ran them."""
    from types import SimpleNamespace

    from pipectl.runtime.engines.executor import TIMED_PHASES, DeviceTimes, begin, record_action
    from pipectl.schedule.ir import Action

    engine = SimpleNamespace(executed=[], phase_seconds=dict.fromkeys(TIMED_PHASES, 0.0))
    times = DeviceTimes()
    a = torch.randn(8192, 8192, device="cuda")
    a = a @ a.T / 8192  # cuBLAS's first product makes its handle on the host: not part of the timing
    torch.cuda.synchronize()
    began = begin(True)
    for _ in range(20):  # about 22 TFLOP: tens of milliseconds on any GPU, microseconds to queue
        a = a @ a.T / 8192
    record_action(engine.executed, Action.parse("0F0"), began.host, 1.0)
    times.action(0, began)
    phase = begin(True)
    torch.cuda._sleep(1_000_000)  # a wait the GPU does, as a receive does
    times.phase("p2p", phase)
    host_seconds = engine.executed[0].seconds
    times.apply(engine)
    assert engine.executed[0].seconds > 5 * host_seconds
    assert engine.phase_seconds["p2p"] > 0 and engine.phase_seconds["optimizer"] == 0
    assert times.actions == [] and times.phases == []
