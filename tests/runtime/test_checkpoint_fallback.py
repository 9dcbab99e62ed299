"""A checkpoint that verifies but does not load on some rank is passed over, with the rank's
reason, and the next older one is loaded (`checkpoint.ranks.load_latest`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from builders import shard_model, write_shard_layout
from pipectl.artifacts.run import MANIFEST_FILE, CheckpointManifest
from pipectl.errors import CheckpointError
from pipectl.io import sha256_file, write_json_atomic
from pipectl.runtime.checkpoint import ranks as checkpoint
from pipectl.rundir import checkpoints
from pipectl.runtime.checkpoint import engine_state


def committed(run: Path, step: int) -> Path:
    folder = checkpoints.checkpoints_dir(run) / checkpoints.tag_for_step(step)
    folder.mkdir(parents=True)
    write_shard_layout(folder, shard_model(), t=1, d=1)
    files = sorted(folder.glob("rank-*.safetensors"))
    manifest = CheckpointManifest(
        tag=folder.name, step=step, files={f.name: sha256_file(f) for f in files},
        file_bytes={f.name: f.stat().st_size for f in files}, bytes=sum(f.stat().st_size for f in files),
    )  # fmt: skip
    write_json_atomic(folder / MANIFEST_FILE, manifest)
    return folder


def test_a_checkpoint_a_rank_cannot_load_is_passed_over_for_the_previous_one(tmp_path, monkeypatch):
    committed(tmp_path, 2)
    newest = committed(tmp_path, 4)
    assert checkpoints.verify_checkpoint(newest).verified
    broken = {newest.name}

    def restore(engine, reader, restore_rng=True):
        if Path(reader.folder).name in broken:
            raise CheckpointError(f"{reader.folder}: holds no parameter 'head.weight' (written for another model?)")
        return SimpleNamespace(step=2, data_position={"epoch": 0})

    monkeypatch.setattr(engine_state, "restore", restore)
    loaded = checkpoint.load_latest(object(), tmp_path)
    assert loaded is not None and loaded.tag == "step00000002"
    assert any(w.startswith("checkpoint step 4 could not be loaded (rank 0: ") and "head.weight" in w for w in loaded.warnings)
    # passed over for good: no longer verified, even by a listing that does not hash
    passed_over = checkpoints.verify_checkpoint(newest, hash_files=False)
    assert not passed_over.verified and "a resume passed it over: checkpoint step 4" in passed_over.problems[0]

    broken.add("step00000002")
    with pytest.raises(CheckpointError, match="no checkpoint of .* can be loaded: checkpoint step 2 .*; checkpoint step 4 "):
        checkpoint.load_latest(object(), tmp_path)
