#!/usr/bin/env bash
# Create or refresh .venv with everything pipectl needs. Sourced by demo.sh and test.sh.
#
# torch is pinned to the CPU build first (an unpinned torch, also one pulled in by deepspeed,
# would download a multi-GB CUDA build); the rest then resolves against it. A stamp of
# pyproject.toml and this script skips the install when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PIPECTL_VENV:-$ROOT/.venv}"
TORCH_PIN="${PIPECTL_TORCH:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"

stamp_of() { cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup-env.sh" | sha256sum | cut -d' ' -f1; }

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
want="$(stamp_of)"
have="$(cat "$VENV/.pipectl-stamp" 2>/dev/null || true)"
if [ "$want" != "$have" ]; then
  echo "setup: installing $TORCH_PIN, then pipectl and its dependencies (about a minute)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "$TORCH_PIN"
  "$VENV/bin/python" -m pip install -q -e "${ROOT}[dev,hf]" "$TORCH_PIN"
  echo "$want" > "$VENV/.pipectl-stamp"
fi
export PATH="$VENV/bin:$PATH"
# DeepSpeed on CPU: pick the CPU accelerator quietly, one thread per rank.
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
