"""The OpenClaw plugin installed the way OpenClaw installs plugins, with the real OpenClaw.

Needs Node 24 and openclaw@2026.9.6 (`.ci/install_openclaw.sh`); skipped with the reason otherwise.
- `npm pack` of extensions/openclaw gives a tarball that `openclaw plugins install` accepts;
  `clawbridge openclaw install` then adds the provider and the hook grant, leaving OpenClaw's copy
  alone; `openclaw plugins list --json` shows it enabled and loaded, `openclaw plugins doctor`
  reports nothing for it, and a real agent turn reaches `clawbridge up` with the session headers.
- `clawbridge openclaw install` with `openclaw` on PATH links the plugin through
  `openclaw plugins install --link` (and uninstall through `openclaw plugins uninstall`).
Every OpenClaw command takes 15-60 s on a loaded 2-core machine; the module takes a few minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clawbridge.openclaw import json5edit
from clawbridge.openclaw.toolchain import find_node, find_npm_cli, missing_reason
from tests.openclaw_support import clawbridge_cmd, openclaw_shim, run_openclaw, show_session
from tests.support import ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

EXT = Path(__file__).resolve().parents[1] / "extensions" / "openclaw"
FRESH_CONFIG = "// a fresh OpenClaw home\n{\n  update: { checkOnStart: false }, // no network here\n}\n"
MAX_TOKENS = 32
AGENT_TIMEOUT_S = 480  # 25-60 s on a quiet 2-core machine; 240 s ran out at load average 14


@pytest.fixture(scope="module")
def toolchain() -> None:
    reason = missing_reason(need_openclaw=True)
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def server(toolchain: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    root = tmp_path_factory.mktemp("ocpkg")
    subprocess.run([*clawbridge_cmd(), "model", "tiny", str(root / "tiny")], check=True, timeout=300)
    env = {k: "" for k in os.environ if k.startswith("CLAWBRIDGE_")}
    proc = ProxyProcess(root / "tiny", root / "state", env=env).start(timeout_s=180)
    try:
        yield proc
    finally:
        proc.stop()


def _home(root: Path) -> Path:
    home = root / "home"
    (home / ".openclaw").mkdir(parents=True)
    (home / ".openclaw" / "openclaw.json").write_text(FRESH_CONFIG)
    return home


def _clawbridge_openclaw(home: Path, shim_dir: Path, *args: str) -> str:
    """`clawbridge openclaw ARGS` as a user runs it: HOME is the OpenClaw home, `openclaw` on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENCLAW_", "CLAWBRIDGE_"))}
    env.update(HOME=str(home), PATH=f"{shim_dir}{os.pathsep}{env.get('PATH', '')}")
    proc = subprocess.run(
        [*clawbridge_cmd(), "openclaw", *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def _plugin_row(home: Path) -> dict[str, Any]:
    listing = json.loads(run_openclaw(home, "plugins", "list", "--json"))
    rows = [p for p in listing["plugins"] if p["id"] == "clawbridge"]
    assert len(rows) == 1, [p["id"] for p in listing["plugins"] if p.get("origin") != "bundled"]
    print("openclaw plugins list --json, our plugin:", json.dumps(rows[0]))
    return dict(rows[0])


def _npm_pack(dest: Path) -> Path:
    node = find_node()
    assert node is not None
    npm = find_npm_cli(node)
    assert npm is not None, "npm not found beside Node (set CLAWBRIDGE_NPM_CLI)"
    env = {**os.environ, "PATH": f"{node.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(
        [str(node), str(npm), "pack", "--json", "--pack-destination", str(dest)],
        cwd=EXT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dest / json.loads(proc.stdout)[0]["filename"]


def test_npm_pack_tarball_installs_with_openclaw_and_carries_session_headers(
    server: ProxyProcess, tmp_path: Path
) -> None:
    tarball = _npm_pack(tmp_path)
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
    assert {"package/package.json", "package/openclaw.plugin.json", "package/index.js"} <= names

    home, shim_dir = _home(tmp_path), tmp_path / "bin"
    openclaw_shim(shim_dir)
    # Unattended, OpenClaw asks for --force (a source outside ClawHub) and --accept-capabilities.
    out = run_openclaw(home, "plugins", "install", str(tarball), "--force", "--accept-capabilities")
    assert "Installed plugin: clawbridge" in out, out

    state = server.state_dir
    out = _clawbridge_openclaw(
        home, shim_dir, "install", "--state-dir", str(state), "--base-url", f"{server.base}/v1", "--set-default"
    )
    managed = (home / ".openclaw" / "extensions" / "clawbridge").resolve()
    assert f"installed by OpenClaw itself at {managed}" in out, out
    config = json5edit.loads((home / ".openclaw" / "openclaw.json").read_text())
    assert config["plugins"]["entries"]["clawbridge"]["hooks"] == {"allowConversationAccess": True}
    assert "load" not in config["plugins"]  # OpenClaw loads its own copy; no second one linked
    config = json5edit.loads((home / ".openclaw" / "openclaw.json").read_text())
    config["models"]["providers"]["clawbridge"]["models"][0]["maxTokens"] = MAX_TOKENS
    (home / ".openclaw" / "openclaw.json").write_text(json.dumps(config, indent=2))

    row = _plugin_row(home)
    assert row["enabled"] is True and row["status"] == "loaded" and row["rootDir"] == str(managed)
    assert row["providerIds"] == ["clawbridge"] and row["version"] == "0.1.0"

    doctor = run_openclaw(home, "plugins", "doctor", "--json")
    report = json.loads(doctor[doctor.index("{"):])
    ours = [d for d in report.get("diagnostics", []) if d.get("pluginId") == "clawbridge"]
    ours += [e for e in report.get("pluginErrors", []) if "clawbridge" in json.dumps(e)]
    assert ours == [], ours

    session = "pkg-s1"
    run_openclaw(home, "agent", "--local", "--session-id", session, "--message", "Hello from the package.", "--json",
                 timeout=AGENT_TIMEOUT_S)
    view = show_session(state, f"agent:main:explicit:{session}")
    assert view is not None, server.log_path.read_text()[-3000:] if server.log_path else "no log"
    assert view["source"] == "header"  # X-Session-Id, not the Runtime-line fallback
    main = [t for t in view["turns"] if t["turn_type"] == "main"]
    assert len(main) == 1 and main[0]["completion_token_ids"]
    assert main[0]["meta"]["trigger"] == "user" and main[0]["meta"].get("turn_id_header")


def test_clawbridge_install_links_the_plugin_through_openclaws_cli(server: ProxyProcess, tmp_path: Path) -> None:
    home, shim_dir = _home(tmp_path), tmp_path / "bin"
    shim = openclaw_shim(shim_dir)
    state = tmp_path / "state"  # its own state dir: the plugin copy and the record
    (state).mkdir()
    (state / "client_key").write_text(server.key() + "\n")
    (state / "client_key").chmod(0o600)
    common = ["--state-dir", str(state)]
    out = _clawbridge_openclaw(home, shim_dir, "install", *common, "--base-url", f"{server.base}/v1")
    ext = (state / "openclaw" / "extension").resolve()
    assert f"OpenClaw's CLI: {shim}" in out
    assert f"ran `openclaw plugins install --link {ext} --force --accept-capabilities`" in out, out
    config = json5edit.loads((home / ".openclaw" / "openclaw.json").read_text())
    assert config["plugins"]["load"]["paths"] == [str(ext)]
    assert config["plugins"]["entries"]["clawbridge"] == {"enabled": True, "hooks": {"allowConversationAccess": True}}
    row = _plugin_row(home)
    assert row["enabled"] is True and row["status"] == "loaded" and row["rootDir"] == str(ext)

    out = _clawbridge_openclaw(home, shim_dir, "uninstall", *common)
    assert "ran `openclaw plugins uninstall clawbridge --force`" in out, out
    config = json5edit.loads((home / ".openclaw" / "openclaw.json").read_text())
    assert "load" not in config["plugins"] and "clawbridge" not in config.get("models", {}).get("providers", {})
    assert not ext.exists()
