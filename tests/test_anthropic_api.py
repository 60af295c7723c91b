"""The Anthropic Messages API through the real `anthropic` SDK, over a real proxy and a scripted sampler."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from clawbridge.chat.render import Renderer
from clawbridge.serving.sampler import (
    FakeSampler,
    SampledToken,
    SamplerOverloaded,
    SamplerUnavailable,
    SampleStream,
    SamplingParams,
)
from tests.fake_proxy import SwitchableSampler, script_for, start_fake_proxy
from tests.support import InProcessProxy

ANSWER = ('<think>\nThe user wants the file.\n</think>\n\nLet me look. <tool_call>\n'
          '{"name": "read_file", "arguments": {"path": "/tmp/a.txt"}}\n</tool_call>')
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
TOOLS: Any = [{"name": "read_file", "description": "Read a file", "input_schema": SCHEMA}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                  "parameters": SCHEMA}}]
USER: Any = [{"role": "user", "content": "read /tmp/a.txt"}]
Env = tuple[InProcessProxy, SwitchableSampler]


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> Renderer:
    return Renderer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def env(tiny_model_dir: Path, renderer: Renderer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    sampler = SwitchableSampler(script=script_for(renderer, ANSWER), logprob=-0.25)
    proxy = start_fake_proxy(tiny_model_dir, tmp_path_factory.mktemp("anthropic"), sampler,
                             max_body_bytes=200_000)
    yield proxy, sampler
    proxy.stop()


@pytest.fixture(autouse=True)
def _healthy_sampler(env: Env) -> Iterator[None]:
    env[1].fail_with = None
    yield
    env[1].fail_with = None


def sdk(proxy: InProcessProxy, key: str | None = None, base: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base or proxy.base, api_key=key or proxy.state.keys.client, max_retries=0)


def turn_of(proxy: InProcessProxy, session: str, index: int = 0) -> dict[str, Any]:
    view = proxy.state.store.session_view(session)
    assert view is not None, f"session {session} was not recorded"
    return dict(view["turns"][index])


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    out = dict(message, id=None)
    out["content"] = [dict(b, id=None) if b["type"] == "tool_use" else b for b in message["content"]]
    return out


def test_non_streaming_content_blocks_and_recorded_turn(env: Env, renderer: Renderer) -> None:
    proxy, sampler = env
    raw = sdk(proxy).messages.with_raw_response.create(model="tiny", max_tokens=200, system="You are helpful.",
                                                       messages=USER, tools=TOOLS,
                                                       extra_headers={"X-Session-Id": "anth-1"})
    msg = raw.parse()
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    thinking, text, tool = msg.content
    assert thinking.type == "thinking" and thinking.thinking == "The user wants the file."
    assert text.type == "text" and text.text == "Let me look. "
    assert tool.type == "tool_use" and tool.name == "read_file" and tool.input == {"path": "/tmp/a.txt"}
    assert tool.id.startswith("toolu_")
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None

    turn = turn_of(proxy, "anth-1")
    openai_msgs = [{"role": "system", "content": "You are helpful."}, *USER]
    assert turn["prompt_token_ids"] == renderer.render(openai_msgs, OPENAI_TOOLS)
    assert sampler.prompts[-1] == turn["prompt_token_ids"]
    assert turn["completion_token_ids"] == sampler.script
    assert turn["completion_logprobs"] == [-0.25] * len(sampler.script)
    assert turn["status"] == "ok" and turn["meta"]["api"] == "anthropic"
    assert msg.usage.input_tokens == len(turn["prompt_token_ids"])
    assert msg.usage.output_tokens == len(sampler.script)
    # The raw Anthropic request and the Anthropic response are what is recorded.
    assert turn["request"]["system"] == "You are helpful." and turn["request"]["tools"][0]["input_schema"] == SCHEMA
    assert turn["response"] == raw.http_response.json()


def test_streaming_final_message_equals_non_streaming(env: Env) -> None:
    proxy, sampler = env
    client = sdk(proxy)
    plain = client.messages.create(model="tiny", max_tokens=200, messages=USER, tools=TOOLS)
    kinds: list[str] = []
    with client.messages.stream(model="tiny", max_tokens=200, messages=USER, tools=TOOLS,
                                extra_headers={"X-Session-Id": "anth-2"}) as stream:
        for event in stream:
            kinds.append(event.type if event.type != "content_block_delta" else event.delta.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("text_delta") + kinds.count("thinking_delta") > 5, "deltas must be streamed piece by piece"
    assert "input_json_delta" in kinds and kinds.count("content_block_start") == 3
    assert without_ids(final.model_dump()) == without_ids(plain.model_dump())
    turn = turn_of(proxy, "anth-2")
    assert turn["completion_token_ids"] == sampler.script and turn["status"] == "ok"
    recorded = anthropic.types.Message.model_validate(turn["response"])
    assert recorded.model_dump() == final.model_dump()
    assert turn["response"]["content"][2]["id"] == final.content[2].id  # type: ignore[union-attr]


def test_multi_turn_tool_history_renders_like_openai(env: Env, renderer: Renderer) -> None:
    proxy, _ = env
    history: Any = [
        {"role": "user", "content": [{"type": "text", "text": "read it"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "need the file", "signature": ""},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "/tmp/a.txt"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "file contents: 42"}]},
            {"type": "text", "text": "and now?"}]},
    ]
    sdk(proxy).messages.create(model="tiny", max_tokens=50, messages=history, tools=TOOLS,
                               system=[{"type": "text", "text": "Be brief."}],
                               tool_choice={"type": "auto"}, extra_headers={"X-Session-Id": "anth-3"})
    equivalent: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": "Reading.", "reasoning_content": "need the file",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "read_file", "arguments": '{"path": "/tmp/a.txt"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "file contents: 42"},
        {"role": "user", "content": "and now?"},
    ]
    turn = turn_of(proxy, "anth-3")
    assert turn["prompt_token_ids"] == renderer.render(equivalent, OPENAI_TOOLS)
    text = renderer.decode(turn["prompt_token_ids"])
    assert "file contents: 42" in text and "need the file" in text and "Be brief." in text
    # A system message inside `messages` (newer SDKs send these) is a system message for the renderer.
    sdk(proxy).messages.create(model="tiny", max_tokens=5, extra_headers={"X-Session-Id": "anth-3s"},
                               messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *USER])
    assert turn_of(proxy, "anth-3s")["prompt_token_ids"] == renderer.render([equivalent[0], *USER])
    # tool_choice none hides the tools, as it does for OpenAI requests.
    sdk(proxy).messages.create(model="tiny", max_tokens=5, messages=USER, tools=TOOLS, tool_choice={"type": "none"},
                               extra_headers={"X-Session-Id": "anth-3b"})
    assert turn_of(proxy, "anth-3b")["prompt_token_ids"] == renderer.render(USER)


def test_stop_sequences(env: Env, renderer: Renderer) -> None:
    proxy, sampler = env
    for stream in (False, True):
        sid = f"anth-4-{stream}"
        kwargs: Any = {"model": "tiny", "max_tokens": 200, "messages": USER, "stop_sequences": ["never", "look"],
                       "extra_headers": {"X-Session-Id": sid}}
        if stream:
            with sdk(proxy).messages.stream(**kwargs) as s:
                msg = s.get_final_message()
        else:
            msg = sdk(proxy).messages.create(**kwargs)
        assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "look"
        assert msg.content[-1].type == "text" and msg.content[-1].text == "Let me "
        turn = turn_of(proxy, sid)
        ids = turn["completion_token_ids"]
        assert 0 < len(ids) < len(sampler.script) and ids == sampler.script[: len(ids)]
        assert "look" in renderer.decode(ids)


def test_max_tokens_and_sampling_params(env: Env) -> None:
    proxy, sampler = env
    msg = sdk(proxy).messages.create(model="tiny", max_tokens=3, messages=USER, metadata={"user_id": "u1"},
                                     thinking={"type": "enabled", "budget_tokens": 1024},
                                     output_config={"effort": "low"},
                                     extra_body={"temperature": 0.0, "top_p": 0.5, "top_k": 5})
    params = sampler.calls[-1]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (3, 0.0, 0.5, 5)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3
    with sdk(proxy).messages.stream(model="default", max_tokens=4, messages=USER) as s:
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 4


def test_sessions_by_url_bearer_and_count_tokens(env: Env, renderer: Renderer) -> None:
    proxy, _ = env
    bearer = anthropic.Anthropic(base_url=proxy.base + "/s/anth-url", auth_token=proxy.state.keys.client,
                                 max_retries=0)
    bearer.messages.create(model="tiny", max_tokens=5, messages=USER)
    assert turn_of(proxy, "anth-url")["prompt_token_ids"] == renderer.render(USER)
    sdk(proxy).messages.create(model="tiny", max_tokens=5, messages=USER,
                               extra_headers={"X-Session-Id": "anth-side", "X-Turn-Type": "side"})
    assert turn_of(proxy, "anth-side")["turn_type"] == "side"
    counted = sdk(proxy).messages.count_tokens(model="tiny", messages=USER, tools=TOOLS)
    assert counted.input_tokens == len(renderer.render(USER, OPENAI_TOOLS))


def assert_anthropic_error(exc: anthropic.APIStatusError, status: int, kind: str) -> None:
    assert exc.status_code == status
    body = exc.response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    assert "Traceback" not in exc.response.text


def test_errors_are_anthropic_shaped(env: Env) -> None:
    proxy, _ = env
    with pytest.raises(anthropic.AuthenticationError) as auth:
        sdk(proxy, key="wrong-key").messages.create(model="tiny", max_tokens=5, messages=USER)
    assert_anthropic_error(auth.value, 401, "authentication_error")
    with pytest.raises(anthropic.NotFoundError) as nf:
        sdk(proxy).messages.create(model="no-such-model", max_tokens=5, messages=USER)
    assert_anthropic_error(nf.value, 404, "not_found_error")
    image: Any = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]
    with pytest.raises(anthropic.BadRequestError) as bad:
        sdk(proxy).messages.create(model="tiny", max_tokens=5, messages=image)
    assert_anthropic_error(bad.value, 400, "invalid_request_error")
    assert "image" in bad.value.message
    with pytest.raises(anthropic.BadRequestError):
        sdk(proxy).messages.create(model="tiny", max_tokens=5, messages=USER, extra_body={"temperature": 1.5})
    structured: Any = {"format": {"type": "json_schema", "schema": SCHEMA}}
    with pytest.raises(anthropic.BadRequestError):
        sdk(proxy).messages.create(model="tiny", max_tokens=5, messages=USER, output_config=structured)
    with pytest.raises(anthropic.BadRequestError):
        sdk(proxy).messages.create(model="tiny", max_tokens=5,
                                   messages=[*USER, {"role": "assistant", "content": "Sure, "}])

    key = {"x-api-key": proxy.state.keys.client}
    cases: list[tuple[dict[str, str], bytes, int, str]] = [
        ({}, b'{"model": "tiny"}', 401, "authentication_error"),
        (key, b'{"model": "tiny", "messages": [}', 400, "invalid_request_error"),
        (key, b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}]}', 400, "invalid_request_error"),
        (key, b'{"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "'
         + b"x" * 300_000 + b'"}]}', 413, "request_too_large"),
    ]
    for headers, body, status, kind in cases:
        r = httpx.post(proxy.base + "/v1/messages", content=body,
                       headers={**headers, "content-type": "application/json"}, timeout=30)
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
    missing = httpx.post(proxy.base + "/v1/messages", json={}, timeout=30).json()
    assert "x-api-key" in missing["error"]["message"]
    # Chat completions keep their OpenAI-shaped errors.
    r = httpx.post(proxy.base + "/v1/chat/completions", content=b"{", headers=key, timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param", "code"}


def test_overloaded_sampler_is_rate_limit_error_with_retry_after(env: Env) -> None:
    proxy, sampler = env
    sampler.fail_with = SamplerOverloaded("queue full", retry_after_s=3)
    with pytest.raises(anthropic.RateLimitError) as rl:
        sdk(proxy).messages.create(model="tiny", max_tokens=5, messages=USER)
    assert_anthropic_error(rl.value, 429, "overloaded_error")
    assert rl.value.response.headers["retry-after"] == "3"
    with pytest.raises(anthropic.RateLimitError), sdk(proxy).messages.stream(model="tiny", max_tokens=5,
                                                                            messages=USER) as s:
        s.get_final_message()


@dataclass
class _FailingStream:
    tokens: list[SampledToken]
    policy_version: int = 0
    finish_reason: Any = None

    def __aiter__(self) -> AsyncIterator[SampledToken]:
        return self._run()

    async def _run(self) -> AsyncIterator[SampledToken]:
        for tok in self.tokens:
            yield tok
        raise SamplerUnavailable("engine died")

    async def aclose(self) -> None:
        return None


@dataclass
class FailingMidStream(FakeSampler):
    """Yields the first `fail_after` scripted tokens, then fails."""

    fail_after: int = 8

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> SampleStream:
        self.prompts.append(list(prompt_ids))
        return _FailingStream([SampledToken(t, self.logprob) for t in self.script[: self.fail_after]])


def test_mid_stream_failure_is_an_error_event_and_recorded_cancelled(tiny_model_dir: Path, renderer: Renderer,
                                                                   tmp_path: Path) -> None:
    proxy = start_fake_proxy(tiny_model_dir, tmp_path, FailingMidStream(script=script_for(renderer, ANSWER)))
    try:
        seen: list[str] = []
        with pytest.raises(anthropic.APIStatusError) as err, sdk(proxy).messages.stream(
                model="tiny", max_tokens=50, messages=USER, extra_headers={"X-Session-Id": "anth-fail"}) as s:
            for event in s:
                seen.append(event.type)
        assert "message_start" in seen and "message_stop" not in seen
        assert isinstance(err.value.body, dict) and err.value.body["error"]["type"] == "api_error"
        with pytest.raises(anthropic.APIStatusError):  # non-streaming: a 502
            sdk(proxy).messages.create(model="tiny", max_tokens=50, messages=USER,
                                       extra_headers={"X-Session-Id": "anth-fail2"})
        for sid in ("anth-fail", "anth-fail2"):
            for _ in range(50):
                view = proxy.state.store.session_view(sid)
                if view and view["turns"]:
                    break
                time.sleep(0.05)
            turn = turn_of(proxy, sid)
            assert turn["status"] == "cancelled" and len(turn["completion_token_ids"]) == 8
    finally:
        proxy.stop()


def test_tool_input_fallback_and_json() -> None:
    from clawbridge.proxy.anthropic import tool_input

    assert tool_input('{"a": 1}') == {"a": 1}
    assert tool_input("") == {}
    assert tool_input("not json") == {"arguments": "not json"}
    assert json.loads(json.dumps(tool_input("[1]"))) == {"arguments": "[1]"}
