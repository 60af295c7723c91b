"""Which state dir and server every command acts on (`clawbridge.cli.target`): `--state-dir` >
`CLAWBRIDGE_STATE_DIR` > the one running server > the default; several running and none chosen is
refused; a command never shows one server's answers beside another state dir's store, and its
first line (stderr) says which it used. Against real `clawbridge up` servers; HOME (where the
index of running servers lives) is an empty folder per test (conftest)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from clawbridge.config import Settings
from clawbridge.store import Store
from clawbridge.store.versions import VersionStore
from clawbridge.trainer.identity import checkpoint_identity
from tests.support import ProxyProcess, free_port, wait_healthy
from tests.test_cli import _seed_store


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWBRIDGE_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "clawbridge.cli.main", *args], capture_output=True, text=True,
                          env=full_env, timeout=120)


@pytest.mark.slow
def test_commands_find_the_running_server_and_never_mix_stores(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The issue's case: a server on `--state-dir X`, another store in the default state dir."""
    default = Path(os.environ["HOME"]) / ".clawbridge"
    _seed_store(default)  # the default state dir holds another store: session cli-s, 2 turns
    x = ProxyProcess(tiny_model_dir, tmp_path / "X").start()
    try:
        # Even with the configured port pointing at X's server, the default state dir's commands
        # do not take X's server for theirs.
        out = cli("status", "--json", "--state-dir", str(default), env={"CLAWBRIDGE_PORT": str(x.port)})
        view = json.loads(out.stdout)
        assert not view["running"] and view["server"] is None and view["store"]["turns"]["main"] == 2, view
        assert out.stderr.splitlines()[0].startswith(f"using state dir {default} (--state-dir); no clawbridge server")

        # No flag: the one running server is used, and the first line says so.
        out = cli("status")
        first = out.stderr.splitlines()[0]
        assert out.returncode == 0 and f"server at {x.base}" in first and str(tmp_path / "X") in first, out.stderr
        assert "only running server" in first
        assert "running at " + x.base in out.stdout and "sessions: 0 active, 0 ended" in out.stdout, out.stdout
        added = cli("users", "add", "bob", "--json")
        assert added.returncode == 0, added.stderr
        assert json.loads(added.stdout)["user"] == "bob"
        assert cli("users", "add", "bob", "--json", "--state-dir", str(default)).returncode == 1  # no server there

        # A second server, on the default state dir: no flag is now refused, naming both.
        d = ProxyProcess(tiny_model_dir, default).start()
        try:
            out = cli("status")
            assert out.returncode == 2 and "2 clawbridge servers are running" in out.stderr, out.stderr
            assert x.base in out.stderr and d.base in out.stderr and "--state-dir" in out.stderr
            assert out.stdout == ""
            picked = json.loads(cli("status", "--json", env={"CLAWBRIDGE_STATE_DIR": str(tmp_path / "X")}).stdout)
            assert picked["server"] == x.base and picked["state_dir_from"] == "CLAWBRIDGE_STATE_DIR"
            picked = json.loads(cli("status", "--json", "--state-dir", str(default),
                                    env={"CLAWBRIDGE_STATE_DIR": str(tmp_path / "X")}).stdout)
            assert picked["server"] == d.base and picked["store"]["turns"]["main"] == 2  # the flag wins
            rewarded = cli("reward", "cli-s", "1", "--state-dir", str(default))
            assert rewarded.returncode == 0 and "recorded" in rewarded.stdout, rewarded.stderr
        finally:
            d.stop()
        # d stopped cleanly: X is the only one again.
        assert "only running server" in cli("status").stderr.splitlines()[0]
        x.kill(signal.SIGKILL)
        out = cli("status", "--json")
        assert json.loads(out.stdout)["state_dir"] == str(default) and not json.loads(out.stdout)["running"]
        assert "(the default); no clawbridge server runs on it" in out.stderr.splitlines()[0]
        index = Path(os.environ["HOME"]) / ".clawbridge" / "servers"
        assert list(index.glob("*.json")) == []  # the killed server's entry was found stale
    finally:
        x.stop()


@pytest.mark.slow
def test_up_on_another_models_state_dir_prints_the_command_that_works(
        tiny_model_dir: Path, tiny_chatml_dir: Path, tmp_path: Path) -> None:
    """The README's real-model block after the tiny one: `up` refuses the tiny model's state dir and
    prints one command; that command, as printed, serves."""
    state = tmp_path / "state"
    store = Store.open(state)  # the tiny model's state dir, once it has trained: a committed version
    VersionStore(store).commit_base(str(state / "checkpoints" / "v0"),
                                    checkpoint_identity(Settings(model=str(tiny_model_dir)), "local"))
    store.close()
    refused = cli("up", "--backend", "local", "--model", str(tiny_chatml_dir), "--state-dir", str(state),
                  "--port", str(free_port()))
    assert refused.returncode == 1 and "belong to another training setup" in refused.stderr, refused.stderr
    [command] = [ln.strip() for ln in refused.stderr.splitlines() if ln.strip().startswith("clawbridge up ")]
    argv = shlex.split(command)
    assert argv[-2:] == ["--state-dir", f"{state}-tiny-chatml"] and str(tiny_chatml_dir) in argv, command
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWBRIDGE_")}
    proc = subprocess.Popen([sys.executable, "-m", "clawbridge.cli.main", *argv[1:]], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = argv[argv.index("--port") + 1]
        assert wait_healthy(f"http://127.0.0.1:{port}", 300, proc)["model"] == "tiny-chatml"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert (tmp_path / "state-tiny-chatml" / "clawbridge.db").exists() and (state / "clawbridge.db").exists()
