"""Issue 11, bad input at the edge: every case here answered 5xx or 200-when-it-should-not before.

The real app under uvicorn over a scripted sampler (exact assertions), and the real local torch
engine for the sampler numerics; clients are the real `openai` / `anthropic` SDKs and raw httpx.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import torch
from clawbridge_local.backend import engine_threads
from clawbridge_local.sampling import choose

from clawbridge.chat.render import Renderer
from clawbridge.config import Settings
from clawbridge.plugins import load_backend
from clawbridge.server import UnsafeBind, check_bind
from clawbridge.serving.sampler import SamplingParams
from tests.fake_proxy import SwitchableSampler, script_for, start_fake_proxy
from tests.support import InProcessProxy, free_port

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def env(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessProxy]:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    sampler = SwitchableSampler(script=script_for(renderer, "hello there"))
    proxy = start_fake_proxy(tiny_model_dir, tmp_path_factory.mktemp("edge"), sampler, max_messages=50,
                             allowed_hosts=["clawbridge.lan"])
    yield proxy
    proxy.stop()


def auth(proxy: InProcessProxy, admin: bool = False) -> dict[str, str]:
    return {"Authorization": f"Bearer {proxy.state.keys.admin if admin else proxy.state.keys.client}"}


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, object]:
    assert r.status_code == status, r.text
    err = dict(r.json()["error"])
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def test_sessions_offset_out_of_sqlite_range_is_422(env: InProcessProxy) -> None:
    h = auth(env, admin=True)
    for query in ("offset=9223372036854775808", "offset=-1", "limit=0", "limit=99999999999999999999",
                  "offset=1e3", "limit=abc"):
        r = httpx.get(f"{env.base}/rl/sessions?{query}", headers=h)
        assert_error(r, 422)
    assert httpx.get(f"{env.base}/rl/sessions?offset=4611686018427387904", headers=h).json() == {"sessions": []}


@pytest.mark.parametrize("content_type", ["text/plain", "multipart/form-data", "application/xml"])
def test_non_json_content_type_is_415(env: InProcessProxy, content_type: str) -> None:
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}'
    for path in ("/v1/chat/completions", "/v1/messages", "/rl/start_session"):
        r = httpx.post(env.base + path, content=body, headers={**auth(env, admin=True), "Content-Type": content_type})
        assert r.status_code == 415, (path, r.text)
        assert "application/json" in r.text
    # JSON with parameters, a +json type, no Content-Type at all, and curl -d's default type are read as JSON.
    for ct in ("application/json; charset=utf-8", "application/vnd.api+json", None, "application/x-www-form-urlencoded"):
        headers = auth(env) | ({"Content-Type": ct} if ct else {})
        r = httpx.post(env.base + "/v1/chat/completions", content=body, headers=headers)
        assert r.status_code == 200, (ct, r.text)


def test_curl_data_bodies_are_read_as_json(env: InProcessProxy) -> None:
    """`curl -d '{...}'` without `-H 'Content-Type: application/json'` sends a form type (docs/api.md
    says such bodies are accepted): the real curl, on a chat call and an /rl call."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    chat = subprocess.run(
        [curl, "-sS", "-w", "\n%{http_code}", env.base + "/v1/chat/completions", "-H",
         f"Authorization: Bearer {env.state.keys.client}", "-H", "X-Session-Id: curl-data",
         "-d", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}'],
        capture_output=True, text=True, timeout=60)
    body, _, code = chat.stdout.rpartition("\n")
    assert code == "200", chat.stdout
    reward = subprocess.run(
        [curl, "-sS", "-w", "\n%{http_code}", env.base + "/rl/set_reward", "-H",
         f"Authorization: Bearer {env.state.keys.admin}", "-H", "X-Session-Id: curl-data", "-d", '{"reward": 1}'],
        capture_output=True, text=True, timeout=60)
    body, _, code = reward.stdout.rpartition("\n")
    assert code == "200" and json.loads(body)["session_id"] == "curl-data", reward.stdout
    # A form body that is not JSON is 400 (malformed JSON), never 500.
    r = httpx.post(env.base + "/rl/set_reward", content=b"reward=1", headers={
        **auth(env, admin=True), "Content-Type": "application/x-www-form-urlencoded"})
    assert_error(r, 400, "invalid_json")


