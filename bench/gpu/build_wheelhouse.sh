#!/usr/bin/env bash
# Build the GPU kit's wheel folder (needs the package index once; docs/gpu-kit.md):
#   bash bench/gpu/build_wheelhouse.sh [OUT_DIR]        (default bench/gpu/wheelhouse)
# It holds clawbridge and clawbridge-local as wheels plus every wheel they need that the GPU box
# image lacks (bench/gpu/closure.py works the set out with pip's resolver), for CPython
# $PYTHON_VERSION (default 3.12) on manylinux x86_64. It must stay under 60 MiB: the script fails if not
# (exit 1); exit 3: the package index could not be reached.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${1:-$ROOT/bench/gpu/wheelhouse}"
PY="${PYTHON:-python}"
PYVER="${PYTHON_VERSION:-3.12}"
LIMIT_MIB="${WHEELHOUSE_LIMIT_MIB:-60}"
export PIP_TARGET_FLAGS="--only-binary=:all: --python-version $PYVER --implementation cp \
 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"

rm -rf "$OUT" && mkdir -p "$OUT"
echo "building clawbridge and clawbridge-local wheels..."
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$ROOT" "$ROOT/backends/local"
echo "working out what the box lacks (python $PYVER, manylinux x86_64)..."
unreachable() { echo "pip could not $1: is the package index reachable? (the wheel folder needs it once)" >&2; exit 3; }
"$PY" "$ROOT/bench/gpu/closure.py" "$OUT/requirements.txt" "$OUT"/clawbridge-*.whl "$OUT"/clawbridge_local-*.whl \
  || unreachable "resolve the requirements"
echo "downloading..."
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps -d "$OUT" $PIP_TARGET_FLAGS -r "$OUT/requirements.txt" || unreachable "download"
size_kib=$(du -sk "$OUT" | cut -f1)
echo "wheelhouse: $OUT, $(ls "$OUT"/*.whl | wc -l) wheels, $((size_kib / 1024)) MiB ($size_kib KiB)"
if (( size_kib > LIMIT_MIB * 1024 )); then
  echo "too big: over ${LIMIT_MIB} MiB" >&2
  exit 1
fi
