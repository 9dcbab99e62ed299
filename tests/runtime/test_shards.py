"""Rank files without processes: what several ranks of a layout write comes back whole and cut for
any other layout (data-parallel pieces, tensor slices, a tied copy on a later stage), and a file
that is missing, damaged or foreign is named."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from pipectl.errors import CheckpointError
from pipectl.models.tensor_parallel import QKV, ROWS, TensorSplit
from pipectl.runtime.shards import FP32, Fragment, RankHeader, ShardReader, rank_file_name, whole_state, write_rank_file


def write_layout(folder: Path, parameters: dict[str, tuple[torch.Tensor, TensorSplit | None]], *, t: int, d: int,
                 stages: dict[str, tuple[int, ...]] | None = None) -> int:  # fmt: skip
    """Write what t tensor ranks x d data-parallel ranks (x the stages in `stages`, default 0) hold
    of `parameters`, the way ZeRO-1 lays it out: each tensor slice's parameters flattened one after
    the other, the flat group cut into d equal partitions. Returns the number of rank files."""
    stages = stages or {}
    stage_ids = sorted({s for name in parameters for s in stages.get(name, (0,))})
    rank = 0
    for stage in stage_ids:
        names = [n for n in parameters if stage in stages.get(n, (0,))]
        for tp_rank in range(t):
            slices = {n: (split.cut(value, t, tp_rank) if split else value) for n, (value, split) in parameters.items()}
            flat = torch.cat([slices[n].reshape(-1) for n in names])
            flat = torch.cat([flat, torch.zeros((-flat.numel()) % d)])  # ZeRO pads to a multiple of d
            size = flat.numel() // d
            starts, offset = {}, 0
            for n in names:
                starts[n] = offset
                offset += slices[n].numel()
            for dp_rank in range(d):
                low, high = dp_rank * size, (dp_rank + 1) * size
                fragments = []
                for n in names:
                    begin, end = max(low, starts[n]), min(high, starts[n] + slices[n].numel())
                    if begin < end:
                        fragments.append(Fragment(n, 0, begin - low, begin - starts[n], end - begin,
                                                  tuple(slices[n].shape), stage, tp_rank, t, parameters[n][1]))  # fmt: skip
                header = RankHeader(rank=rank, stage=stage, step=7, world_size=0, data_parallel_rank=dp_rank,
                                    tp_rank=tp_rank, tensor_parallel=t, fragments=fragments,
                                    group_states=[["exp_avg"]], group_scalars=[[]], group_settings=[{"lr": 0.1}])  # fmt: skip
                part = flat[low:high]
                tensors = {"group0.fp32": part.clone(), "group0.exp_avg": part * 3, "rng.torch": torch.get_rng_state()}
                write_rank_file(folder / rank_file_name(rank), tensors, header)
                rank += 1
    return rank


def model(seed: int = 0) -> dict[str, tuple[torch.Tensor, TensorSplit | None]]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "tied_modules.embed.weight": (torch.randn(10, 4, generator=generator), None),
        "3.qkv.weight": (torch.randn(24, 8, generator=generator), QKV),
        "3.proj.weight": (torch.randn(8, 8, generator=generator), ROWS),
        "3.ln.bias": (torch.randn(8, generator=generator), None),
    }


@pytest.mark.parametrize("t, d", [(1, 1), (2, 1), (1, 3), (2, 3), (4, 2)])
def test_any_layout_reads_back_whole_and_cuts_for_another_degree(tmp_path, t, d):
    parameters = model()
    assert write_layout(tmp_path, parameters, t=t, d=d) == t * d
    reader = ShardReader(tmp_path)
    assert reader.parameter_names() == sorted(parameters) and reader.step == 7
    for name, (value, split) in parameters.items():
        assert torch.equal(reader.whole(name), value), name
        assert torch.equal(reader.whole(name, "exp_avg"), value * 3), name
        if split is not None:
            for rank in range(2):
                assert torch.equal(reader.local(name, FP32, split, 2, rank), split.cut(value, 2, rank)), name


def test_a_tied_module_is_read_from_the_first_stage_that_holds_it(tmp_path):
    parameters = model()
    stale = {**parameters, "tied_modules.embed.weight": (torch.zeros(10, 4), None)}
    write_layout(tmp_path, parameters, t=1, d=1, stages={"tied_modules.embed.weight": (0,)})
    # stage 1 holds the tied module too, with a stale copy: write it as a second stage's file
    later = tmp_path / "later"
    later.mkdir()
    write_layout(later, {"tied_modules.embed.weight": stale["tied_modules.embed.weight"]}, t=1, d=1,
                 stages={"tied_modules.embed.weight": (1,)})  # fmt: skip
    (later / rank_file_name(0)).rename(tmp_path / rank_file_name(1))
    reader = ShardReader(tmp_path)
    assert torch.equal(reader.whole("tied_modules.embed.weight"), parameters["tied_modules.embed.weight"][0])


def test_a_missing_rank_file_or_parameter_is_named(tmp_path):
    write_layout(tmp_path, model(), t=1, d=2)
    (tmp_path / rank_file_name(1)).unlink()
    reader = ShardReader(tmp_path)
    with pytest.raises(CheckpointError, match=r"hold 112 of the 192 elements of '3.qkv.weight' \(tensor slice 0\); a rank's file is missing"):
        reader.whole("3.qkv.weight")
    with pytest.raises(CheckpointError, match=r"holds no parameter '9.weight' \(written for another model\?\)"):
        reader.whole("9.weight")


def test_a_foreign_or_damaged_file_is_named_and_nothing_runs(tmp_path):
    write_layout(tmp_path, model(), t=1, d=2)
    marker = tmp_path / "ran"
    (tmp_path / rank_file_name(1)).write_bytes(pickle.dumps(Path.touch))  # any pickle: never unpickled
    with pytest.raises(CheckpointError, match=f"{tmp_path / rank_file_name(1)}: not a pipectl rank file"):
        ShardReader(tmp_path)
    assert not marker.exists()
    first = tmp_path / rank_file_name(0)
    first.write_bytes(first.read_bytes()[:-8])  # truncated
    with pytest.raises(CheckpointError, match=f"{first}: not a pipectl rank file"):
        ShardReader(tmp_path, [rank_file_name(0)])


def test_whole_state_keys_every_parameter_and_state(tmp_path):
    write_layout(tmp_path, model(), t=2, d=1)
    state = whole_state(tmp_path, (FP32, "exp_avg"))
    assert sorted(state) == sorted(f"{n}/{s}" for n in model() for s in (FP32, "exp_avg"))
