"""The conventions of AReaL's, OpenClaw-RL's and Claw-R1's clients, against the real app and SQLite.

Each test speaks the way that project's own scripts and agents do (base URLs, headers, body
fields, session API bodies), with the real openai/anthropic SDKs or httpx.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from clawbridge.chat.render import Renderer
from tests.fake_proxy import SwitchableSampler, script_for, start_fake_proxy
from tests.support import InProcessProxy

MSG: Any = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> Renderer:
    return Renderer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, renderer: Renderer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessProxy]:
    sampler = SwitchableSampler(script=script_for(renderer, "ok"))
    p = start_fake_proxy(tiny_model_dir, tmp_path_factory.mktemp("peers"), sampler)
    yield p
    p.stop()


def post(proxy: InProcessProxy, path: str, body: dict[str, Any], key: str | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(proxy.base + path, json=body,
                      headers={"Authorization": f"Bearer {key or proxy.state.keys.admin}", **(headers or {})})


def view(proxy: InProcessProxy, sid: str) -> dict[str, Any]:
    v = proxy.state.store.session_view(sid)
    assert v is not None, f"session {sid} was not recorded"
    return dict(v)


def session_of(proxy: InProcessProxy, turn_id: str) -> str:
    sid = proxy.state.store.turn_session(turn_id)
    assert sid is not None, f"turn {turn_id} was not recorded"
    return sid


# ---------------------------------------------------------------------- AReaL
def test_areal_lifecycle_base_url_without_v1_and_default_reward(proxy: InProcessProxy) -> None:
    """demo_lifecycle.py: start (no key) -> POST {gateway}/chat/completions -> set_reward; refresh with the key."""
    r = post(proxy, "/rl/start_session", {"task_id": "demo-task"})
    assert r.status_code == 200, r.text
    sid, key = r.json()["session_id"], r.json()["api_key"]
    chat = httpx.post(proxy.base + "/chat/completions", json={"model": "tiny", "messages": MSG},
                      headers={"Authorization": f"Bearer {key}"})
    assert chat.status_code == 200, chat.text
    assert session_of(proxy, "turn_" + chat.json()["id"].removeprefix("chatcmpl-")) == sid
    r = post(proxy, "/rl/set_reward", {"reward": 1.0, "model": "tiny"}, key=key)  # newer AReaL sends `model`
    assert r.status_code == 200, r.text

    # Episode 2 on the same key: the rewarded session keeps its reward.
    r = post(proxy, "/rl/start_session", {"task_id": "demo-task", "api_key": key, "group_size": 1})
    assert r.status_code == 200, r.text
    sid2 = r.json()["session_id"]
    assert [x["value"] for x in view(proxy, sid)["rewards"]] == [1.0]
    openai.OpenAI(base_url=proxy.base, api_key=key, max_retries=0).chat.completions.create(model="tiny", messages=MSG)

    # Episode 3 without set_reward: the refresh gives episode 2 AReaL's default reward 0 on its last turn.
    r = post(proxy, "/rl/start_session", {"task_id": "demo-task", "api_key": key})
    sid3 = r.json()["session_id"]
    old = view(proxy, sid2)
    assert old["status"] == "ended" and old["end_reason"] == "replaced"
    assert [(x["value"], x["source"], x["turn_id"]) for x in old["rewards"]] == [(0.0, "default", old["turns"][-1]["turn_id"])]

    # end_session answers interaction_count; an unrewarded session with no turn gets no reward.
    r = post(proxy, "/rl/end_session", {}, key=key)
    assert r.status_code == 200 and r.json()["interaction_count"] == 0 and r.json()["ended"] is True
    assert view(proxy, sid3)["rewards"] == []


def test_areal_end_session_default_reward_and_count(proxy: InProcessProxy) -> None:
    key = "sk-sess-areal-end-0001"
    sid = post(proxy, "/rl/start_session", {"task_id": "t", "api_key": key}).json()["session_id"]
    c = openai.OpenAI(base_url=proxy.base + "/v1", api_key=key, max_retries=0)
    for _ in range(2):
        c.chat.completions.create(model="tiny", messages=MSG)
    r = post(proxy, "/rl/end_session", {"session_id": sid})
    assert r.status_code == 200 and r.json()["interaction_count"] == 2
    v = view(proxy, sid)
    assert [(x["value"], x["turn_id"]) for x in v["rewards"]] == [(0.0, v["turns"][-1]["turn_id"])]


@pytest.mark.parametrize(("api_key", "why"), [
    ("admin", "client or admin key"),
    ("client", "client or admin key"),
    ("short-key", "at least 16"),
    ("                    ", "blank"),
    (" padded-session-key-0001 ", "whitespace"),
])
def test_areal_bad_session_keys_are_400(proxy: InProcessProxy, api_key: str, why: str) -> None:
    keys = {"admin": proxy.state.keys.admin, "client": proxy.state.keys.client}
    before = proxy.state.store.stats()["sessions"]
    r = post(proxy, "/rl/start_session", {"task_id": "t", "api_key": keys.get(api_key, api_key)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "api_key"
    assert why in r.json()["error"]["message"]
    assert proxy.state.store.stats()["sessions"] == before, "a refused key starts no session"


def test_areal_unknown_fields_ignored_group_size_refused(proxy: InProcessProxy) -> None:
    r = post(proxy, "/rl/start_session", {"task_id": "t", "group_size": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "group_size"
    r = post(proxy, "/rl/start_session", {"task_id": "t", "future_field": {"x": 1}})
    assert r.status_code == 200, r.text
    r = post(proxy, "/rl/end_session", {"session_id": r.json()["session_id"], "export": True})
    assert r.status_code == 200 and r.json()["message"] == "success"


def test_client_visible_ids_are_interaction_ids(proxy: InProcessProxy) -> None:
    """set_reward --interaction-id with the id each SDK showed: chatcmpl-, msg_ (anthropic), resp_."""
    key = "sk-sess-ids-000000001"
    sid = post(proxy, "/rl/start_session", {"task_id": "ids", "api_key": key}).json()["session_id"]
    chat = openai.OpenAI(base_url=proxy.base, api_key=key, max_retries=0).chat.completions.create(
        model="tiny", messages=MSG)
    msg = anthropic.Anthropic(base_url=proxy.base, api_key=key, max_retries=0).messages.create(
        model="tiny", max_tokens=20, messages=MSG)
    resp = openai.OpenAI(base_url=proxy.base, api_key=key, max_retries=0).responses.create(model="tiny", input="hi")
    turns = view(proxy, sid)["turns"]
    assert [t["meta"]["api"] for t in turns] == ["chat", "anthropic", "responses"]
    for value, client_id in zip((0.1, 0.2, 0.3), (chat.id, msg.id, resp.id), strict=True):
        r = post(proxy, "/rl/set_reward", {"reward": value, "interaction_id": client_id}, key=key)
        assert r.status_code == 200, r.text
    assert [t["reward"] for t in view(proxy, sid)["turns"]] == [0.1, 0.2, 0.3]
    r = post(proxy, "/rl/set_reward", {"reward": 1, "interaction_id": "chatcmpl-unknown"}, key=key)
    assert r.status_code == 404 and "chatcmpl-unknown" in r.json()["error"]["message"]


def test_health_and_models_under_every_base(proxy: InProcessProxy) -> None:
    for path in ("/health", "/v1/health", "/healthz"):
        r = httpx.get(proxy.base + path)
        assert r.status_code == 200 and r.json()["model"] == "tiny"
    key = proxy.state.keys.client
    for base in (proxy.base, proxy.base + "/v1", proxy.base + "/traj-m/1/v1"):
        assert openai.OpenAI(base_url=base, api_key=key, max_retries=0).models.list().data[0].id == "tiny"


# ---------------------------------------------------------------------- OpenClaw-RL
def test_openclaw_rl_empty_session_header_is_absent(proxy: InProcessProxy) -> None:
    r = post(proxy, "/v1/chat/completions", {"model": "tiny", "messages": MSG}, key=proxy.state.keys.client,
             headers={"X-Session-Id": "", "X-Turn-Type": ""})
    assert r.status_code == 200, r.text
    v = view(proxy, session_of(proxy, "turn_" + r.json()["id"].removeprefix("chatcmpl-")))
    assert v["source"] == "implicit" and v["turns"][0]["turn_type"] == "main"


def test_openclaw_rl_body_fields_honoured_and_stripped(proxy: InProcessProxy, renderer: Renderer) -> None:
    body = {"messages": MSG, "session_id": "ocrl-1", "turn_type": "side", "session_done": False}
    r = post(proxy, "/v1/chat/completions", body, key=proxy.state.keys.client)  # and no `model`
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny"
    v = view(proxy, "ocrl-1")
    assert v["source"] == "body" and v["status"] == "active"
    turn = v["turns"][0]
    assert turn["turn_type"] == "side" and turn["prompt_token_ids"] == renderer.render(MSG)
    assert turn["request"]["session_id"] == "ocrl-1", "the request is recorded as the client sent it"
    r = post(proxy, "/v1/chat/completions", {**body, "turn_type": "main", "session_done": "yes"},
             key=proxy.state.keys.client)
    v = view(proxy, "ocrl-1")
    assert v["status"] == "ended" and v["end_reason"] == "done_header" and v["turns"][1]["turn_type"] == "main"


def test_openclaw_rl_session_done_on_and_header_wins(proxy: InProcessProxy) -> None:
    r = post(proxy, "/v1/chat/completions", {"messages": MSG, "session_id": "ignored-body"},
             key=proxy.state.keys.client, headers={"X-Session-Id": "ocrl-2", "X-Session-Done": "on"})
    assert r.status_code == 200, r.text
    assert view(proxy, "ocrl-2")["end_reason"] == "done_header"
    assert proxy.state.store.get_session("ignored-body") is None


@pytest.mark.parametrize("body", [
    {"session_id": "bad id with spaces"},
    {"session_id": 7},
    {"turn_type": "sometimes"},
])
def test_openclaw_rl_bad_body_fields_are_400(proxy: InProcessProxy, body: dict[str, Any]) -> None:
    r = post(proxy, "/v1/chat/completions", {"messages": MSG, **body}, key=proxy.state.keys.client)
    assert r.status_code == 400 and r.json()["error"]["message"]


# ---------------------------------------------------------------------- Claw-R1
def test_claw_r1_black_box_base_url(proxy: InProcessProxy) -> None:
    """An agent given base_url=http://host/{trajectory_uid}/{prompt_uid}/v1 records into that trajectory."""
    r = post(proxy, "/init_trajectory", {})
    assert r.status_code == 200, r.text
    traj, base_url = r.json()["trajectory_uid"], r.json()["base_url"]
    assert base_url == f"{proxy.base}/{traj}/1/v1"
    assert post(proxy, f"/{traj}/1/v1/register_trajectory", {"channel": "train", "metadata": {"idx": 3}}).status_code == 200
    agent = openai.OpenAI(base_url=base_url, api_key=proxy.state.keys.client, max_retries=0)
    agent.chat.completions.create(model="tiny", messages=MSG)
    agent.responses.create(model="tiny", input="and again")
    v = view(proxy, traj)
    assert v["source"] == "trajectory" and v["task_id"] == "1" and len(v["turns"]) == 2
    r = post(proxy, f"/{traj}/1/v1/complete_trajectory", {"reward": 0.75})
    assert r.status_code == 200 and r.json()["status"] == "ok"
    v = view(proxy, traj)
    assert v["status"] == "ended" and [(x["turn_id"], x["value"]) for x in v["rewards"]] == [(None, 0.75)]


