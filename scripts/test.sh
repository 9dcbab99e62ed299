#!/usr/bin/env bash
# Create/refresh .venv and run the test suite (the short subset CI runs; slow sweeps are marked
# `slow` and run by scripts/slow-tests.sh). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup-env.sh"
cd "$ROOT"
exec python -m pytest -m "not slow" -q "$@"
