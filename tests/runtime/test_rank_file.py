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

    from pipectl.runtime.checkpoint.engine_state import HostSnapshot, group_tensor

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