def test_admin_rewards_a_session_named_by_x_session_id(env: InProcessProxy) -> None:
    """The README's reward call: the admin key and the X-Session-Id the agent's calls carried."""
    call = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = httpx.post(env.base + "/v1/chat/completions", json=call, headers={**auth(env), "X-Session-Id": "by-header"})
    assert r.status_code == 200, r.text
    admin = {**auth(env, admin=True), "X-Session-Id": "by-header"}
    r = httpx.post(env.base + "/rl/set_reward", json={"reward": 1}, headers=admin)
    assert r.status_code == 200 and r.json()["session_id"] == "by-header", r.text
    assert r.json()["interaction_id"] == env.state.store.last_turn_id("by-header")
    r = httpx.post(env.base + "/rl/set_session_reward", json={"reward": 0.5}, headers=admin)
    assert r.status_code == 200 and r.json()["session_id"] == "by-header", r.text
    # The body's session_id still works alone; the two disagreeing is refused, not guessed.
    r = httpx.post(env.base + "/rl/set_reward", json={"reward": 1, "session_id": "other"}, headers=admin)
    assert assert_error(r, 400)["param"] == "session_id" and "differ" in r.text
    r = httpx.post(env.base + "/rl/set_reward", json={"reward": 1}, headers=auth(env, admin=True))
    assert "X-Session-Id" in str(assert_error(r, 400)["message"])
    r = httpx.post(env.base + "/rl/set_reward", json={"reward": 1}, headers={**admin, "X-Session-Id": "nope"})
    assert_error(r, 404, "session_not_found")
    r = httpx.post(env.base + "/rl/end_session", json={}, headers=admin)
    assert r.status_code == 200 and r.json()["session_id"] == "by-header" and r.json()["ended"], r.text


def test_too_many_messages_is_400_before_validation(env: InProcessProxy) -> None:
    many = [{"role": "user", "content": "x"}] * 51
    err = assert_error(httpx.post(env.base + "/v1/chat/completions", json={"model": "tiny", "messages": many},
                                  headers=auth(env)), 400, "too_many_messages")
    assert err["param"] == "messages" and "51" in str(err["message"])
    r = httpx.post(env.base + "/v1/messages", json={"model": "tiny", "max_tokens": 5, "messages": many},
                   headers=auth(env))
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_big_body_does_not_block_the_event_loop(env: InProcessProxy) -> None:
    """100k valid messages (max_messages raised for the test): /health keeps answering while the
    request is validated, rendered and tokenized on a worker thread. (Validation holds the GIL for
    about a quarter of the time; the default max_messages keeps it to milliseconds.)"""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}] * 100_000}
    env.state.settings.max_messages = 10**6
    env.state.settings.max_body_bytes = 64 * 1024 * 1024
    health: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=env.base, timeout=30) as c:
            while not done.is_set():
                t = time.monotonic()
                assert c.get("/health").status_code == 200
                health.append(time.monotonic() - t)

    poller = threading.Thread(target=poll)
    try:
        poller.start()
        t0 = time.monotonic()
        r = httpx.post(env.base + "/v1/chat/completions", json=body, headers=auth(env), timeout=300)
        took = time.monotonic() - t0
        assert r.status_code == 400  # far over the tiny model's context window
    finally:
        done.set()
        poller.join(60)
        env.state.settings.max_messages = 50
        env.state.settings.max_body_bytes = 8 * 1024 * 1024
    # The health checks kept coming while the big request ran: none waited for most of it.
    print(f"big request {took:.2f}s; {len(health)} health checks, slowest {max(health):.3f}s")
    assert len(health) >= 3 and max(health) < took / 2


