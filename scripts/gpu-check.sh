#!/usr/bin/env bash
# On a CUDA host with pipectl installed (no network needed): measure and derive a GPT's layers,
# plan for the visible GPUs, launch a few steps of up to three layouts (the plan's choice, the one
# it says fills memory most, a one-GPU layout), run a hand-written baseline loop, and write
# benchmarks/results/gpu-<device>.json (step-time error, memory error, baseline ratio,
# derived-vs-measured per layer). Extra arguments go to benchmarks/gpu_check.py (--quick, --steps N,
# --device-kind NAME, --global-batch B); with --device cpu the same path runs on CPU ranks (a check
# of the script, not a GPU figure).
#
#   PYTHON=/path/to/venv/bin/python scripts/gpu-check.sh --quick
#
# With --tests (first argument; the rest go to pytest, e.g. a path): the test suite instead, as CI
# runs it but pinned to the CPU whatever the host has (tests/conftest.py hides the GPUs from every
# test and rank), within a time box, then the tests marked `gpu` with the GPUs visible. Each test's
# verdict is appended to $OUT/tests-verdicts.jsonl as it ends (a killed run keeps what ran), pytest
# writes $OUT/tests-junit.xml at the end, and one line per part goes to $OUT/tests-summary.txt.
# $OUT defaults to benchmarks/results; PIPECTL_TESTS_BUDGET (s, default 1500) boxes the suite,
# PIPECTL_GPU_TESTS_BUDGET (default 300) the gpu part; PIPECTL_TEST_WORKERS (default: the cores,
# at most 8) sets pytest-xdist's processes. Exits non-zero when a test failed or the box ran out.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
CALLER="$PWD"  # the check's own paths (--model, --work, --out) are the caller's, as pipectl's are
cd "$ROOT"
if [[ "${1:-}" == "--tests" ]]; then
    shift
    out="${OUT:-$ROOT/benchmarks/results}"
    [[ "$out" == /* ]] || out="$CALLER/$out"
    mkdir -p "$out"
    # GNU nproc honours OMP_NUM_THREADS, which the caller may have set to 1 for its ranks: count the cores.
    cores="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
    workers="${PIPECTL_TEST_WORKERS:-$(( cores < 8 ? cores : 8 ))}"
    rm -f "$out/tests-verdicts.jsonl" "$out/gpu-tests-verdicts.jsonl" "$out/tests-summary.txt"
    export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    suite=0
    PIPECTL_TEST_VERDICTS="$out/tests-verdicts.jsonl" timeout "${PIPECTL_TESTS_BUDGET:-1500}" \
        "$PYTHON" -m pytest -m "not slow and not gpu" -q -n "$workers" --dist loadfile -p no:cacheprovider \
        -p pipectl.testing.verdicts -rfE --junitxml "$out/tests-junit.xml" "$@" || suite=$?
    gpu=0
    PIPECTL_TEST_GPU=1 PIPECTL_TEST_VERDICTS="$out/gpu-tests-verdicts.jsonl" timeout "${PIPECTL_GPU_TESTS_BUDGET:-300}" \
        "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -p pipectl.testing.verdicts -rfE \
        --junitxml "$out/gpu-tests-junit.xml" "$@" || gpu=$?
    [[ "$gpu" == 5 ]] && gpu=0  # pytest: no test selected
    SUITE="$suite" GPU="$gpu" OUT_DIR="$out" "$PYTHON" - <<'PY' | tee "$out/tests-summary.txt"
import os
from pipectl.testing.verdicts import summary_line
out = os.environ["OUT_DIR"]
for label, name, status in (("suite pinned to CPU", "tests", os.environ["SUITE"]), ("gpu tests", "gpu-tests", os.environ["GPU"])):
    boxed = " (the time box ran out)" if status == "124" else ""
    print(f"{label}: {summary_line(os.path.join(out, name + '-verdicts.jsonl'))}{boxed}")
PY
    echo "xdist workers: $workers of $cores cores" | tee -a "$out/tests-summary.txt"
    [[ "$suite" == 0 && "$gpu" == 0 ]]
    exit $?
fi
ON_CPU=0
for ((i = 1; i <= $#; i++)); do
    next=$((i + 1))
    if [[ "${!i}" == "--device=cpu" || ( "${!i}" == "--device" && $next -le $# && "${!next}" == "cpu" ) ]]; then ON_CPU=1; fi
done
ON_CPU="$ON_CPU" "$PYTHON" - <<'PY'
import importlib.util, os, sys
missing = [name for name in ("torch", "deepspeed", "pydantic", "typer", "rich", "safetensors", "pipectl") if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(f"gpu-check: {', '.join(missing)} not importable by {sys.executable}; install pipectl first (README: offline install)")
import torch
if os.environ["ON_CPU"] != "1" and not torch.cuda.is_available():
    sys.exit("gpu-check: no CUDA device visible (torch.cuda.is_available() is False)")
PY
if [[ "$ON_CPU" == 1 ]]; then
    export DS_ACCELERATOR=cpu
else
    unset DS_ACCELERATOR  # DeepSpeed picks CUDA itself
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$CALLER"
exec "$PYTHON" "$ROOT/benchmarks/gpu_check.py" "$@"
