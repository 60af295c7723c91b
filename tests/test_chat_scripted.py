"""Chat completions with a scripted sampler: exact text, reasoning, tool calls, stops, logprobs, streaming.

Every test runs once per chat format: the tiny model's Qwen3 template (native tools) and the same
model with a plain ChatML template (tools written into the system message)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from clawbridge.chat.render import Renderer
from tests.fake_proxy import SwitchableSampler, script_for, start_fake_proxy
from tests.support import InProcessProxy

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]
ANSWER = ('<think>\nThe user wants the file.\n</think>\n\nLet me look. <tool_call>\n'
          '{"name": "read_file", "arguments": {"path": "/tmp/a.txt"}}\n</tool_call>')


@pytest.fixture(scope="module", params=["tiny_model_dir", "tiny_chatml_dir"], ids=["qwen3", "plain"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(request.param))


@pytest.fixture(scope="module")
def renderer(model_dir: Path) -> Renderer:
    return Renderer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def env(model_dir: Path, renderer: Renderer,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InProcessProxy, SwitchableSampler]]:
    sampler = SwitchableSampler(script=script_for(renderer, ANSWER), logprob=-0.25)
    proxy = start_fake_proxy(model_dir, tmp_path_factory.mktemp("scripted"), sampler)
    yield proxy, sampler
    proxy.stop()


def sdk(proxy: InProcessProxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base + "/v1", api_key=proxy.state.keys.client, max_retries=0)


def test_non_streaming_parses_reasoning_and_tool_calls(env: tuple[InProcessProxy, SwitchableSampler],
                                                       renderer: Renderer) -> None:
    proxy, sampler = env
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "read /tmp/a.txt"}]
    resp = sdk(proxy).chat.completions.create(model="tiny", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                              extra_headers={"X-Session-Id": "scripted-1"})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look. "
    assert choice.message.reasoning_content == "The user wants the file."  # type: ignore[attr-defined]
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].function.name == "read_file"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"path": "/tmp/a.txt"}  # type: ignore[union-attr]
    assert resp.usage is not None and resp.usage.completion_tokens == len(sampler.script)

    turn = proxy.state.store.session_view("scripted-1")["turns"][0]
    # Token exact: what was fed is what the renderer makes of the request; what was sampled is the script.
    assert turn["prompt_token_ids"] == renderer.render(messages, TOOLS)
    assert sampler.prompts[-1] == turn["prompt_token_ids"]
    assert turn["completion_token_ids"] == sampler.script
    assert turn["completion_logprobs"] == [-0.25] * len(sampler.script)
    assert turn["response"]["choices"][0]["message"]["tool_calls"][0]["id"] == calls[0].id


def test_streaming_matches_non_streaming(env: tuple[InProcessProxy, SwitchableSampler]) -> None:
    proxy, sampler = env
    stream = sdk(proxy).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "go"}], tools=TOOLS, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_headers={"X-Session-Id": "scripted-2"})
    content, reasoning, calls, finish, usage = "", "", [], None, None
    n_chunks = 0
    for chunk in stream:
        n_chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert n_chunks > 5, "deltas must be streamed piece by piece"
    assert content == "Let me look. " and reasoning == "The user wants the file."
    assert finish == "tool_calls" and len(calls) == 1 and calls[0].function.name == "read_file"  # type: ignore[union-attr]
    assert usage is not None and usage.completion_tokens == len(sampler.script)
    turn = proxy.state.store.session_view("scripted-2")["turns"][0]
    assert turn["response"]["choices"][0]["message"]["content"] == content
    assert turn["completion_token_ids"] == sampler.script


def test_multi_turn_history_with_tool_results_renders_exactly(env: tuple[InProcessProxy, SwitchableSampler],
                                                               renderer: Renderer) -> None:
    proxy, _sampler = env
    history = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": None, "reasoning_content": "need the file",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "read_file", "arguments": '{"path": "/tmp/a.txt"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "file contents: 42"},
        {"role": "user", "content": "and now?"},
    ]
    sdk(proxy).chat.completions.create(model="tiny", messages=history, tools=TOOLS,  # type: ignore[arg-type]
                                       extra_headers={"X-Session-Id": "scripted-3"})
    turn = proxy.state.store.session_view("scripted-3")["turns"][0]
    assert turn["prompt_token_ids"] == renderer.render(history, TOOLS)
    text = renderer.decode(turn["prompt_token_ids"])
    assert "file contents: 42" in text and "read_file" in text and "Be brief." in text


def test_logprobs_and_stop_strings(env: tuple[InProcessProxy, SwitchableSampler], renderer: Renderer) -> None:
    proxy, sampler = env
    resp = sdk(proxy).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=0,  # type: ignore[arg-type]
        stop=["look"], extra_headers={"X-Session-Id": "scripted-4"})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content is not None and "look" not in choice.message.content
    assert choice.message.content.endswith("Let me ")
    assert choice.logprobs is not None and choice.logprobs.content is not None
    turn = proxy.state.store.session_view("scripted-4")["turns"][0]
    assert [e.logprob for e in choice.logprobs.content] == turn["completion_logprobs"]
    assert "".join(e.token for e in choice.logprobs.content) == renderer.decode(turn["completion_token_ids"])
    # Recorded ids are the sampled prefix up to the stop string, a prefix of the script.
    assert turn["completion_token_ids"] == sampler.script[: len(turn["completion_token_ids"])]


def test_max_tokens_and_params_reach_the_sampler(env: tuple[InProcessProxy, SwitchableSampler]) -> None:
    proxy, sampler = env
    resp = sdk(proxy).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],  # type: ignore[arg-type]
                                              max_completion_tokens=3, temperature=0.0, top_p=0.5, seed=7,
                                              extra_body={"top_k": 5})
    params = sampler.calls[-1]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (3, 0.0, 0.5, 5, 7)
    assert resp.choices[0].finish_reason == "length" and resp.usage is not None and resp.usage.completion_tokens == 3
    sdk(proxy).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4)  # type: ignore[arg-type]
    assert sampler.calls[-1].max_tokens == 4


def test_malformed_tool_call_comes_back_as_content(model_dir: Path, renderer: Renderer, tmp_path: Path) -> None:
    bad = 'Sure. <tool_call>\n{"name": "read_file", "arguments": {oops</tool_call>'
    sampler = SwitchableSampler(script=script_for(renderer, bad))
    proxy = start_fake_proxy(model_dir, tmp_path, sampler)
    try:
        msg = sdk(proxy).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}]).choices[0]  # type: ignore[arg-type]
        assert not msg.message.tool_calls
        assert msg.message.content is not None and "oops" in msg.message.content
        chunks = list(sdk(proxy).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],  # type: ignore[arg-type]
                                                         stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == msg.message.content
    finally:
        proxy.stop()


def test_forced_tool_choice_is_a_call_to_that_function(model_dir: Path, renderer: Renderer, tmp_path: Path) -> None:
    """The prompt ends with the call's opening; the model writes only the arguments; the SDK gets the call."""
    tools = [*TOOLS, {"type": "function", "function": {"name": "exec", "parameters": {"type": "object"}}}]
    sampler = SwitchableSampler(script=script_for(renderer, ' {"path": "/tmp/b.txt"}}\n</tool_call> and more'))
    proxy = start_fake_proxy(model_dir, tmp_path, sampler)
    choice = {"type": "function", "function": {"name": "read_file"}}
    messages = [{"role": "user", "content": "read b"}]
    try:
        resp = sdk(proxy).chat.completions.create(model="tiny", messages=messages, tools=tools,  # type: ignore[arg-type]
                                                  tool_choice=choice, extra_headers={"X-Session-Id": "forced-1"})
        got = resp.choices[0]
        assert got.finish_reason == "tool_calls" and got.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments))  # type: ignore[union-attr]
                for c in got.message.tool_calls or []] == [("read_file", {"path": "/tmp/b.txt"})]
        turn = proxy.state.store.session_view("forced-1")["turns"][0]
        assert turn["prompt_token_ids"] == renderer.render(messages, tools, choice)
        assert renderer.decode(turn["prompt_token_ids"]).endswith('<tool_call>\n{"name": "read_file", "arguments":')
        # Sampling ends where the forced call closes: the call is the whole answer.
        assert renderer.decode(turn["completion_token_ids"]) == ' {"path": "/tmp/b.txt"}}\n</tool_call>'
        assert turn["completion_token_ids"] == sampler.script[: len(turn["completion_token_ids"])]
        stream = sdk(proxy).chat.completions.create(model="tiny", messages=messages, tools=tools,  # type: ignore[arg-type]
                                                    tool_choice=choice, stream=True)
        calls, finish = [], None
        for chunk in stream:
            for ch in chunk.choices:
                calls += ch.delta.tool_calls or []
                finish = ch.finish_reason or finish
        assert finish == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in calls] == [  # type: ignore[union-attr]
            ("read_file", got.message.tool_calls[0].function.arguments)]  # type: ignore[index, union-attr]
        # Anthropic's {"type": "tool"} is the same forced call, as a tool_use block.
        anth = anthropic.Anthropic(base_url=proxy.base, api_key=proxy.state.keys.client, max_retries=0)
        msg = anth.messages.create(model="tiny", max_tokens=64, messages=[{"role": "user", "content": "read b"}],
                                   tools=[{"name": "read_file", "input_schema": {"type": "object"}}],
                                   tool_choice={"type": "tool", "name": "read_file"})
        assert msg.stop_reason == "tool_use"
        assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in msg.content] == [
            ("tool_use", "read_file", {"path": "/tmp/b.txt"})]
        # And the Responses API's {"type": "function", "name"}: one function_call item.
        items = sdk(proxy).responses.create(model="tiny", input="read b", tool_choice={"type": "function", "name": "read_file"},
                                            tools=[{"type": "function", "name": "read_file", "parameters": {"type": "object"},
                                                    "strict": False}]).output
        assert [(i.type, getattr(i, "name", None), json.loads(getattr(i, "arguments", "null"))) for i in items] == [
            ("function_call", "read_file", {"path": "/tmp/b.txt"})]
        # "required" with one tool is the same forced call.
        req = sdk(proxy).chat.completions.create(model="tiny", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                                 tool_choice="required")
        assert [c.function.name for c in req.choices[0].message.tool_calls or []] == ["read_file"]  # type: ignore[union-attr]
    finally:
        proxy.stop()