def test_session_key_on_another_sessions_url_is_403(env: InProcessProxy) -> None:
    r = httpx.post(env.base + "/rl/start_session", json={}, headers=auth(env, admin=True))
    key, sid = r.json()["api_key"], r.json()["session_id"]
    client = openai.OpenAI(base_url=f"{env.base}/s/someone-else/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model="tiny", messages=MSG)  # type: ignore[arg-type]
    ac = anthropic.Anthropic(base_url=f"{env.base}/s/someone-else", api_key=key, max_retries=0)
    with pytest.raises(anthropic.PermissionDeniedError):
        ac.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert env.state.store.get_session("someone-else") is None
    # Its own session id in the URL is fine, and recorded there.
    own = openai.OpenAI(base_url=f"{env.base}/s/{sid}/v1", api_key=key, max_retries=0)
    assert own.chat.completions.create(model="tiny", messages=MSG).choices[0].message.content  # type: ignore[arg-type]
    assert env.state.store.get_session(sid).turn_count == 1  # type: ignore[union-attr]


def raw_get(port: int, host: str, path: str = "/health") -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out.decode()


def test_host_header_check_refuses_rebound_names(env: InProcessProxy) -> None:
    for bad in ("evil.example", "evil.example:80", "127.0.0.1.nip.io", "192.168.1.9"):
        reply = raw_get(env.port, bad)
        assert reply.startswith("HTTP/1.1 403"), reply
        assert "host_not_allowed" in reply and "allowed_hosts" in reply
    for good in (f"127.0.0.1:{env.port}", "localhost", f"[::1]:{env.port}", "clawbridge.lan:8400", "app.localhost"):
        assert raw_get(env.port, good).startswith("HTTP/1.1 200"), good


def test_openapi_needs_a_key(env: InProcessProxy) -> None:
    assert_error(httpx.get(env.base + "/openapi.json"), 401)
    r = httpx.get(env.base + "/openapi.json", headers=auth(env))
    assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]
    assert httpx.get(env.base + "/docs").status_code == 404


def test_openapi_declares_every_path_parameter(env: InProcessProxy) -> None:
    """Each `{name}` in a path is a required path parameter of every operation on it (schema-driven
    clients refuse an operation whose path names an undeclared one), and nothing else is."""
    doc = httpx.get(env.base + "/openapi.json", headers=auth(env)).json()
    assert {"/s/{session_id}/v1/models", "/{trajectory_uid}/{prompt_uid}/v1/models"} <= set(doc["paths"])
    wrong = []
    for path, ops in doc["paths"].items():
        names = set(re.findall(r"{([^{}/]+)}", path))
        for method, op in ops.items():
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path" and p.get("required")}
            if declared != names:
                wrong.append(f"{method.upper()} {path}: declares {sorted(declared)}")
    assert not wrong, wrong


def test_non_loopback_bind_needs_strong_distinct_keys(tmp_path: Path) -> None:
    strong_a, strong_b = "cb-Zq8xW3rT9vLk2NpY7hJd4FsG", "cbadmin-Qe5Rt1Yu8Io3Pa6Sd0Fg"
    for client, admin, why in (("x", "y", "at least 24"), ("a" * 40, strong_b, "CLAWBRIDGE_API_KEY"),
                               (strong_a, strong_a, "must differ")):
        with pytest.raises(UnsafeBind, match=why):
            check_bind(Settings(host="0.0.0.0", state_dir=tmp_path, api_key=client, admin_key=admin))  # type: ignore[arg-type]
    check_bind(Settings(host="0.0.0.0", state_dir=tmp_path, api_key=strong_a, admin_key=strong_b))  # type: ignore[arg-type]
    check_bind(Settings(host="127.0.0.1", state_dir=tmp_path, api_key="x", admin_key="x"))  # type: ignore[arg-type]


# ------------------------------------------------------------------ sampler numerics


def test_choose_survives_tiny_temperature_and_top_p() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 5
    best = int(torch.argmax(logits))
    gen = torch.Generator().manual_seed(1)
    assert SamplingParams(max_tokens=1, temperature=1e-300).temperature == 0.0
    for params in (SamplingParams(max_tokens=1, top_p=5e-324), SamplingParams(max_tokens=1, temperature=1e-300),
                   SamplingParams(max_tokens=1, temperature=2e-4, top_p=1e-300)):
        choice = choose(logits, params, gen)
        assert choice.token_id == best and choice.logprob <= 0.0 and choice.logprob == choice.logprob


