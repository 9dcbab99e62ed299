"""The examples as the examples README runs them: a mistake is one line and exit 2, as in pipectl."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_torch_pipeline_example_names_a_missing_profile_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "torch_pipeline.py"), "--profile", "gpt-tiny.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--profile gpt-tiny.json: file not found: gpt-tiny.json" in done.stderr and "Traceback" not in done.stderr
