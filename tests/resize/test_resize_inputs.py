"""A resize checks the model and the data as the new layout's ranks will load them before it touches
the run, as `launch` does before any process starts."""

from __future__ import annotations

import numpy as np
import pytest

from pipectl.artifacts.plan import MorphEntry
from pipectl.io import write_json_atomic
from builders import gpt_tiny_candidate as candidate, plan_of
from cli_process import pipectl, said

pytestmark = pytest.mark.multiprocess


def test_a_resize_whose_data_file_has_moved_is_refused_before_the_run_is_rewritten(tmp_path):
    """The run's token file moved since the launch: `resize` refuses, exit 2, naming the file, with
    job.json and plan.json as they were (it used to rewrite them, start the new rank, and fail
    inside it: exit 1)."""
    one, two = candidate(1, 1, m=4), candidate(2, 1, m=4)
    write_json_atomic(tmp_path / "plan.json", plan_of(two, global_batch=8, morph_table=[
        MorphEntry(devices=1, candidate=one), MorphEntry(devices=2, candidate=two)]))  # fmt: skip
    np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16).tofile(tmp_path / "tokens.bin")
    first = pipectl("launch", "plan.json", "--run-dir", "runs/r", "--data", "tokens.bin", "--steps", 2, cwd=tmp_path)
    assert first.returncode == 0, said(first)
    run = tmp_path / "runs" / "r"
    before = {name: (run / name).read_bytes() for name in ("job.json", "plan.json", "ds_config.json", "launch.sh")}
    (tmp_path / "tokens.bin").rename(tmp_path / "elsewhere.bin")
    refused = pipectl("resize", "runs/r", "--devices", 1, "--steps", 4, cwd=tmp_path)
    assert refused.returncode == 2, said(refused)
    assert f"data file not found: {tmp_path / 'tokens.bin'}" in refused.stderr and "Traceback" not in said(refused)
    assert {name: (run / name).read_bytes() for name in before} == before
