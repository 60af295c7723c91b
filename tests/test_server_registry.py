"""The OS user's index of running servers (`clawbridge.runtime.address`): private files, found while the
server lives, stale once it is killed (pid gone, or nothing listening). How the commands use it:
tests/test_cli_target.py.

The index lives under HOME, which conftest points at an empty folder for every test."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from clawbridge.runtime.address import (
    ADDRESS_FILE,
    clear_address,
    read_address,
    running_servers,
    server_for,
    servers_dir,
    write_address,
)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """Something listening on a loopback port, standing in for a server's socket."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s


def _url(sock: socket.socket) -> str:
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _pretend_started_by(state: Path, pid: int, url: str) -> Path:
    """Rewrite the address file and index entry `write_address` made to name `pid` (a server that
    was started by another process, e.g. one since killed with -9)."""
    raw = json.loads((state / ADDRESS_FILE).read_text())
    (state / ADDRESS_FILE).write_text(json.dumps({**raw, "pid": pid, "url": url}))
    [entry] = [e for e in servers_dir().glob(f"*-{os.getpid()}.json")
               if json.loads(e.read_text())["state_dir"] == str(state.resolve())]
    moved = entry.with_name(entry.name.replace(f"-{os.getpid()}.json", f"-{pid}.json"))
    entry.rename(moved)
    moved.write_text(json.dumps({"state_dir": str(state.resolve()), "pid": pid}))
    return moved


def test_a_listening_server_is_indexed_privately_and_found(tmp_path: Path, listener: socket.socket) -> None:
    state = tmp_path / "state"
    write_address(state, _url(listener), "tiny-model")
    [entry] = list(servers_dir().glob("*.json"))
    assert str(servers_dir()).startswith(os.environ["HOME"])
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600 and stat.S_IMODE(servers_dir().stat().st_mode) == 0o700
    assert stat.S_IMODE((state / ADDRESS_FILE).stat().st_mode) == 0o600
    [found] = running_servers()
    assert found.state_dir == state.resolve() and found.url == _url(listener)
    assert found.address.pid == os.getpid() and found.address.model == "tiny-model"
    assert "tiny-model" in found.describe() and str(os.getpid()) in found.describe()
    clear_address(state)
    assert running_servers() == [] and read_address(state) is None and not list(servers_dir().glob("*.json"))


def test_a_killed_servers_entry_is_stale_and_removed(tmp_path: Path, listener: socket.socket) -> None:
    """pid gone: not running (even though the port still answers), and the entry is removed."""
    state = tmp_path / "state"
    write_address(state, _url(listener))
    entry = _pretend_started_by(state, _dead_pid(), _url(listener))
    assert server_for(state) is None
    assert running_servers() == [] and not entry.exists()


def test_a_live_pid_that_does_not_listen_is_not_a_server(tmp_path: Path) -> None:
    """pid alive (this test) but nothing listens at the recorded URL (a reused pid, or a server
    gone from its port): not running."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = _url(s)  # bound, never listening: connections are refused
        state = tmp_path / "state"
        write_address(state, closed)
        assert server_for(state) is None and running_servers() == []


def test_a_newer_server_on_the_same_state_dir_keeps_its_entry(tmp_path: Path, listener: socket.socket) -> None:
    """Removing a stale entry never removes the entry of the server that now holds the state dir."""
    state = tmp_path / "state"
    write_address(state, _url(listener))
    old = _pretend_started_by(state, _dead_pid(), _url(listener))
    write_address(state, _url(listener))  # the new server (this process) on the same state dir
    [found] = running_servers()
    assert found.address.pid == os.getpid() and not old.exists()
    assert len(list(servers_dir().glob("*.json"))) == 1


def test_another_process_on_the_port_is_not_the_server(tmp_path: Path) -> None:
    """The recorded pid is alive and ours, and something listens at the recorded URL, but the
    listener is another process (a program that took a killed server's port): not the server, so
    no command sends it the admin key."""
    if not Path("/proc/net/tcp").exists():
        pytest.skip("no /proc/net/tcp here: which process holds a socket cannot be told")
    code = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); time.sleep(120)")
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None
        url = f"http://127.0.0.1:{other.stdout.readline().strip()}"
        state = tmp_path / "state"
        write_address(state, url)  # names this process, which does not listen there
        assert server_for(state) is None and running_servers() == []
    finally:
        other.kill()
        other.wait()
