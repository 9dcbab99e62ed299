"""Ctrl-C on `pipectl resize` while it relaunches the job by a restart: a person's stop, not a
failure of the new layout, before the first step and after it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from pipectl.artifacts.plan import MorphEntry
from pipectl.io import write_json_atomic
from pipectl.rundir.metrics import read_metrics
from pipectl.rundir.morph_history import read_history
from builders import gpt_tiny_candidate as candidate, plan_of
from cli_process import PIPECTL, pipectl, said

pytestmark = pytest.mark.multiprocess

SECONDS = 240
P1, P2 = candidate(1, 1, m=4), candidate(2, 1, m=4)
ENV = {**os.environ, "COLUMNS": "300"}


def _resize_then_ctrl_c(folder, ready) -> tuple[int, str]:
    """`pipectl resize runs/r --devices 1` (a restart: the run is stopped), Ctrl-C once `ready()`."""
    resize = subprocess.Popen([*PIPECTL, "resize", "runs/r", "--devices", "1", "--steps", "100000"], cwd=folder, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + SECONDS
        while not ready():
            assert resize.poll() is None and time.monotonic() < deadline, resize.communicate()[0]
            time.sleep(0.02)
        resize.send_signal(signal.SIGINT)
        output, _ = resize.communicate(timeout=SECONDS)
    finally:
        resize.kill()
    return resize.returncode, " ".join(output.split())


def test_ctrl_c_on_a_resizes_relaunch_is_a_stop_before_and_after_its_first_step(tmp_path):
    write_json_atomic(tmp_path / "plan.json", plan_of(P2, global_batch=8, morph_table=[MorphEntry(devices=1, candidate=P1), MorphEntry(devices=2, candidate=P2)]))  # fmt: skip
    first = pipectl("launch", "plan.json", "--run-dir", "runs/r", "--steps", 4, cwd=tmp_path, timeout=SECONDS)
    assert first.returncode == 0, said(first)
    run = tmp_path / "runs" / "r"
    again = "pipectl launch runs/r/plan.json --run-dir runs/r"

    # The relaunched rank still starting: shown as a stop, not "the resized job exited with code 1".
    code, shown = _resize_then_ctrl_c(tmp_path, lambda: any(r.relaunched_unix for r in read_history(run)))
    assert code == 130, shown
    assert f"stopped before its first step (SIGINT): the run stays at its checkpoint; continue with: {again} --resume" \
        in shown, shown  # fmt: skip
    assert "error:" not in shown and "Traceback" not in shown, shown
    assert read_history(run)[-1].failed_exit_code is None
    assert [m.step for m in read_metrics(run)] == [1, 2, 3, 4]

    # Training on the new layout: stopped at a checkpoint, and the way on keeps the new layout.
    code, shown = _resize_then_ctrl_c(tmp_path, lambda: read_metrics(run)[-1].step >= 6)
    assert code == 130, shown
    step = read_metrics(run)[-1].step
    assert f"stopped at step {step} of 100000 (signal or stop request), checkpoint written; continue with: {again} " \
           "--resume" in shown, shown  # fmt: skip
    assert json.loads((run / "plan.json").read_text())["chosen"]["devices"] == 1
