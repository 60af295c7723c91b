#!/usr/bin/env bash
# Install Debian's chromium and chromedriver for the dashboard's browser tests.
# Idempotent; exits 0 with a "SKIP:" message when apt is unavailable or fails, so those tests skip
# with a clear reason instead of failing.
set -uo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo -n"
if ! command -v apt-get >/dev/null 2>&1; then
  echo "SKIP: no apt-get; install chromium and chromium-driver to run the dashboard browser tests" >&2
  exit 0
fi
if ! ($SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver) >&2; then
  echo "SKIP: could not install chromium chromium-driver with apt; the dashboard browser tests will skip" >&2
fi
exit 0
