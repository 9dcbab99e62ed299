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


def test_the_tiny_llama_example_answers_help_and_writes_over_nothing(tmp_path):
    script = str(REPO / "examples" / "tiny_llama.py")
    helped = subprocess.run([sys.executable, script, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "usage:" in helped.stdout and not (tmp_path / "--help").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    refused = subprocess.run([sys.executable, script, "mine"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "mine: already exists and is not empty" in refused.stderr
    assert (tmp_path / "mine" / "config.json").read_text() == "{}" and "Traceback" not in refused.stderr
