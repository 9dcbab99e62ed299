#!/usr/bin/env bash
# On a CUDA host with pipectl installed (no network needed): measure and derive a GPT's layers,
# plan for the visible GPUs, launch a few steps of up to three layouts (the plan's choice, the one
# it says fills memory most, a one-GPU layout), run a hand-written baseline loop, and write
# benchmarks/results/gpu-<device>.json (step-time error, memory error, baseline ratio,
# derived-vs-measured per layer). Extra arguments go to benchmarks/gpu_check.py (--quick, --steps N,
# --device-kind NAME, --global-batch B).
#
#   PYTHON=/path/to/venv/bin/python scripts/gpu-check.sh --quick
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
cd "$ROOT"
"$PYTHON" - <<'PY'
import importlib.util, sys
missing = [name for name in ("torch", "deepspeed", "pydantic", "typer", "rich", "safetensors", "pipectl") if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(f"gpu-check: {', '.join(missing)} not importable by {sys.executable}; install pipectl first (README: offline install)")
import torch
if not torch.cuda.is_available():
    sys.exit("gpu-check: no CUDA device visible (torch.cuda.is_available() is False)")
PY
unset DS_ACCELERATOR  # DeepSpeed picks CUDA itself
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PYTHON" benchmarks/gpu_check.py "$@"
