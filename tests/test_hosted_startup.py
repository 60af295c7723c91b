"""Hosted backends fail fast and clean: `clawbridge up` (a subprocess, the real tinker and
fireworks-ai SDKs) against the local protocol servers and a closed or silent port exits 1 within
the probe's bound, saying what is wrong: unreachable, bad key, or model (deployment) unknown.

Each subprocess is bounded by `UP_BOUND_S`, far under the 6.5 minutes an unreachable Tinker took
before the probe existed; nothing else here depends on wall-clock time.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("clawbridge_tinker")
pytest.importorskip("clawbridge_fireworks")

from tests.fireworks_server import FakeFireworks, ServerThread
from tests.support import free_port
from tests.tinker_server import TinkerProtocolServer

TINKER_MODEL = "test/tiny-qwen3"
FW_MODEL = "accounts/fireworks/models/qwen3-test"
FW_SHAPE = "accounts/fireworks/trainingShapes/ts-test"
UP_BOUND_S = 240.0
"""Python start-up and imports (the tinker SDK imports torch: 22 s at load 8 under nice 19) on a
loaded 2-core machine, plus a 2 s probe; still well under the old 6.5 minutes."""


def up(state: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("CLAWBRIDGE_", "TINKER_", "FIREWORKS_"))}
    full.update({"CLAWBRIDGE_PROBE_TIMEOUT_S": "2", **env})
    cmd = [sys.executable, "-m", "clawbridge.cli.main", "up", "--port", str(free_port()),
           "--state-dir", str(state), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=full, timeout=UP_BOUND_S)


def closed_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    return free_port()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


@pytest.fixture
def tinker() -> Iterator[TinkerProtocolServer]:
    srv = TinkerProtocolServer(models=(TINKER_MODEL,))
    srv.api_keys = {"tml-good-key"}
    srv.start()
    yield srv
    srv.stop()


def tinker_up(state: Path, url: str, key: str = "tml-good-key", model: str = TINKER_MODEL) -> subprocess.CompletedProcess[str]:
    return up(state, {"TINKER_API_KEY": key, "CLAWBRIDGE_TINKER_BASE_URL": url},
              "--backend", "tinker", "--model", model, "--tokenizer", str(state / "no-tokenizer-needed"))


def assert_refused(r: subprocess.CompletedProcess[str], *phrases: str) -> str:
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 1, out
    assert "cannot start:" in out, out
    for phrase in phrases:
        assert phrase in out, (phrase, out)
    assert "Traceback" not in out, out
    return out


# ---- Tinker


def test_tinker_connection_refused(tmp_path: Path) -> None:
    port = closed_port()
    out = assert_refused(tinker_up(tmp_path, f"http://127.0.0.1:{port}"),
                         "tinker: unreachable", f"127.0.0.1:{port}", "connection refused", "[backends.tinker] base_url")
    assert "good-key" not in out


def test_tinker_no_answer(tmp_path: Path, silent_port: int) -> None:
    assert_refused(tinker_up(tmp_path, f"http://127.0.0.1:{silent_port}"),
                   "tinker: unreachable", "no answer", "within 2 s")


def test_tinker_bad_key(tmp_path: Path, tinker: TinkerProtocolServer) -> None:
    out = assert_refused(tinker_up(tmp_path, tinker.base_url, key="tml-wrong-key"),
                         "tinker: bad key", "HTTP 401", "TINKER_API_KEY")
    assert "wrong-key" not in out
    assert "create_session" not in tinker.routes()  # refused before the SDK started a session


def test_tinker_model_unknown(tmp_path: Path, tinker: TinkerProtocolServer) -> None:
    assert_refused(tinker_up(tmp_path, tinker.base_url, model="test/no-such-model"),
                   "tinker: model unknown", "'test/no-such-model'", TINKER_MODEL)
    assert "create_session" not in tinker.routes()


# ---- Fireworks


@pytest.fixture
def fireworks() -> Iterator[tuple[FakeFireworks, ServerThread]]:
    fw = FakeFireworks()
    fw.offered_models = {FW_MODEL}
    with ServerThread(fw) as srv:
        yield fw, srv


def fireworks_up(state: Path, url: str, key: str = "fw-test-key", model: str = FW_MODEL,
                 **env: str) -> subprocess.CompletedProcess[str]:
    return up(state, {"FIREWORKS_API_KEY": key, "FIREWORKS_ACCOUNT_ID": "acct-test",
                      "CLAWBRIDGE_FIREWORKS_BASE_URL": url, "CLAWBRIDGE_FIREWORKS_TRAINING_SHAPE": FW_SHAPE, **env},
              "--backend", "fireworks", "--model", model, "--tokenizer", str(state / "no-tokenizer-needed"), "--yes")


def test_fireworks_connection_refused(tmp_path: Path) -> None:
    port = closed_port()
    assert_refused(fireworks_up(tmp_path, f"http://127.0.0.1:{port}"),
                   "fireworks: unreachable", f"127.0.0.1:{port}", "connection refused", "[backends.fireworks] base_url")


def test_fireworks_no_answer(tmp_path: Path, silent_port: int) -> None:
    assert_refused(fireworks_up(tmp_path, f"http://127.0.0.1:{silent_port}"),
                   "fireworks: unreachable", "no answer", "within 2 s")


def test_fireworks_bad_key(tmp_path: Path, fireworks: tuple[FakeFireworks, ServerThread]) -> None:
    fw, srv = fireworks
    out = assert_refused(fireworks_up(tmp_path, srv.url, key="fw-wrong-key"),
                         "fireworks: bad key", "HTTP 401", "FIREWORKS_API_KEY")
    assert "wrong-key" not in out
    assert not fw.ops("job.") and not fw.ops("deployment.")  # nothing planned or created


def test_fireworks_model_unknown(tmp_path: Path, fireworks: tuple[FakeFireworks, ServerThread]) -> None:
    fw, srv = fireworks
    assert_refused(fireworks_up(tmp_path, srv.url, model="accounts/fireworks/models/no-such"),
                   "fireworks: model unknown", "accounts/fireworks/models/no-such")
    assert not fw.ops("job.") and not fw.ops("deployment.")


def test_fireworks_named_deployment_missing(tmp_path: Path, fireworks: tuple[FakeFireworks, ServerThread]) -> None:
    fw, srv = fireworks
    assert_refused(fireworks_up(tmp_path, srv.url, CLAWBRIDGE_FIREWORKS_DEPLOYMENT="dep-gone"),
                   "fireworks: model unknown", "deployment dep-gone does not exist", "[backends.fireworks] deployment")
    assert not fw.ops("job.create") and not fw.ops("deployment.create")
