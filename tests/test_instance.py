"""One server per state dir, and a busy port reported before any model loads (clawbridge.runtime.instance)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from clawbridge.runtime.instance import PortInUse, StateDirBusy, StateDirLock, bind_listener, read_holder
from tests.support import ProxyProcess, free_port


def test_lock_names_holder_and_is_released(tmp_path: Path) -> None:
    first = StateDirLock(tmp_path)
    first.acquire()
    first.record("http://127.0.0.1:1234")
    assert read_holder(first.path) == (os.getpid(), "http://127.0.0.1:1234")
    with pytest.raises(StateDirBusy) as info:
        StateDirLock(tmp_path).acquire()  # another open file description: flock refuses it too
    assert f"pid {os.getpid()}" in str(info.value) and "http://127.0.0.1:1234" in str(info.value)
    first.release()
    second = StateDirLock(tmp_path)
    second.acquire()
    assert second.held
    second.release()


def test_bind_listener_reports_the_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUse) as info:
            bind_listener("127.0.0.1", port)
        assert f"port {port}" in str(info.value) and "--port" in str(info.value)


def _up(model: Path, state: Path, port: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWBRIDGE_")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "clawbridge.cli.main", "up", "--backend", "local", "--model", str(model),
         "--port", str(port), "--state-dir", str(state)],
        capture_output=True, text=True, timeout=120, env=env,
    )


def test_second_up_on_a_state_dir_refuses_before_loading(tiny_model_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = ProxyProcess(tiny_model_dir, state).start()
    try:
        assert first.proc is not None
        # An empty model folder: if the lock were checked after loading, this would fail on the model.
        broken = tmp_path / "not-a-model"
        broken.mkdir()
        second = _up(broken, state, free_port())
        assert second.returncode == 1, second.stdout + second.stderr
        out = " ".join((second.stdout + second.stderr).split())
        assert f"pid {first.proc.pid}" in out and first.base in out, out
        assert "--state-dir" in out
        assert first.proc.poll() is None  # the first server is untouched
    finally:
        first.stop()


def test_up_on_a_busy_port_refuses_before_loading(tmp_path: Path) -> None:
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _up(broken, tmp_path / "state", port)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1, out
    assert f"port {port}" in out and "already in use" in out, out
    assert not (tmp_path / "state" / "server.json").exists()
