"""benchmarks/kernel_times.py on CPU: every kernel the model prices has an operation that is timed.

The figures on CPU mean nothing; what this holds is the pairing, so that a GPU session's run of the
script compares each modelled kernel with a measured one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_modelled_kernel_is_timed_on_a_small_block(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernel_times.py"), "--device", "cpu", "--repeats", "2",
         "--shape", "128,4,64,4,2", "--shape", "128,4,64,2,2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    written = json.loads((tmp_path / "kernel_times-cpu.json").read_text())
    fused, fallback = written["shapes"]  # b x heads/t = 4 rows: Megatron's fp32 softmax path (8 a block at s = 64)
    for shape in (fused, fallback):
        kernels = shape["kernels"]
        untimed = [row["kernel"] for row in kernels if row["measured_us"] is None]
        assert not untimed, f"no operation stands in for {untimed}"
        assert all(row["measured_us"] > 0 for row in kernels)
        assert shape["totals"]["all"]["kernels"] == len(kernels)
    names = {row["kernel"] for row in fused["kernels"]}
    assert {"scale, mask and softmax", "attention dropout", "softmax backward", "qkv weight gradient"} <= names
    assert {"scores to fp32", "softmax (fp32)", "softmax backward (fp32)"} <= {row["kernel"] for row in fallback["kernels"]}
    assert "scale, mask and softmax" in result.stdout
