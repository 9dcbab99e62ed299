"""`scripts/gpu-check.sh --tests`: the suite pinned to the CPU in a time box, each verdict on disk as it ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipectl.testing.verdicts import summary_line

REPO = Path(__file__).resolve().parents[1]

SAMPLE = '''
import os
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("setup")

@pytest.fixture
def breaks_after():
    yield
    raise RuntimeError("teardown")

def test_passes():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # tests/conftest.py's pinning is not here: set by the caller

def test_fails():
    assert False

def test_errors(broken):
    pass

def test_passes_then_its_teardown_fails(breaks_after):
    pass

@pytest.mark.skip(reason="no")
def test_skipped():
    pass
'''


@pytest.mark.parametrize("workers", [None, 2])
def test_the_plugin_writes_one_verdict_per_test_as_it_ends(tmp_path, workers):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    verdicts = tmp_path / "verdicts.jsonl"
    env = {**os.environ, "PIPECTL_TEST_VERDICTS": str(verdicts), "CUDA_VISIBLE_DEVICES": ""}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pipectl.testing.verdicts",
            "test_sample.py", *(["-n", str(workers)] if workers else [])]  # fmt: skip
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    records = [json.loads(line) for line in verdicts.read_text().splitlines()]
    by_test = {}
    for record in records:
        by_test.setdefault(record["test"].split("::")[-1], []).append(record["outcome"])
    assert by_test == {
        "test_passes": ["passed"],
        "test_fails": ["failed"],
        "test_errors": ["error"],
        "test_passes_then_its_teardown_fails": ["passed", "error"],
        "test_skipped": ["skipped"],
    }
    assert summary_line(verdicts, 60) == "1 passed, 1 failed, 2 errors, 1 skipped (time box 60 s)"


def test_gpu_check_tests_runs_a_part_of_the_suite_and_summarises(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "PIPECTL_TEST_WORKERS": "1"}
    result = subprocess.run(["bash", "scripts/gpu-check.sh", "--tests", "tests/test_words.py"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    summary = (tmp_path / "tests-summary.txt").read_text().splitlines()
    passed = len((tmp_path / "tests-verdicts.jsonl").read_text().splitlines())
    assert summary[0] == f"suite pinned to CPU: {passed} passed, 0 failed, 0 errors, 0 skipped" and passed > 0
    assert summary[1] == "gpu tests: 0 passed, 0 failed, 0 errors, 0 skipped"
    assert summary[2] == f"xdist workers: 1 of {len(os.sched_getaffinity(0))} cores"
    assert "<testsuite" in (tmp_path / "tests-junit.xml").read_text()


def test_gpu_check_tests_counts_the_cores_whatever_omp_num_threads_says(tmp_path):
    # GNU nproc answers OMP_NUM_THREADS (1 for the ranks): on a 16-core GPU host the suite ran 1 worker.
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("PIPECTL_TEST_WORKERS", None)
    result = subprocess.run(["bash", "scripts/gpu-check.sh", "--tests", "tests/test_words.py"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    cores = len(os.sched_getaffinity(0))
    assert (tmp_path / "tests-summary.txt").read_text().splitlines()[2] == f"xdist workers: {min(cores, 8)} of {cores} cores"


@pytest.mark.multiprocess
def test_gpu_check_on_cpu_ranks_writes_its_summary_with_the_checkpoint_figures(tmp_path):
    """The check's own path, on CPU ranks (a check of the script, not a figure): profile, plan,
    launch with checkpoints, and the result with its summary even without the baseline loop. Run
    from the user's folder, its relative paths are that folder's (not the checkout's)."""
    out = tmp_path / "gpu-cpu.json"
    env = {**os.environ, "PYTHON": sys.executable}
    argv = ["bash", str(REPO / "scripts" / "gpu-check.sh"), "--device", "cpu", "--quick", "--steps", "4", "--warmup",
            "1", "--layouts", "1", "--checkpoint-every", "2", "--no-baseline", "--work", "work", "--out", "gpu-cpu.json"]  # fmt: skip
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["failed"] == [] and summary["baseline_ratio"] is None
    assert summary["max_step_error"] is not None and summary["checkpoint_pause_seconds"] >= 0
    assert summary["checkpoint_copy_wait_seconds"] == 0.0  # CPU ranks copy between steps: no step waits
    assert summary["checkpoint_write_gbytes_per_second"] > 0
    assert (tmp_path / "work").is_dir() and not (REPO / "work").exists() and not (REPO / "gpu-cpu.json").exists()


@pytest.mark.skipif(os.environ.get("PIPECTL_TEST_GPU") == "1", reason="a GPU run shows the GPUs")
def test_the_suite_runs_with_no_gpu_visible_to_it_or_its_ranks():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and os.environ["DS_ACCELERATOR"] == "cpu"


@pytest.mark.gpu
def test_a_gpu_run_sees_the_gpus():
    import torch

    assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
