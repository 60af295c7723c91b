"""A streaming client that goes away before its stream starts: the call is cancelled at the sampler
and recorded `cancelled` (`clawbridge.proxy.call` invariants), never left generating unrecorded.

The sampler here starts a stream the way SGLang's does: `sample()` returns only once the request
is admitted (its first chunk), so a call can wait inside it. Real app, uvicorn, SQLite; the client
is a raw socket that closes (a disconnect before any byte of the answer), or the app called as ASGI
by a spec-2.4 server whose first `send` says the client has gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import ClientDisconnect

from clawbridge.chat.render import Renderer
from clawbridge.serving.sampler import FakeSampler, FinishedStream, SampledToken, SampleStream, SamplingParams
from clawbridge.store import DB_FILENAME
from tests.fake_proxy import script_for, start_fake_proxy
from tests.support import InProcessProxy, wait_for

ADMIT_WAIT_S = 60.0


@dataclass
class TrackedStream(FinishedStream):
    """A finished sample that remembers whether anyone closed it."""

    closed: threading.Event = field(default_factory=threading.Event)

    async def aclose(self) -> None:
        self.closed.set()
        await super().aclose()


@dataclass
class QueuedSampler(FakeSampler):
    """`sample()` waits until `admit` is set (a request queued in the engine), then returns a
    `TrackedStream`; a start that is cancelled while waiting sets `cancelled`."""

    admit: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    returned: threading.Event = field(default_factory=threading.Event)
    streams: list[TrackedStream] = field(default_factory=list)

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> SampleStream:
        self.entered.set()
        try:
            for _ in range(int(ADMIT_WAIT_S / 0.01)):  # bounded: a test that never admits fails, not hangs
                if self.admit.is_set():
                    break
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        toks = [SampledToken(t, -0.5) for t in self.script[: params.max_tokens]]
        stream = TrackedStream(toks, self.version, "length")
        self.streams.append(stream)
        self.returned.set()
        return stream


def turns(proxy: InProcessProxy) -> list[tuple[str, int]]:
    """(status, completion tokens) of every recorded turn, read as another process would."""
    conn = sqlite3.connect(f"file:{proxy.settings.state_path / DB_FILENAME}?mode=ro", uri=True, timeout=30)
    try:
        return [(str(r[0]), len(bytes(r[1]))) for r in
                conn.execute("SELECT status, completion_token_ids FROM turns ORDER BY created_at")]
    finally:
        conn.close()


def body(stream: bool = True) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 200,
                       "stream": stream}).encode()


def test_a_client_that_leaves_while_its_stream_is_queued_cancels_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    sampler = QueuedSampler(script=script_for(renderer, "a long answer " * 20, stop=False))
    proxy = start_fake_proxy(tiny_model_dir, tmp_path / "state", sampler)
    try:
        data = body()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{proxy.port}\r\n"
                f"Authorization: Bearer {proxy.state.keys.client}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            s.sendall(head + data)
            assert sampler.entered.wait(30), "the call never reached the sampler"
        # the client is gone while the call waits to be admitted: the start is cancelled, nothing
        # is generated, and the call is recorded cancelled
        wait_for(sampler.cancelled.is_set, 30, "the queued start to be cancelled")
        wait_for(lambda: turns(proxy) == [("cancelled", 0)], 30, "the call recorded cancelled")
        assert sampler.streams == []
    finally:
        sampler.admit.set()
        proxy.stop()


def test_a_disconnect_before_the_first_byte_closes_the_stream_and_records_it(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    """Under ASGI spec 2.4 a server reports a client that has gone by raising OSError from `send`:
    here the very first one (the response head), so the response never iterates its events. The
    stream must still be closed at the sampler and the call recorded cancelled."""
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    sampler = QueuedSampler(script=script_for(renderer, "a long answer " * 20, stop=False))
    sampler.admit.set()
    proxy = start_fake_proxy(tiny_model_dir, tmp_path / "state", sampler)
    data = body()
    delivered = False
    sends: list[str] = []

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.Event().wait()  # a 2.4 server need not say "disconnect" here
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sends.append(message["type"])
        raise OSError("the client has gone")

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000),
             "server": ("127.0.0.1", proxy.port),
             "headers": [(b"host", f"127.0.0.1:{proxy.port}".encode()),
                         (b"authorization", f"Bearer {proxy.state.keys.client}".encode()),
                         (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]}
    try:
        assert proxy.loop is not None
        with contextlib.suppress(ClientDisconnect):
            asyncio.run_coroutine_threadsafe(proxy.app(scope, receive, send), proxy.loop).result(60)
        assert sends == ["http.response.start"] and len(sampler.streams) == 1
        wait_for(sampler.streams[0].closed.is_set, 30, "the stream to be closed at the sampler")
        wait_for(lambda: turns(proxy) == [("cancelled", 0)], 30, "the call recorded cancelled")
    finally:
        proxy.stop()
