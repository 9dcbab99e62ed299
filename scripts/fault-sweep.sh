#!/usr/bin/env bash
# The full fault sweep (benchmarks/fault_sweep.py): real 2-rank launches of gpt-tiny killed,
# stopped, starved of disk and raced at random seeded points, each resumed and compared with a
# fault-free run; writes benchmarks/results/faults.json. About 50 minutes on 2 cores.
# Extra arguments go to the driver (--seed N, --kill-trials N, --no-data-parallel, --keep).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup-env.sh"
cd "$ROOT"
exec python benchmarks/fault_sweep.py "$@"
