"""What `resize --live` refuses before anything changes (no processes: the run is not running)."""

from __future__ import annotations

import pytest

from pipectl.artifacts.plan import MorphEntry
from pipectl.launch import LaunchOptions, prepare_launch
from pipectl.resize.live import LiveUnavailable, check_live
from pipectl.resize.restart import decide_resize
from builders import gpt_tiny_candidate as candidate, gpt_tiny_torch_candidate, plan_of


def test_a_run_with_no_rank_running_here_is_not_moved_live(tmp_path):
    plan = plan_of(candidate(2, 1), global_batch=8, morph_table=[MorphEntry(devices=1, candidate=candidate(1, 1))])
    prepared = prepare_launch(plan, tmp_path / "run", LaunchOptions(steps=4, seed=0))
    before = {p.name: p.read_bytes() for p in prepared.run_dir.iterdir() if p.is_file()}
    with pytest.raises(LiveUnavailable, match="no rank of the run is running on this machine"):
        check_live(decide_resize(prepared.run_dir, 1))
    assert {p.name: p.read_bytes() for p in prepared.run_dir.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("start", ["deepspeed", "torch"])
def test_a_move_to_or_from_the_torch_engine_is_not_live(tmp_path, start):
    """A live resize hands DeepSpeed engine state over; across engines the CLI restarts instead,
    saying why (the checkpoint resumes in either engine: tests/runtime/test_torch_launch.py)."""
    torch_plan = gpt_tiny_torch_candidate("interleaved", 2, v=2)
    chosen, other = (candidate(2, 1), torch_plan) if start == "deepspeed" else (torch_plan, candidate(2, 1))
    plan = plan_of(chosen, global_batch=8, morph_table=[MorphEntry(devices=2, candidate=other)])
    prepared = prepare_launch(plan, tmp_path / "run", LaunchOptions(steps=4, seed=0))
    which = "new" if start == "deepspeed" else "running"
    with pytest.raises(LiveUnavailable, match=f"the {which} layout runs on the torch engine") as raised:
        check_live(decide_resize(prepared.run_dir, 2))
    assert raised.value.running  # the CLI says "cannot resize live: ...; restarting instead"
