"""The planning guide's worked examples, run as it tells a user to: derived profiles give the same
figures on any machine, so the guide states them and this test holds it to what the commands print."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.test_first_hour import REPO, pipectl, said, succeeded


def _plan(tmp_path: Path, *args: str) -> dict:
    done = pipectl("plan", "--profile", "gpt2.json", "--cluster", "a100-8x8", "--global-batch", "512", *args,
                   "-o", "plan.json", "--json", cwd=tmp_path)  # fmt: skip
    assert succeeded(done), said(done)
    return json.loads(done.stdout)


def _step(plan: dict, p: int, d: int, schedule: str, chunks: int = 1) -> float:
    return next(c["predicted_step_seconds"] for c in plan["candidates"]
                if (c["pipeline_parallel"], c["data_parallel"], c["micro_batch_size"], c["schedule"], c["chunks"])
                == (p, d, 8, schedule, chunks))  # fmt: skip


def test_the_planning_guides_engine_torch_and_2bw_figures_are_what_the_planner_prints(tmp_path):
    guide = " ".join((REPO / "docs" / "guide" / "planning.md").read_text().split())
    assert succeeded(pipectl("profile", "gpt2-2.5b", "--derive", "--device", "a100-80gb", "-o", "gpt2.json", cwd=tmp_path))

    torch = _plan(tmp_path, "--devices", "8", "--engine", "torch", "--all")
    chosen = torch["chosen"]
    assert (chosen["schedule"], chosen["pipeline_parallel"], chosen["data_parallel"]) == ("zb-h1", 8, 1)
    assert (f"t = 1, p = 8, d = 1, b = 8 ({chosen['predicted_step_seconds']:.3g} s per step; interleaved v = 2: "
            f"{_step(torch, 8, 1, 'interleaved', 2):.3g} s, 1F1B: {_step(torch, 8, 1, '1f1b'):.3g} s at the same p)") in guide
    default = _plan(tmp_path, "--devices", "8")["chosen"]
    assert f"chooses 1F1B at p = {default['pipeline_parallel']}, d = {default['data_parallel']} " \
           f"({default['predicted_step_seconds']:.3g} s)" in guide

    two_bw = _plan(tmp_path, "--schedules", "1f1b,2bw", "--any-engine", "--no-morph")["chosen"]
    flushed = next(note for note in two_bw["notes"] if note.startswith("2BW steady state")).split("flushed 1F1B: ")[1]
    assert f"{two_bw['predicted_step_seconds']:.3g} s per update at t = 1, p = 8, d = 8, against " \
           f"{flushed.split(' s per step')[0]} s flushed" in guide
