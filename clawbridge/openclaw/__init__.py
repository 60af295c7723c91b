"""OpenClaw integration: installer for openclaw.json, the Runtime-line session fallback, toolchain lookup."""
