"""Rank files without processes: what several ranks of a layout write comes back whole and cut for
any other layout (data-parallel pieces, tensor slices, a tied copy on a later stage), and a file
that is missing, damaged or foreign is named."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from pipectl.errors import CheckpointError
from pipectl.artifacts.run import rank_file_name
from pipectl.runtime.checkpoint.shards import FP32, ShardReader, whole_state
from builders import shard_model as model, write_shard_layout as write_layout


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
