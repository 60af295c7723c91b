"""Helpers for tests: free ports, the proxy as a subprocess, the proxy in-process on a thread.

Every server binds 127.0.0.1, waits in bounded loops and is stopped by its pid (or its thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from clawbridge.backend import ServingBackend
from clawbridge.config import Settings
from clawbridge.runtime.clock import SYSTEM_CLOCK, Clock
from clawbridge.runtime.keys import ADMIN_KEY_FILE, CLIENT_KEY_FILE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(base: str, timeout_s: float = 120.0, proc: subprocess.Popen[Any] | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"proxy exited with {proc.returncode}")
        try:
            r = httpx.get(f"{base}/health", timeout=2.0)
            if r.status_code == 200:
                return dict(r.json())
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.2)
    raise TimeoutError(f"proxy at {base} not healthy after {timeout_s}s: {last}")


@dataclass
class ProxyProcess:
    """`clawbridge up` in a subprocess."""

    model_dir: Path
    state_dir: Path
    port: int = 0
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    backend_args: tuple[str, ...] | None = None
    """Replaces `--backend local --model MODEL_DIR` (e.g. a hosted backend and its model name)."""
    command: tuple[str, ...] | None = None
    """Replaces `python -m clawbridge.cli.main` (e.g. the `clawbridge` of another venv)."""

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> ProxyProcess:
        self.port = self.port or free_port()
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")  # tiny-model decode steps are faster single-threaded
        env.update(self.env or {})
        self.log_path = self.state_dir / f"proxy-{self.port}.log"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        backend = self.backend_args or ("--backend", "local", "--model", str(self.model_dir))
        cmd = [*(self.command or (sys.executable, "-m", "clawbridge.cli.main")), "up", *backend,
               "--port", str(self.port), "--state-dir", str(self.state_dir), *self.extra_args]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(self.base, timeout_s, self.proc)
        except Exception:
            self.stop()
            raise RuntimeError(f"proxy failed to start; log:\n{self.log_path.read_text()[-4000:]}") from None
        return self

    def key(self, name: str = CLIENT_KEY_FILE) -> str:
        return (self.state_dir / name).read_text().strip()

    @property
    def admin_key(self) -> str:
        return self.key(ADMIN_KEY_FILE)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)


class InProcessProxy:
    """The real app under uvicorn on a thread, over a backend you pass (e.g. a fake)."""

    def __init__(self, settings: Settings, backend: ServingBackend, clock: Clock = SYSTEM_CLOCK) -> None:
        self.settings = settings
        self.clock = clock
        """The store's clock (a `FakeClock` lets a test move time instead of waiting)."""
        self.backend = backend
        self.port = settings.port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.state: Any = None
        self.app: Any = None
        """The FastAPI app once started (its `state.dashboard` is the dashboard's login manager)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        """The event loop the app runs on (to call the app as ASGI from a test)."""

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> InProcessProxy:
        from clawbridge.proxy.app import build_app
        from clawbridge.server import ProxyServer, build_state, uvicorn_config

        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            async def main() -> None:
                try:
                    self.loop = asyncio.get_running_loop()
                    self.state = await build_state(self.settings, self.backend, self.clock)
                    app = self.app = build_app(self.state)
                    cfg = uvicorn_config(app, self.settings, log_level="warning")
                    self._server = ProxyServer(cfg, self.settings.state_path, self.state.drain,
                                               self.settings.drain_grace_s)
                    ready.set()
                    await self._server.serve()
                except BaseException as exc:
                    failure.append(exc)
                    ready.set()
                finally:
                    if self.state is not None:
                        self.state.writer.close()
                        self.state.store.close()

            asyncio.run(main())

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(60)
        if failure:
            raise failure[0]
        wait_healthy(self.base, 30)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)


@contextlib.contextmanager
def in_process_proxy(settings: Settings, backend: ServingBackend) -> Iterator[InProcessProxy]:
    proxy = InProcessProxy(settings, backend).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def wait_for(check: Any, timeout_s: float = 30.0, what: str = "condition") -> Any:
    """Poll `check()` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
