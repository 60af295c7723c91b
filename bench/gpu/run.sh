#!/usr/bin/env bash
# The GPU validation kit, offline: install what the box lacks from the wheel folder, then the table.
#   bash bench/gpu/run.sh                          # on the GPU box: device cuda, full sizes, about 6 minutes
#   bash bench/gpu/run.sh --out DIR                # the table (gpu-kit.md, gpu-kit.json) and logs go to DIR
#   bash bench/gpu/run.sh --quick --device cpu     # anywhere: scaled shapes, a few minutes
# Output folder: --out, else $OUT when set, else ./gpu-kit-out. The table is printed and written
# after every part. Environment: WHEELHOUSE (default bench/gpu/wheelhouse), PYTHON (default python,
# else python3). docs/gpu-kit.md.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
WH="${WHEELHOUSE:-$ROOT/bench/gpu/wheelhouse}"
PY="${PYTHON:-$(command -v python || command -v python3)}"
t0=$(date +%s)
if [[ -f "$WH/requirements.txt" ]]; then
  echo "installing from $WH (no index)..." >&2
  # --no-deps: the folder holds exactly what the box lacks, pinned (bench/gpu/closure.py).
  "$PY" -m pip install -q --no-index --find-links "$WH" --no-deps -r "$WH/requirements.txt" \
      "$WH"/clawbridge-*.whl "$WH"/clawbridge_local-*.whl \
    || echo "the offline install failed (above): parts that need a missing package will fail" >&2
else
  echo "no wheel folder at $WH (build it with bash bench/gpu/build_wheelhouse.sh where the package index is" \
       "reachable): parts that need a package the box lacks will fail" >&2
fi
echo "install: $(( $(date +%s) - t0 ))s" >&2
# The code measured is this checkout's, whatever the wheels were built from (the installed wheels
# give the dependencies and the entry points).
export PYTHONPATH="$ROOT:$ROOT/backends/local${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" "$ROOT/bench/gpu/kit.py" "$@"