@pytest.fixture(scope="module")
def engine_proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessProxy]:
    torch.set_num_threads(1)
    settings = Settings(backend="local", model=str(tiny_model_dir), served_model_name="tiny", train=False,
                        port=free_port(), state_dir=tmp_path_factory.mktemp("edge-engine"),
                        backends={"local": {"engine": "torch", "engine_threads": 1}})
    proxy = InProcessProxy(settings, load_backend("local", settings)).start()
    assert torch.get_num_threads() == 1
    yield proxy
    proxy.stop()
    asyncio.run(proxy.backend.close())


@pytest.mark.parametrize("extra", [{"temperature": 1e-300}, {"top_p": 5e-324}, {"temperature": 1e-300, "top_p": 5e-324}])
def test_tiny_temperature_and_top_p_are_greedy_on_the_engine(engine_proxy: InProcessProxy, extra: dict[str, float]) -> None:
    key = str(engine_proxy.state.keys.client)
    client = openai.OpenAI(base_url=engine_proxy.base + "/v1", api_key=key, max_retries=0, timeout=120)
    greedy = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, **extra)  # type: ignore[arg-type]
    assert out.choices[0].message.content == greedy.choices[0].message.content
    ac = anthropic.Anthropic(base_url=engine_proxy.base, api_key=key, max_retries=0, timeout=120)
    msg = ac.messages.create(model="tiny", max_tokens=6, messages=[{"role": "user", "content": "hi"}], extra_body=extra)
    assert msg.stop_reason in ("end_turn", "max_tokens")


# ------------------------------------------------------------------ connection limits


@pytest.fixture(scope="module")
def tight(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessProxy]:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    sampler = SwitchableSampler(script=script_for(renderer, "hello there"))
    proxy = start_fake_proxy(tiny_model_dir, tmp_path_factory.mktemp("tight"), sampler, header_timeout_s=1.0,
                             body_timeout_s=1.0, max_connections=20)
    yield proxy
    proxy.stop()


def closed_by_server(s: socket.socket, within_s: float) -> bool:
    """True once the server closes `s` (recv returns EOF or a reset) within `within_s`."""
    s.settimeout(within_s)
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_and_slow_header_connections_are_closed(tight: InProcessProxy) -> None:
    idle = [socket.create_connection(("127.0.0.1", tight.port)) for _ in range(30)]  # more than max_connections
    slow = socket.create_connection(("127.0.0.1", tight.port))
    slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finishes its head
    try:
        # While they are open, a normal client still gets an answer or a clear 503 (the cap), never a hang.
        r = httpx.get(tight.base + "/health", timeout=30)
        assert r.status_code in (200, 503)
        assert all(closed_by_server(s, 30) for s in [*idle, slow])
    finally:
        for s in [*idle, slow]:
            s.close()
    # With them gone, service is normal.
    deadline = time.monotonic() + 30
    while httpx.get(tight.base + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_slow_body_is_408(tight: InProcessProxy) -> None:
    key = str(tight.state.keys.client)
    with socket.create_connection(("127.0.0.1", tight.port), timeout=30) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\"".encode())
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
            if b"body_timeout" in reply:
                break
    assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout" in reply


def test_unknown_request_fields_are_not_stored(env: InProcessProxy) -> None:
    """A client's big unknown fields (10 x 7.9 MB grew the store by 87 MB) are dropped, named."""
    store = env.state.store
    before = store.size_bytes()
    body = {"model": "tiny", "messages": MSG, "temperature": 0.5, "junk": "x" * 1_000_000, "user": "u1"}
    r = httpx.post(env.base + "/v1/chat/completions", json=body, headers={**auth(env), "X-Session-Id": "junk-1"})
    assert r.status_code == 200
    (turn,) = store.session_turns("junk-1")
    assert turn["request"] == {"model": "tiny", "messages": MSG, "temperature": 0.5, "user": "u1",
                               "_dropped_fields": ["junk"]}
    assert store.size_bytes() - before < 200_000


def test_engine_threads_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert engine_threads(3) == 3
    assert engine_threads(0) == max(1, (os.cpu_count() or 1) // 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert engine_threads(0) == 2 and engine_threads(5) == 5
