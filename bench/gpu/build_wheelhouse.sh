#!/usr/bin/env bash
# Build the GPU kit's wheel folder (needs the package index once; docs/gpu-kit.md):
#   bash bench/gpu/build_wheelhouse.sh [OUT_DIR]        (default bench/gpu/wheelhouse)
# It holds clawbridge and clawbridge-local as wheels plus every wheel they need that the GPU box
# image lacks (bench/gpu/closure.py works the set out with pip's resolver against the image's real
# package list, bench/gpu/box_image.txt), for CPython $PYTHON_VERSION (default 3.12) on manylinux
# x86_64, and nothing else. It must stay under 56 MiB (the carried tree's limit is 64 MiB with the
# repository): the script fails if not (exit 1), or if the folder's wheels are not exactly the
# pinned list plus our two (exit 4); exit 3: the package index could not be reached.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${1:-$ROOT/bench/gpu/wheelhouse}"
PY="${PYTHON:-python}"
PYVER="${PYTHON_VERSION:-3.12}"
LIMIT_MIB="${WHEELHOUSE_LIMIT_MIB:-56}"
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
# Exactly what the image lacks: one wheel per pinned requirement, plus clawbridge and clawbridge-local.
"$PY" - "$OUT" <<'PYEOF' || exit 4
import re, sys
from pathlib import Path
out = Path(sys.argv[1])
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
want = {norm(line.split("==")[0]): line.split("==")[1] for line in (out / "requirements.txt").read_text().split()}
want.update({"clawbridge": None, "clawbridge-local": None})
have = {norm(w.name.split("-")[0]): w.name.split("-")[1] for w in out.glob("*.whl")}
wrong = {n: (want.get(n), have.get(n)) for n in set(want) | set(have)
         if n not in want or n not in have or (want[n] is not None and want[n] != have[n])}
if wrong:
    sys.exit(f"the wheel folder is not exactly the pinned list (wanted, found): {wrong}")
print(f"checked: {len(have)} wheels, exactly requirements.txt + clawbridge + clawbridge-local")
PYEOF
size_kib=$(du -sk "$OUT" | cut -f1)
echo "wheelhouse: $OUT, $(ls "$OUT"/*.whl | wc -l) wheels, $((size_kib / 1024)) MiB ($size_kib KiB)"
if (( size_kib > LIMIT_MIB * 1024 )); then
  echo "too big: over ${LIMIT_MIB} MiB" >&2
  exit 1
fi
