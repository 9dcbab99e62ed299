#!/usr/bin/env bash
# The demo on a fresh machine: set up .venv, then profile -> plan -> simulate -> launch -> status
# for gpt-tiny on local CPU ranks (the embedded default engine). Outputs go to out/demo/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup-env.sh"
cd "$ROOT"
OUT="${PIPECTL_DEMO_OUT:-out/demo}"
RANKS="${PIPECTL_DEMO_RANKS:-2}"
mkdir -p "$OUT"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "profile gpt-tiny on this CPU"
pipectl profile gpt-tiny --micro-batch-sizes 1,2,4,8 -o "$OUT/profile.json"

# The pipeline is pinned to one stage per rank: on a two-core machine the planner, left free, keeps
# one rank (two ranks sharing the cores each compute ~1.8x slower, measured by the profile), and
# the demo is there to show a pipeline run, and resized.
step "plan gpt-tiny as a $RANKS-stage pipeline on $RANKS local CPU ranks, global batch 16"
pipectl plan --profile "$OUT/profile.json" --cluster local --devices "$RANKS" --pipeline-parallel "$RANKS" \
    --global-batch 16 -o "$OUT/plan.json"

step "simulate the chosen plan and draw its Gantt chart"
pipectl simulate "$OUT/plan.json" --gantt "$OUT/step.png" --terminal

step "launch: train gpt-tiny on $RANKS local CPU ranks inside DeepSpeed's pipeline engine"
pipectl launch "$OUT/plan.json" --run-dir "$OUT/run" --steps 10 --checkpoint-every 5 --force

step "resize the job to 1 device: same global batch, resumed from its checkpoint"
pipectl resize "$OUT/run" --devices 1 --steps 20

step "status: progress, predicted vs measured, morph history, loss curve"
pipectl status "$OUT/run" --plot "$OUT/run.png"
echo
echo "artifacts in $OUT: profile.json plan.json step.png run/ run.png"
