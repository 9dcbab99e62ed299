"""benchmarks/lm_loss.py on CPU: it runs, and its memory figures say what the loss keeps.

The times on CPU are no GPU figure; the saved bytes are the same on any device: pipectl's loss keeps
its 16-bit gradient (the logits' size), eager cross-entropy its fp32 log-softmax (twice that).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_loss_benchmark_writes_times_and_what_each_loss_keeps(tmp_path):
    out = tmp_path / "lm_loss.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "lm_loss.py"), "--device", "cpu", "--tokens", "256", "--vocab", "1000",
         "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    written = json.loads(out.read_text())
    logits = written["logit_bytes"]
    assert written["dtype"] == "bfloat16" and logits == 256 * 1000 * 2
    assert written["saved_bytes"]["pipectl"] == pytest.approx(logits, rel=0.01)
    assert written["saved_bytes"]["eager"] == pytest.approx(2 * logits, rel=0.01)
    assert written["seconds"]["pipectl"] > 0 and written["eager_over_pipectl"] > 0
    assert "eager / pipectl" in result.stdout
