#!/usr/bin/env bash
# A lent GPU host's whole check in one call, each part in its own time box, everything under $OUT
# (issue #46). For a host whose image has python3 with a CUDA torch but not pipectl's other
# packages: carry their wheels and a wheel of pipectl (docs/guide/gpu-check.md, "Checking pipectl
# on a GPU host") in DIR.
#
#   OUT=/tmp/out scripts/gpu-session.sh [--wheels DIR] [--budget SECONDS] [--parts check,wide,loss,disk,suite]
#
# In order, the most wanted figures first:
#   1. gpu-check of a 1.15 B GPT (9 blocks, hidden 3072, 24 heads, sequence 4096, vocabulary 51,200,
#      global batch 64) on one GPU, checkpointing every 4 steps: step and memory error, MFU, the
#      checkpoint pause and copy wait, the write rate -> $OUT/gpu-1.15b.json
#   2. `wide`: gpu-check of a 1.8 B GPT with GEMMs as wide as a 7 B model's (8 blocks, hidden 4096,
#      32 heads, sequence 2048), no checkpoints: the MFU of one GPU where GEMMs, not the attention
#      of a long sequence, hold most of the work -> $OUT/gpu-1.8b.json
#   3. benchmarks/lm_loss.py on the GPU -> $OUT/lm_loss-cuda.json
#   4. the disk's own rate (dd with fsync) and the host's facts -> $OUT/session.log
#   5. the suite pinned to CPU, then the gpu tests, in what time is left -> $OUT/tests-*, gpu-tests-*
# That is 9 files. --budget (default 540) is the seconds all parts share; each part's box is a
# share of what is left when it starts. The whole suite needs more than what the first parts leave
# of one 10-minute call on a 16-core host: `--parts suite` gives it a call of its own.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEELS=.whl
BUDGET=540
PARTS=check,wide,loss,disk,suite
while (($#)); do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        --parts) PARTS="$2"; shift 2 ;;
        *) echo "gpu-session: unknown argument $1" >&2; exit 2 ;;
    esac
done
OUT="${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
LOG="$OUT/session.log"
START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
wanted() { [[ ",$PARTS," == *",$1,"* ]]; }
# A share (%) of the seconds left, at least 10 (`timeout 0` would mean no limit at all).
box() { local share=$1 rest; rest=$(left); echo $((rest * share / 100 > 10 ? rest * share / 100 : 10)); }
# A timed-out launch stops its ranks gracefully (they run in a session of their own, which timeout's
# signal does not reach): wait until no process holds the GPU before the next part measures it.
gpu_idle() {
    local waited=0
    while [[ -n "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" && $waited -lt 60 ]]; do
        sleep 2; waited=$((waited + 2))
    done
}

{
    echo "== host"; date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    echo "cores: $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
} >"$LOG" 2>&1

if [[ -d "$WHEELS" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl >>"$LOG" 2>&1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
export PYTHON=python3

WORK="$(mktemp -d)"
cat >"$WORK/gpt-1.15b.yaml" <<'YAML'
name: gpt-1.15b
family: gpt
layers: 9
hidden: 3072
heads: 24
seq_len: 4096
vocab: 51200
tied_embeddings: true
YAML

cat >"$WORK/gpt-1.8b.yaml" <<'YAML'
name: gpt-1.8b
family: gpt
layers: 8
hidden: 4096
heads: 32
seq_len: 2048
vocab: 51200
tied_embeddings: true
YAML

if wanted check; then
    echo "== 1. gpu-check, 1.15 B ($(box 45) s)" >>"$LOG"
    timeout -k 15 "$(box 45)" scripts/gpu-check.sh --model "$WORK/gpt-1.15b.yaml" --layouts 1 --sizes 1,2,4 \
        --tensor-parallel 1 --checkpoint-every 4 --steps 12 --no-baseline --work "$WORK/check" \
        --out "$OUT/gpu-1.15b.json" >>"$LOG" 2>&1 || echo "gpu-check ended with $?" >>"$LOG"
    gpu_idle
    rm -rf "$WORK/check" || true  # its checkpoints: tens of GB
fi

if wanted wide; then
    echo "== 2. gpu-check, 1.8 B ($(box 60) s)" >>"$LOG"
    timeout -k 15 "$(box 60)" scripts/gpu-check.sh --model "$WORK/gpt-1.8b.yaml" --layouts 1 --sizes 2,4 \
        --tensor-parallel 1 --checkpoint-every 0 --steps 8 --no-baseline --work "$WORK/wide" \
        --out "$OUT/gpu-1.8b.json" >>"$LOG" 2>&1 || echo "gpu-check (wide) ended with $?" >>"$LOG"
    gpu_idle
    rm -rf "$WORK/wide" || true
fi

if wanted loss; then
    echo "== 3. lm_loss" >>"$LOG"
    timeout -k 5 "$(box 15)" python3 benchmarks/lm_loss.py --device cuda --tokens 16384 --vocab 51200 --repeats 5 \
        --out "$OUT/lm_loss-cuda.json" >>"$LOG" 2>&1 || echo "lm_loss ended with $?" >>"$LOG"
fi

if wanted disk; then
    echo "== 4. disk" >>"$LOG"
    timeout 60 dd if=/dev/zero of="$WORK/dd.bin" bs=64M count=64 conv=fsync >>"$LOG" 2>&1 || true
    rm -f "$WORK/dd.bin"
fi

if wanted suite; then
    echo "== 5. suite ($(left) s left)" >>"$LOG"
    suite_box=$(box 75) gpu_box=$(box 20)
    OUT="$OUT" PIPECTL_TESTS_BUDGET=$suite_box PIPECTL_GPU_TESTS_BUDGET=$gpu_box \
        scripts/gpu-check.sh --tests >>"$LOG" 2>&1 || echo "suite ended with $?" >>"$LOG"
fi
rm -rf "$WORK" || true
echo "== done in $((SECONDS - START)) s" >>"$LOG"
