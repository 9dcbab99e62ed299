#!/usr/bin/env bash
# Create/refresh .venv and run the test suite (the short subset CI runs; slow sweeps are marked
# `slow` and run by scripts/slow-tests.sh). Extra arguments go to pytest.
# Two pytest-xdist workers, each taking whole test files (module fixtures stay shared): most of the
# time goes to tests whose ranks wait on each other, a rendezvous or a timeout, so a second file runs
# meanwhile. PIPECTL_TEST_WORKERS=0 runs everything in this one process.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup-env.sh"
cd "$ROOT"
workers="${PIPECTL_TEST_WORKERS:-2}"
if [ "$workers" = "0" ]; then
  exec python -m pytest -m "not slow" -q "$@"
fi
exec python -m pytest -m "not slow" -q -n "$workers" --dist loadfile "$@"