def test_parallel_tool_calls_false_ends_the_answer_at_the_first_call(model_dir: Path, renderer: Renderer,
                                                                      tmp_path: Path) -> None:
    two = ('First. <tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "read_file", "arguments": {"path": "b"}}\n</tool_call>')
    sampler = SwitchableSampler(script=script_for(renderer, two))
    proxy = start_fake_proxy(model_dir, tmp_path, sampler)
    messages = [{"role": "user", "content": "read a and b"}]
    try:
        both = sdk(proxy).chat.completions.create(model="tiny", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
        assert [json.loads(c.function.arguments) for c in both.choices[0].message.tool_calls or []] == [  # type: ignore[union-attr]
            {"path": "a"}, {"path": "b"}]
        one = sdk(proxy).chat.completions.create(model="tiny", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                                 parallel_tool_calls=False, extra_headers={"X-Session-Id": "serial"})
        got = one.choices[0]
        assert got.finish_reason == "tool_calls" and got.message.content == "First. "
        assert [json.loads(c.function.arguments) for c in got.message.tool_calls or []] == [{"path": "a"}]  # type: ignore[union-attr]
        turn = proxy.state.store.session_view("serial")["turns"][0]
        assert renderer.decode(turn["completion_token_ids"]).endswith('"path": "a"}}\n</tool_call>')
        # The same through Anthropic's disable_parallel_tool_use and the Responses API's parallel_tool_calls.
        anth = anthropic.Anthropic(base_url=proxy.base, api_key=proxy.state.keys.client, max_retries=0)
        msg = anth.messages.create(model="tiny", max_tokens=200, messages=[{"role": "user", "content": "read"}],
                                   tools=[{"name": "read_file", "input_schema": {"type": "object"}}],
                                   tool_choice={"type": "auto", "disable_parallel_tool_use": True})
        assert [b.type for b in msg.content] == ["text", "tool_use"] and msg.stop_reason == "tool_use"
        out = sdk(proxy).responses.create(model="tiny", input="read", parallel_tool_calls=False,
                                          tools=[{"type": "function", "name": "read_file",
                                                  "parameters": {"type": "object"}, "strict": False}]).output
        assert [i.type for i in out] == ["message", "function_call"]
    finally:
        proxy.stop()
