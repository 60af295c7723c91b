#!/usr/bin/env bash
# Install clawbridge into ./.venv on a fresh machine: torch first (a CPU build where one is
# provided; a looser torch requirement installed first would pull GBs of CUDA wheels), then the
# core, the backends and the dev tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -c "import torch" 2>/dev/null || pip install -q "torch==${TORCH_VERSION:-2.13.0}"
pkgs=(-e ".[dev]")
for b in backends/local backends/tinker backends/fireworks; do
  [ -f "$b/pyproject.toml" ] && pkgs+=(-e "$b")
done
# setuptools says "Editable installation ... be careful with folders in your working directory"
# once per editable package (an information-only warning; nothing to act on): not four times here.
PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation" pip install -q "${pkgs[@]}"
echo "installed into $(pwd)/.venv"
