"""No store call on the event loop: while another thread holds the store's lock for a whole
transaction (as the trainer's and the reward worker's threads do), the real proxy keeps answering
`/health` and keeps streaming a sampled answer; the requests that need the store wait for it in a
worker thread, and every one of them completes, recorded, once the lock is let go."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import httpx
import pytest

from clawbridge.chat.render import Renderer
from tests.fake_proxy import SwitchableSampler, script_for, start_fake_proxy
from tests.support import InProcessProxy, wait_for

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture()
def proxy(tiny_model_dir: Path, tmp_path: Path) -> Iterator[InProcessProxy]:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    p = start_fake_proxy(tiny_model_dir, tmp_path / "state", SwitchableSampler(script=script_for(renderer, "hello")))
    yield p
    p.stop()


def waiting_in(function: str) -> bool:
    """Some thread other than this one is inside `function` (e.g. blocked on the store's lock there)."""
    me = threading.get_ident()
    for ident, top in sys._current_frames().items():
        frame: FrameType | None = top
        while ident != me and frame is not None:
            if frame.f_code.co_name == function:
                return True
            frame = frame.f_back
    return False


def test_a_held_store_lock_never_stalls_request_handling(proxy: InProcessProxy) -> None:
    store = proxy.state.store
    admin = {"Authorization": f"Bearer {proxy.state.keys.admin}"}
    session_key = httpx.post(proxy.base + "/rl/start_session", json={}, headers=admin, timeout=30).json()["api_key"]
    held, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:  # a long write transaction on another thread, like a trainer step's commit
        with store.write():
            held.set()
            release.wait(120)

    results: dict[str, object] = {}

    def keyed_call() -> None:  # a user or session key is looked up in the store: it must wait, but not on the loop
        results["keyed"] = httpx.post(proxy.base + "/v1/chat/completions", json={"model": "tiny", "messages": MSG},
                                      headers={"Authorization": f"Bearer {session_key}"}, timeout=120)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    keyed = threading.Thread(target=keyed_call)
    try:
        assert held.wait(30)
        keyed.start()
        wait_for(lambda: waiting_in("_key_principal"), what="the keyed call to wait for the store")
        # The loop is free: /health answers and a streamed answer arrives, token by token ...
        assert httpx.get(proxy.base + "/health", timeout=30).status_code == 200
        with httpx.stream("POST", proxy.base + "/v1/chat/completions", timeout=120,
                          json={"model": "tiny", "messages": MSG, "stream": True},
                          headers={"Authorization": f"Bearer {proxy.state.keys.client}"}) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert '"content"' in first or '"role"' in first
            # ... while the keyed call still waits for the lock (so the lock was really in the way).
            assert keyed.is_alive() and waiting_in("_key_principal")
            release.set()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # the turn was recorded once the lock was free, then closed
    finally:
        release.set()
        holder.join(30)
        keyed.join(120)
    r = results["keyed"]
    assert isinstance(r, httpx.Response) and r.status_code == 200, r
    stats = store.stats()
    assert stats["turns"]["main"] == 2 and stats["sessions"]["active"] >= 1
