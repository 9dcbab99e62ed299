"""A live resize's pieces without processes: what moves is exactly what a restore reads, read with
the checkpoint's own reader over memory; which names a new rank holds; the request a rank takes."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors import safe_open

from pipectl.artifacts.layout import Layout
from pipectl.artifacts.morph import LIVE_REQUEST_FILE, LiveResizeRequest, MorphRecord
from pipectl.io import write_json_atomic
from pipectl.models import build_model
from pipectl.runtime.checkpoint import ranks as checkpoint
from pipectl.rundir import checkpoints
from pipectl.runtime.elastic import state_exchange as live
from pipectl.rundir import live_requests
from pipectl.artifacts.run import rank_file_name
from pipectl.runtime.checkpoint.shards import FP32, HEADER_KEY, RankHeader, ShardReader
from builders import gpt_tiny_candidate, shard_model as model, write_shard_layout as write_layout


def rank_states(folder, ranks: int) -> tuple[list[RankHeader], list[dict[str, torch.Tensor]]]:
    """What each rank held (its header and tensors), as a rank would have it in memory."""
    headers, tensors = [], []
    for rank in range(ranks):
        with safe_open(str(folder / rank_file_name(rank)), framework="pt") as handle:
            headers.append(RankHeader.from_json(handle.metadata()[HEADER_KEY]))
            tensors.append({key: handle.get_tensor(key) for key in handle.keys()})
    return headers, tensors


def infos_of(tensors: dict[str, torch.Tensor]) -> dict[str, live.TensorInfo]:
    return {key: live.TensorInfo(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for key, t in tensors.items()}


@pytest.mark.parametrize("t, d", [(1, 1), (2, 3), (4, 2)])
def test_the_pieces_a_rank_receives_are_what_its_restore_reads(tmp_path, t, d):
    parameters = model()
    ranks = write_layout(tmp_path, parameters, t=t, d=d)
    headers, tensors = rank_states(tmp_path, ranks)
    on_disk = ShardReader(tmp_path)
    wanted = ["3.qkv.weight", "tied_modules.embed.weight"]

    index = ShardReader.in_memory("memory", [None] * ranks, headers)
    reads = index.reads_for(wanted)
    sources = [None] * ranks
    moved = 0
    for holder, ranges in reads.items():
        ranges = live.merged(ranges)
        places, total = live.placement(ranges, infos_of(tensors[holder]))
        buffer = torch.empty(total, dtype=torch.uint8)
        for (key, start, stop), (offset, size) in zip(ranges, places):  # one message per range
            message = live.byte_view(tensors[holder][key], start, stop)
            buffer[offset : offset + size] = message
            moved += message.numel()
        sources[holder] = live.ReceivedPieces.in_buffer(buffer, ranges, infos_of(tensors[holder]))
    received = ShardReader.in_memory("memory", sources, headers)

    for name in wanted:
        for state in (FP32, "exp_avg"):
            assert torch.equal(received.whole(name, state), on_disk.whole(name, state)), (name, state)
    assert torch.equal(received.tensor(0, "rng.torch"), tensors[0]["rng.torch"])
    with pytest.raises(KeyError, match="not received"):
        received.whole("3.proj.weight")  # no rank asked for it, so nothing of it moved
    everything = sum(v.numel() * v.element_size() for held in tensors for v in held.values())
    assert 0 < moved < everything


@pytest.mark.parametrize("t, d", [(1, 1), (1, 3), (2, 3)])
def test_a_rank_keeping_part_of_the_moments_receives_only_that_part_and_reads_it_as_from_disk(tmp_path, t, d):
    parameters = model()
    ranks = write_layout(tmp_path, parameters, t=t, d=d)
    headers, tensors = rank_states(tmp_path, ranks)
    on_disk = ShardReader(tmp_path)
    name = "3.qkv.weight"
    numel = on_disk.whole(name).numel()
    held = {name: (numel // 3, numel // 2), "tied_modules.embed.weight": None}  # a middle piece; no moments

    index = ShardReader.in_memory("memory", [None] * ranks, headers)
    reads = index.reads_for(sorted(held), held=held)
    sources = [None] * ranks
    for holder, ranges in reads.items():  # one message per fragment's range, as into a built engine
        received = live.ReceivedPieces(infos_of(tensors[holder]))
        for key, start, stop in ranges:
            received.add(key, start, stop, live.byte_view(tensors[holder][key], start, stop).clone())
        sources[holder] = received
    received = ShardReader.in_memory("memory", sources, headers)

    start, count = held[name]
    expected = on_disk.whole(name, "exp_avg").reshape(-1)[start : start + count]
    assert torch.equal(received.part(name, "exp_avg", None, 1, 0, start, count), expected)
    assert torch.equal(on_disk.part(name, "exp_avg", None, 1, 0, start, count), expected)
    assert torch.equal(received.whole(name), on_disk.whole(name))  # the weights move whole
    moments = [r for ranges in reads.values() for r in ranges if r[0].endswith("exp_avg")]
    assert sum(stop - first for _, first, stop in moments) == (count if t == 1 else numel)  # a split slice moves whole
    with pytest.raises(KeyError, match="not received"):
        received.whole("tied_modules.embed.weight", "exp_avg")  # kept nowhere here: not moved


def test_a_rank_holds_its_stage_layers_and_the_ties_its_layers_use():
    gpt = build_model("gpt-tiny")  # embed (tie 'embed'), block.0-5, final_norm, head (tie 'embed')
    names = ["tied_modules.embed.weight", "1.attn.qkv.weight", "3.ln.bias", "4.attn.qkv.weight", "7.weight"]
    p2 = Layout.from_candidate(gpt_tiny_candidate(2, 1))  # stages [0, 4) and [4, 9)
    assert live.held_names(names, gpt, p2, 0) == ["tied_modules.embed.weight", "1.attn.qkv.weight", "3.ln.bias"]
    assert live.held_names(names, gpt, p2, 1) == ["tied_modules.embed.weight", "4.attn.qkv.weight", "7.weight"]
    d2 = Layout.from_candidate(gpt_tiny_candidate(1, 2, m=2))  # replica-major: rank 1 is replica 1's stage 0
    assert live.held_names(names, gpt, d2, 1) == names


def request(generation: int) -> LiveResizeRequest:
    record = MorphRecord(
        requested_unix=time.time(), requested_devices=1, from_devices=2, from_layout="t1p2d1 1f1b b2 m4",
        to_devices=1, to_layout="t1p1d1 1f1b b2 m4", global_batch=8, resume_step=0, target_steps=20,
        stopped_running_job=False, plan_source="morph-table", path="live",
    )  # fmt: skip
    return LiveResizeRequest(generation=generation, from_devices=2, to_devices=1, master_addr="127.0.0.1", master_port=29500, record=record)


def test_a_rank_takes_only_a_newer_request_and_a_stop_wins(tmp_path):
    assert live_requests.pending_generation(tmp_path, 0) == 0  # none
    write_json_atomic(tmp_path / LIVE_REQUEST_FILE, request(2))
    assert live_requests.pending_generation(tmp_path, 0) == 2
    assert live_requests.pending_generation(tmp_path, 2) == 0  # taken already
    flag = checkpoint.StopFlag()
    assert checkpoint.step_boundary(flag, tmp_path, resize=2) == checkpoint.Boundary(False, False, 2, 2)
    # A rank still touching the memory of its next engine holds the resize back a step.
    assert checkpoint.step_boundary(flag, tmp_path, resize=2, preparing=True) == checkpoint.Boundary(False, False, 0, 2)
    (tmp_path / checkpoints.STOP_FILE).write_text("")
    assert checkpoint.step_boundary(flag, tmp_path, resize=2) == checkpoint.Boundary(True, False, 0, 2)
    (tmp_path / LIVE_REQUEST_FILE).write_text("{not json")
    assert live_requests.pending_generation(tmp_path, 0) == 0  # a damaged request is not taken
