"""Every error status the proxy promises, through the real app, the real `openai` SDK and raw HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from clawbridge.chat.render import Renderer
from clawbridge.serving.sampler import PromptTooLong, SamplerOverloaded, SamplerTimeout, SamplerUnavailable
from tests.fake_proxy import SwitchableSampler, script_for, start_fake_proxy
from tests.support import InProcessProxy

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def env(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InProcessProxy, SwitchableSampler]]:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    sampler = SwitchableSampler(script=script_for(renderer, "hello there"))
    proxy = start_fake_proxy(tiny_model_dir, tmp_path_factory.mktemp("errors"), sampler, max_body_bytes=200_000)
    yield proxy, sampler
    proxy.stop()


def client_key(proxy: InProcessProxy) -> str:
    return str(proxy.state.keys.client)


def post(proxy: InProcessProxy, body: bytes | dict[str, object], key: str | None = "client",
         headers: dict[str, str] | None = None, path: str = "/v1/chat/completions") -> httpx.Response:
    h = dict(headers or {})
    if key == "client":
        h["Authorization"] = f"Bearer {client_key(proxy)}"
    elif key is not None:
        h["Authorization"] = f"Bearer {key}"
    if isinstance(body, dict):
        return httpx.post(proxy.base + path, json=body, headers=h, timeout=30)
    h["Content-Type"] = "application/json"
    return httpx.post(proxy.base + path, content=body, headers=h, timeout=30)


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in r.text
    return dict(err)


def test_malformed_json_is_400(env: tuple[InProcessProxy, SwitchableSampler]) -> None:
    proxy, _ = env
    err = assert_openai_error(post(proxy, b'{"model": "tiny", "messages": [}'), 400)
    assert err["code"] == "invalid_json"
    assert_openai_error(post(proxy, b"[1, 2]"), 400)
    assert_openai_error(post(proxy, b""), 400)
    assert_openai_error(post(proxy, b"\xff\xfe garbage"), 400)


def test_tool_choice_that_cannot_be_honoured_is_400_naming_it(env: tuple[InProcessProxy, SwitchableSampler]) -> None:
    proxy, sampler = env
    tools = [{"type": "function", "function": {"name": f, "parameters": {"type": "object"}}} for f in ("a", "b")]
    n_prompts = len(sampler.prompts)
    cases: list[tuple[dict[str, object], str]] = [
        ({"tool_choice": "bogus"}, "tool_choice must be"),
        ({"tool_choice": "bogus", "tools": tools}, "tool_choice must be"),
        ({"tool_choice": "required"}, "needs at least one tool"),
        ({"tool_choice": "required", "tools": tools}, "cannot be enforced with 2 tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "c"}}, "tools": tools}, "not in 'tools'"),
        ({"tool_choice": {"type": "function", "function": {"name": "a"}}}, "not in 'tools'"),
        ({"tool_choice": {"type": "function"}, "tools": tools}, "must name a function"),
    ]
    client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=client_key(proxy), max_retries=0)
    for extra, why in cases:
        err = assert_openai_error(post(proxy, {"model": "tiny", "messages": MSG, **extra}), 400)
        assert err["param"] == "tool_choice" and err["code"] == "invalid_tool_choice", extra
        assert why in str(err["message"]), (extra, err)
        with pytest.raises(openai.BadRequestError, match=why):
            client.chat.completions.create(model="tiny", messages=MSG, **extra)  # type: ignore[call-overload]
    # Anthropic's "any" is "required": refused the same way, Anthropic-shaped.
    r = post(proxy, {"model": "tiny", "max_tokens": 5, "messages": MSG, "tool_choice": {"type": "any"},
                     "tools": [{"name": n, "input_schema": {"type": "object"}} for n in ("a", "b")]},
             path="/v1/messages")
    assert r.status_code == 400 and "cannot be enforced" in r.json()["error"]["message"]
    assert len(sampler.prompts) == n_prompts  # nothing was sampled for any of them


def test_bad_fields_are_422_or_400(env: tuple[InProcessProxy, SwitchableSampler]) -> None:
    proxy, _ = env
    assert_openai_error(post(proxy, {"model": "tiny"}), 422)
    assert_openai_error(post(proxy, {"model": "tiny", "messages": []}), 422)
    assert_openai_error(post(proxy, {"model": "tiny", "messages": "hi"}), 422)
    assert_openai_error(post(proxy, {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}), 422)
    assert_openai_error(post(proxy, {"model": "tiny", "messages": MSG, "temperature": 9}), 422)
    assert_openai_error(post(proxy, {"model": "tiny", "messages": MSG, "max_tokens": 0}), 422)
    err = assert_openai_error(post(proxy, {"model": "tiny", "messages": MSG, "n": 2}), 400)
    assert "n" in str(err["message"])
    assert_openai_error(post(proxy, {"model": "tiny", "messages": MSG, "logit_bias": {"5": 3}}), 400)
    assert_openai_error(post(proxy, {"model": "tiny", "messages": MSG, "presence_penalty": 0.5}), 400)
    assert_openai_error(post(proxy, {"model": "tiny", "messages": MSG,
                                     "response_format": {"type": "json_schema"}}), 400)
    assert_openai_error(post(proxy, {"model": "tiny", "messages": MSG, "stop": ["a", "b", "c", "d", "e"]}), 400)
    assert_openai_error(post(proxy, {"model": "tiny", "messages": MSG, "tools": [{"type": "function"}]}), 400)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_openai_error(post(proxy, {"model": "tiny", "messages": image}), 400)
    # A tool message that answers nothing still renders; a message list the template rejects is a 400.
    assert post(proxy, {"model": "tiny", "messages": MSG, "user": "u1", "store": False,
                        "parallel_tool_calls": True}).status_code == 200


def test_keys(env: tuple[InProcessProxy, SwitchableSampler]) -> None:
    proxy, _ = env
    body = {"model": "tiny", "messages": MSG}
    assert_openai_error(post(proxy, body, key=None), 401)
    assert_openai_error(post(proxy, body, key="wrong-key"), 401)
    # The admin key also works for model calls; the client key cannot manage sessions.
    assert post(proxy, body, key=str(proxy.state.keys.admin)).status_code == 200
    r = httpx.post(proxy.base + "/rl/start_session", json={}, headers={"Authorization": f"Bearer {client_key(proxy)}"})
    assert_openai_error(r, 403)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=proxy.base + "/v1", api_key="nope").chat.completions.create(model="tiny", messages=MSG)  # type: ignore[arg-type]


def test_unknown_model_is_404(env: tuple[InProcessProxy, SwitchableSampler]) -> None:
    proxy, _ = env
    err = assert_openai_error(post(proxy, {"model": "gpt-9", "messages": MSG}), 404)
    assert err["code"] == "model_not_found"
    client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=client_key(proxy))
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MSG)  # type: ignore[arg-type]
    assert client.chat.completions.create(model="default", messages=MSG).choices[0].message.content  # type: ignore[arg-type]
    assert_openai_error(httpx.get(proxy.base + "/no/such/route"), 404)


def test_body_over_limit_is_413(env: tuple[InProcessProxy, SwitchableSampler]) -> None:
    proxy, _ = env
    huge = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 300_000}]}
    assert_openai_error(post(proxy, huge), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit still holds
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(30):
            yield b"y" * 10_000
        yield b'"}]}'

    r = httpx.post(proxy.base + "/v1/chat/completions", content=chunks(),
                   headers={"Authorization": f"Bearer {client_key(proxy)}", "Content-Type": "application/json"})
    assert_openai_error(r, 413)


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (SamplerOverloaded("queue full", retry_after_s=3), 429),
        (SamplerUnavailable("connection refused"), 502),
        (SamplerTimeout("no answer"), 504),
        (PromptTooLong("prompt too long"), 400),
    ],
)
def test_sampler_failures_map_to_status(env: tuple[InProcessProxy, SwitchableSampler], exc: Exception,
                                        status: int) -> None:
    proxy, sampler = env
    sampler.fail_with = exc  # type: ignore[assignment]
    try:
        r = post(proxy, {"model": "tiny", "messages": MSG})
        assert_openai_error(r, status)
        if status == 429:
            assert r.headers["Retry-After"] == "3"
        r = post(proxy, {"model": "tiny", "messages": MSG, "stream": True})
        assert_openai_error(r, status)
    finally:
        sampler.fail_with = None


def test_overload_through_sdk_is_rate_limit_error(env: tuple[InProcessProxy, SwitchableSampler]) -> None:
    proxy, sampler = env
    sampler.fail_with = SamplerOverloaded("busy", 1)
    try:
        client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=client_key(proxy), max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="tiny", messages=MSG)  # type: ignore[arg-type]
    finally:
        sampler.fail_with = None


def test_bad_session_headers_are_400(env: tuple[InProcessProxy, SwitchableSampler]) -> None:
    proxy, _ = env
    body = {"model": "tiny", "messages": MSG}
    assert_openai_error(post(proxy, body, headers={"X-Turn-Type": "sidequest", "X-Session-Id": "s"}), 400)
    assert_openai_error(post(proxy, body, headers={"X-Session-Id": "bad id with spaces"}), 400)
    assert_openai_error(post(proxy, body, headers={"X-Session-Id": "x" * 300}), 400)


def test_errors_do_not_lose_recorded_turns(env: tuple[InProcessProxy, SwitchableSampler]) -> None:
    proxy, _ = env
    ok = post(proxy, {"model": "tiny", "messages": MSG}, headers={"X-Session-Id": "keep-me"})
    assert ok.status_code == 200
    post(proxy, b"{broken", headers={"X-Session-Id": "keep-me"})
    post(proxy, {"model": "nope", "messages": MSG}, headers={"X-Session-Id": "keep-me"})
    view = proxy.state.store.session_view("keep-me")
    assert view is not None and len(view["turns"]) == 1
    assert view["turns"][0]["response"]["choices"][0]["message"]["content"] == "hello there"
