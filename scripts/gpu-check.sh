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
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
cd "$ROOT"
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
exec "$PYTHON" benchmarks/gpu_check.py "$@"
