"""Durability: SIGKILL the proxy mid-stream and after answered turns; every answered turn survives intact."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import openai

from clawbridge.cli.status import gather_status
from clawbridge.cli.target import target_of
from clawbridge.config import Settings
from clawbridge.runtime.address import read_address
from clawbridge.store import Store
from tests.support import ProxyProcess, free_port


def test_kill_mid_stream_and_after_loses_no_answered_turn(tiny_model_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    proxy = ProxyProcess(tiny_model_dir, state).start()
    answered: dict[str, dict[str, object]] = {}
    try:
        client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=proxy.key(), max_retries=0, timeout=60)
        for i in range(4):
            stream = i % 2 == 0
            kw = dict(model="default", messages=[{"role": "user", "content": f"turn {i}"}], max_tokens=10, seed=i,
                      extra_headers={"X-Session-Id": "durable"})
            if stream:
                text = ""
                last_id = ""
                for chunk in client.chat.completions.create(stream=True, **kw):  # type: ignore[call-overload]
                    last_id = chunk.id
                    for ch in chunk.choices:
                        text += (ch.delta.content or "") + (getattr(ch.delta, "reasoning_content", None) or "")
                answered[last_id.replace("chatcmpl-", "turn_")] = {"text": text}
            else:
                r = client.chat.completions.create(**kw)  # type: ignore[call-overload]
                m = r.choices[0].message
                answered[r.id.replace("chatcmpl-", "turn_")] = {
                    "text": (m.content or "") + (getattr(m, "reasoning_content", None) or "")}

        # Start a long stream, read a few chunks, then kill -9 the server while it is streaming.
        got_chunks = threading.Event()

        def long_stream() -> None:
            try:
                with httpx.stream("POST", proxy.base + "/v1/chat/completions", timeout=60,
                                  headers={"Authorization": f"Bearer {proxy.key()}", "X-Session-Id": "durable"},
                                  json={"model": "default", "messages": [{"role": "user", "content": "long"}],
                                        "max_tokens": 5000, "stream": True, "temperature": 1.0,
                                        "stop": ["\x00never"]}) as r:
                    for n, _ in enumerate(r.iter_lines(), start=1):
                        if n >= 3:
                            got_chunks.set()
            except httpx.HTTPError:
                pass

        # `status` with no --port finds the server at the address `up` recorded in the state dir.
        seen = gather_status(target_of(_status_settings(state)))
        assert seen["running"] and seen["server"] == proxy.base, seen

        t = threading.Thread(target=long_stream)
        t.start()
        assert got_chunks.wait(60), "the long stream never started"
        proxy.kill()
        t.join(30)
    finally:
        proxy.stop()
    # The killed server's address file is left behind; status tries it, gets no answer, reads the store.
    assert read_address(state) is not None
    after_kill = gather_status(target_of(_status_settings(state)))
    assert not after_kill["running"] and after_kill["store"]["turns"]["main"] >= len(answered)

    # Restart on the same state dir: the answered turns are all there, intact.
    proxy2 = ProxyProcess(tiny_model_dir, state).start()
    try:
        store = Store.open(state)
        view = store.session_view("durable")
        assert view is not None
        turns = {t["turn_id"]: t for t in view["turns"]}
        assert set(answered) <= set(turns)
        for turn_id, seen in answered.items():
            t = turns[turn_id]
            assert t["status"] == "ok"
            assert len(t["completion_token_ids"]) == len(t["completion_logprobs"]) >= 1
            msg = t["response"]["choices"][0]["message"]
            assert (msg.get("content") or "") + (msg.get("reasoning_content") or "") == seen["text"]
        # The store is usable after the crash: the restarted server records new turns into the same session.
        client = openai.OpenAI(base_url=proxy2.base + "/v1", api_key=proxy2.key(), max_retries=0, timeout=60)
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "after"}],  # type: ignore[arg-type]
                                       max_tokens=4, extra_headers={"X-Session-Id": "durable"})
        # Committed before the response was sent (the proxy's invariant): there at once, no polling.
        assert len(store.session_view("durable")["turns"]) == len(view["turns"]) + 1  # type: ignore[index]
        store.close()
        assert gather_status(target_of(_status_settings(state)))["server"] == proxy2.base
    finally:
        proxy2.stop()
    assert read_address(state) is None, "a clean exit removes the address file"


def _status_settings(state: Path) -> Settings:
    """Settings as `clawbridge status --state-dir STATE` sees them: a configured port where nothing listens."""
    return Settings.model_validate({"state_dir": state, "port": free_port()})