def test_claw_r1_prompt_uid_is_the_task_group(proxy: InProcessProxy) -> None:
    for traj in ("grpo-a", "grpo-b"):
        c = anthropic.Anthropic(base_url=f"{proxy.base}/{traj}/prompt-42", api_key=proxy.state.keys.client,
                                max_retries=0)
        c.messages.create(model="tiny", max_tokens=10, messages=MSG)
        assert view(proxy, traj)["task_id"] == "prompt-42"


def test_claw_r1_errors_name_the_clawbridge_way(proxy: InProcessProxy) -> None:
    r = post(proxy, "/traj-x/1/v1/register_trajectory", {"channel": "val"})
    assert r.status_code == 400 and "X-Turn-Type: side" in r.json()["error"]["message"]
    r = post(proxy, "/no-such-traj/1/v1/complete_trajectory", {})
    assert r.status_code == 404
    r = post(proxy, "/traj-x/1/v1/complete_trajectory", {}, key=proxy.state.keys.client)
    assert r.status_code == 403, "management calls need the admin key"
    for path, hint in (("/generate", "/v1/chat/completions"), ("/submit_steps", "records every model call"),
                       ("/compute_reward", "/rl/set_reward")):
        r = post(proxy, path, {})
        assert r.status_code == 404 and hint in r.json()["error"]["message"]
    r = post(proxy, "/traj-x/bad uid/v1/chat/completions", {"messages": MSG}, key=proxy.state.keys.client)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id"


@pytest.mark.parametrize(("settings", "expected"), [
    ({"default_reward_value": -0.5}, [-0.5]),
    ({"default_session_reward": False}, []),
])
def test_default_reward_is_configurable(tiny_model_dir: Path, renderer: Renderer, tmp_path: Path,
                                        settings: dict[str, Any], expected: list[float]) -> None:
    p = start_fake_proxy(tiny_model_dir, tmp_path, SwitchableSampler(script=script_for(renderer, "ok")), **settings)
    try:
        key = "sk-sess-configurable-01"
        sid = post(p, "/rl/start_session", {"api_key": key}).json()["session_id"]
        openai.OpenAI(base_url=p.base, api_key=key, max_retries=0).chat.completions.create(model="tiny", messages=MSG)
        assert post(p, "/rl/start_session", {"api_key": key}).status_code == 200  # refresh
        assert [x["value"] for x in view(p, sid)["rewards"]] == expected
    finally:
        p.stop()
