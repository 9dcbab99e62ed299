#!/usr/bin/env bash
# The slow sweeps CI leaves out.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup-env.sh"
cd "$ROOT"
exec python -m pytest -m slow -q "$@"
