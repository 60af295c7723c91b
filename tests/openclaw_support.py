"""Helpers for the tests that run real OpenClaw (Node 24 + openclaw@2026.9.6 from
`.ci/install_openclaw.sh`): its environment, running it in a throwaway HOME, an `openclaw` on PATH,
and reading back what clawbridge recorded.

Invariants:
- OpenClaw only ever sees a temporary HOME (never the developer's), with update checks, telemetry
  and Bonjour off; every command runs under a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from clawbridge.openclaw.toolchain import find_node, find_openclaw

TURN_TIMEOUT_S = 240


def clawbridge_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "clawbridge"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "clawbridge.cli.main"]


def openclaw_env(home: Path, gateway_port: int | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENCLAW_", "CLAWBRIDGE_"))}
    env.update(
        HOME=str(home), CI="1", OPENCLAW_NO_AUTO_UPDATE="1", DO_NOT_TRACK="1", OPENCLAW_DISABLE_BONJOUR="1"
    )
    if gateway_port is not None:
        env.update(OPENCLAW_GATEWAY_PORT=str(gateway_port), OPENCLAW_GATEWAY_TOKEN="e2e-token")
    return env


def run_openclaw(
    home: Path, *args: str, timeout: float = TURN_TIMEOUT_S, gateway_port: int | None = None
) -> str:
    node, entry = find_node(), find_openclaw()
    assert node is not None and entry is not None
    proc = subprocess.run(
        [str(node), str(entry), *args],
        env=openclaw_env(home, gateway_port),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=home,
    )
    assert proc.returncode == 0, f"openclaw {args[:3]} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc.stdout


def show_session(state: Path, session_id: str) -> dict[str, Any] | None:
    proc = subprocess.run(
        [*clawbridge_cmd(), "sessions", "show", session_id, "--json", "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        return None
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def openclaw_shim(folder: Path) -> Path:
    """An `openclaw` executable in `folder` (Node 24 running OpenClaw's entry), as a user has on PATH."""
    node, entry = find_node(), find_openclaw()
    assert node is not None and entry is not None
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "openclaw"
    shim.write_text(f'#!/bin/sh\nexec "{node}" "{entry}" "$@"\n')
    shim.chmod(0o755)
    return shim


def printed_text(stdout: str) -> str:
    """The assistant text `openclaw agent --json` printed (local and gateway output shapes)."""
    doc = json.loads(stdout)
    result = doc.get("result", doc)
    meta = result.get("meta") or {}
    if isinstance(meta.get("finalAssistantRawText"), str):
        return str(meta["finalAssistantRawText"])
    return "".join(p.get("text") or "" for p in result.get("payloads") or [])
