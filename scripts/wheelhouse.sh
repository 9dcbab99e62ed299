#!/usr/bin/env bash
# Wheels for installing pipectl on a host without network (README: "On a GPU host, offline"), built
# where there is one, from this checkout's environment. Into DIR (default: wheelhouse):
#   - pipectl itself and DeepSpeed at this environment's version, built here (both pure Python;
#     DeepSpeed against this torch, with no compiled ops: it builds them on the host when asked);
#   - the other packages at this environment's versions, as wheels for the host's Python
#     (--python-version, default this one's) on x86-64 Linux: every package of this environment, the
#     tests' included, but torch and its CUDA libraries, which the host brings with its own build;
#     or only the NAMEs given (what the host lacks, where it has most of them already).
#
#   scripts/wheelhouse.sh [--python-version 3.12] [--dir DIR] [NAME ...]
#
# Then on the host, beside its torch, either in an environment of its own:
#   pip install --no-index --find-links DIR pipectl
# or into a folder of their own, the host's packages left as they are:
#   pip install --no-index --no-deps --target SITE DIR/*.whl && export PYTHONPATH=SITE PATH=SITE/bin:$PATH
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
version="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
dir="wheelhouse"
names=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python-version) version="$2"; shift 2 ;;
        --dir) dir="$2"; shift 2 ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        -*) echo "wheelhouse: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) names+=("$1"); shift ;;
    esac
done
# name==version of every package here, by its normalised name (PEP 503: lower case, runs of -_. as -).
pins="$("$PYTHON" -m pip list --format=freeze --exclude-editable 2>/dev/null \
    | awk -F'==' '{ name = tolower($1); gsub(/[-_.]+/, "-", name); print name "==" $2 }')"
pin_of() {
    local name
    name="$(echo "$1" | tr '[:upper:]' '[:lower:]' | sed -E 's/[-_.]+/-/g')"
    grep -E "^${name}==" <<<"$pins" || { echo "wheelhouse: $1 is not installed in $PYTHON's environment" >&2; return 1; }
}
if [[ ${#names[@]} -eq 0 ]]; then
    # Everything but what the host's torch brings, and what is built below.
    mapfile -t wanted < <(grep -v -E '^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+|deepspeed|pipectl)==' <<<"$pins")
else
    wanted=()
    for name in "${names[@]}"; do wanted+=("$(pin_of "$name")"); done
fi
deepspeed="$(pin_of deepspeed)"
mkdir -p "$dir"
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "$ROOT"
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "$deepspeed"
failed=()
for pin in "${wanted[@]}"; do  # one at a time: a package without a wheel for that Python is named, not fatal to the rest
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$dir" "$pin" >/dev/null 2>&1 || failed+=("$pin")
done
echo "wheelhouse: $(find "$dir" -name '*.whl' | wc -l) wheels in $dir ($(du -sh "$dir" | cut -f1)) for Python $version"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "wheelhouse: no wheel for Python $version: ${failed[*]}" >&2
    exit 1
fi
