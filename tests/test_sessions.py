"""Session resolution, the /rl/* API, rewards, and session ends, through the real app and SQLite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from clawbridge.chat.render import Renderer
from clawbridge.runtime.clock import FakeClock
from tests.fake_proxy import SwitchableSampler, script_for, start_fake_proxy
from tests.support import InProcessProxy, wait_for

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessProxy]:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    sampler = SwitchableSampler(script=script_for(renderer, "ok"))
    p = start_fake_proxy(tiny_model_dir, tmp_path_factory.mktemp("sessions"), sampler)
    yield p
    p.stop()


def client(proxy: InProcessProxy, key: str | None = None, base: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=base or proxy.base + "/v1", api_key=key or proxy.state.keys.client, max_retries=0)


def admin(proxy: InProcessProxy, path: str, body: dict[str, object], key: str | None = None) -> httpx.Response:
    return httpx.post(proxy.base + path, json=body, headers={"Authorization": f"Bearer {key or proxy.state.keys.admin}"})


def test_headers_group_main_and_side_turns(proxy: InProcessProxy) -> None:
    c = client(proxy)
    for turn_type in ("main", "side", "main"):
        c.chat.completions.create(model="tiny", messages=MSG,  # type: ignore[arg-type]
                                  extra_headers={"X-Session-Id": "oc-1", "X-Turn-Type": turn_type,
                                                 "X-Turn-Trigger": "heartbeat" if turn_type == "side" else "user"})
    view = proxy.state.store.session_view("oc-1")
    assert view["source"] == "header" and view["status"] == "active"
    assert [t["turn_type"] for t in view["turns"]] == ["main", "side", "main"]
    assert view["turns"][1]["meta"]["trigger"] == "heartbeat"


def test_start_session_key_records_into_its_session(proxy: InProcessProxy) -> None:
    r = admin(proxy, "/rl/start_session", {"task_id": "task-7"})
    assert r.status_code == 200, r.text
    sid, key = r.json()["session_id"], r.json()["api_key"]
    c = client(proxy, key)
    c.chat.completions.create(model="tiny", messages=MSG)  # type: ignore[arg-type]
    c.chat.completions.create(model="tiny", messages=MSG)  # type: ignore[arg-type]
    view = proxy.state.store.session_view(sid)
    assert view["task_id"] == "task-7" and view["source"] == "session_key" and len(view["turns"]) == 2

    # The session key sets a reward on its own last turn.
    r = admin(proxy, "/rl/set_reward", {"reward": 0.5}, key=key)
    assert r.status_code == 200, r.text
    assert r.json()["interaction_id"] == view["turns"][-1]["turn_id"]
    assert proxy.state.store.session_view(sid)["turns"][-1]["reward"] == 0.5

    # Passing the same key again ends that session and starts a new one on the key.
    r = admin(proxy, "/rl/start_session", {"api_key": key})
    sid2 = r.json()["session_id"]
    assert sid2 != sid and r.json()["api_key"] == key
    old = proxy.state.store.session_view(sid)
    assert old["status"] == "ended" and old["end_reason"] == "replaced"
    c.chat.completions.create(model="tiny", messages=MSG)  # type: ignore[arg-type]
    assert len(proxy.state.store.session_view(sid2)["turns"]) == 1

    # A session key cannot touch another session.
    r = admin(proxy, "/rl/set_reward", {"reward": 1, "session_id": "oc-1"}, key=key)
    assert r.status_code == 403
    r = admin(proxy, "/rl/end_session", {}, key=key)
    assert r.status_code == 200 and r.json()["ended"] is True
    with pytest.raises(openai.AuthenticationError):  # an ended session's key no longer works
        c.chat.completions.create(model="tiny", messages=MSG)  # type: ignore[arg-type]


def test_url_prefix_session(proxy: InProcessProxy) -> None:
    c = client(proxy, base=proxy.base + "/s/url-sess-1/v1")
    c.chat.completions.create(model="tiny", messages=MSG)  # type: ignore[arg-type]
    assert c.models.list().data[0].id == "tiny"
    view = proxy.state.store.session_view("url-sess-1")
    assert view["source"] == "url" and len(view["turns"]) == 1


def test_call_without_session_is_its_own_ended_session(proxy: InProcessProxy) -> None:
    resp = client(proxy).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "lonely"}])  # type: ignore[arg-type]
    turn_id = resp.id.replace("chatcmpl-", "turn_")
    sid = proxy.state.store.turn_session(turn_id)
    assert sid is not None
    view = proxy.state.store.session_view(sid)
    assert view["source"] == "implicit" and view["status"] == "ended" and view["end_reason"] == "single_call"


def test_openclaw_runtime_line_names_the_session(proxy: InProcessProxy) -> None:
    msgs = [{"role": "system", "content": "You are OpenClaw."},
            {"role": "user", "content": "Runtime: agent=main | session=agent:main:main | sessionId=abc-123\nhello"}]
    client(proxy).chat.completions.create(model="tiny", messages=msgs)  # type: ignore[arg-type]
    view = proxy.state.store.session_view("agent:main:main")
    assert view is not None and view["source"] == "openclaw_runtime"


def test_set_reward_by_interaction_and_session(proxy: InProcessProxy) -> None:
    c = client(proxy)
    first = c.chat.completions.create(model="tiny", messages=MSG, extra_headers={"X-Session-Id": "rw"})  # type: ignore[arg-type]
    c.chat.completions.create(model="tiny", messages=MSG, extra_headers={"X-Session-Id": "rw"})  # type: ignore[arg-type]
    turn1 = first.id.replace("chatcmpl-", "turn_")
    r = admin(proxy, "/rl/set_reward", {"reward": -1, "interaction_id": turn1})
    assert r.status_code == 200 and r.json()["session_id"] == "rw"
    r = admin(proxy, "/rl/set_reward", {"reward": 1, "session_id": "rw"})
    assert r.status_code == 200
    r = admin(proxy, "/rl/set_session_reward", {"reward": 0.25, "session_id": "rw"})
    assert r.status_code == 200
    view = proxy.state.store.session_view("rw")
    assert [t["reward"] for t in view["turns"]] == [-1.0, 1.0]
    assert [(x["turn_id"] is None, x["value"]) for x in view["rewards"]] == [(False, -1.0), (False, 1.0), (True, 0.25)]
    # Bad reward requests: clear errors, nothing recorded.
    assert admin(proxy, "/rl/set_reward", {"reward": "lots", "session_id": "rw"}).status_code == 422
    assert admin(proxy, "/rl/set_reward", {"reward": 1, "interaction_id": "turn_nope"}).status_code == 404
    assert admin(proxy, "/rl/set_reward", {"reward": 1, "session_id": "no-such"}).status_code == 404
    assert admin(proxy, "/rl/set_reward", {"reward": 1}).status_code == 400
    assert len(proxy.state.store.session_view("rw")["rewards"]) == 3
    # Fields clawbridge does not use (AReaL sends `model`) are ignored, not refused.
    assert admin(proxy, "/rl/set_reward", {"reward": 1, "session_id": "rw", "model": "tiny"}).status_code == 200
    assert len(proxy.state.store.session_view("rw")["rewards"]) == 4


def test_session_done_header_and_idle_timeout(tiny_model_dir: Path, tmp_path: Path) -> None:
    clock = FakeClock()
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    proxy = start_fake_proxy(tiny_model_dir, tmp_path, SwitchableSampler(script=script_for(renderer, "ok")), clock,
                             session_idle_timeout_s=600.0)
    try:
        c = client(proxy)
        c.chat.completions.create(model="tiny", messages=MSG,  # type: ignore[arg-type]
                                  extra_headers={"X-Session-Id": "done-1", "X-Session-Done": "true"})
        assert proxy.state.store.session_view("done-1")["end_reason"] == "done_header"
        c.chat.completions.create(model="tiny", messages=MSG, extra_headers={"X-Session-Id": "idle-1"})  # type: ignore[arg-type]
        # The reaper sleeps on the store's clock: once it is parked there, 599 s change nothing ...
        wait_for(lambda: clock.waiting >= 1, what="the idle reaper never slept on the clock")
        clock.advance(599.0)
        wait_for(lambda: clock.waiting >= 1, what="the idle reaper did not go back to sleep")
        assert proxy.state.store.session_view("idle-1")["status"] == "active"
        clock.advance(30.0)  # ... and past 600 s (at the reaper's next round) the session ends by itself
        wait_for(lambda: proxy.state.store.session_view("idle-1")["status"] == "ended", what="idle-1 never ended")
        assert proxy.state.store.session_view("idle-1")["end_reason"] == "idle"
    finally:
        proxy.stop()


def test_read_api(proxy: InProcessProxy) -> None:
    h = {"Authorization": f"Bearer {proxy.state.keys.admin}"}
    listed = httpx.get(proxy.base + "/rl/sessions", headers=h).json()["sessions"]
    assert any(s["session_id"] == "oc-1" for s in listed)
    one = httpx.get(proxy.base + "/rl/sessions/oc-1", headers=h).json()
    assert set(one) >= {"session_id", "status", "turns", "rewards"}
    turn = one["turns"][0]
    assert set(turn) >= {"turn_id", "turn_type", "prompt_token_ids", "completion_token_ids", "completion_logprobs",
                         "policy_version", "reward", "request", "response"}
    assert httpx.get(proxy.base + "/rl/sessions/none-such", headers=h).status_code == 404
    ch = {"Authorization": f"Bearer {proxy.state.keys.client}"}
    assert httpx.get(proxy.base + "/rl/sessions", headers=ch).status_code == 403
    health = httpx.get(proxy.base + "/health").json()
    assert health["status"] == "ok" and health["policy_version"] == 0
