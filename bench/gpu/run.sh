#!/usr/bin/env bash
# The GPU validation kit, offline: install what the box lacks from the wheel folder, then print one table.
#   bash bench/gpu/run.sh                      # on the GPU box (device cuda, full sizes)
#   bash bench/gpu/run.sh --quick --device cpu # anywhere: tiny sizes, a few minutes
# Environment: WHEELHOUSE (default bench/gpu/wheelhouse), PYTHON (default python). docs/gpu-kit.md.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
WH="${WHEELHOUSE:-$ROOT/bench/gpu/wheelhouse}"
PY="${PYTHON:-python}"
if [[ ! -f "$WH/requirements.txt" ]]; then
  echo "no wheel folder at $WH: build it with bash bench/gpu/build_wheelhouse.sh where the package index is reachable" >&2
  exit 2
fi
echo "installing from $WH (no index)..." >&2
# --no-deps: the folder holds exactly what the box lacks, pinned (bench/gpu/closure.py), less what it leaves out.
"$PY" -m pip install -q --no-index --find-links "$WH" --no-deps -r "$WH/requirements.txt" \
  "$WH"/clawbridge-*.whl "$WH"/clawbridge_local-*.whl
exec "$PY" "$ROOT/bench/gpu/kit.py" "$@"
