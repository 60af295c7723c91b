"""The OpenAI Responses API through the real `openai` SDK, over a real proxy and a scripted sampler."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clawbridge.chat.render import Renderer
from clawbridge.serving.sampler import SamplerUnavailable
from tests.fake_proxy import SwitchableSampler, script_for, start_fake_proxy
from tests.support import InProcessProxy

ANSWER = ('<think>\nThe user wants the file.\n</think>\n\nLet me look. <tool_call>\n'
          '{"name": "read_file", "arguments": {"path": "/tmp/a.txt"}}\n</tool_call>')
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
TOOLS: Any = [{"type": "function", "name": "read_file", "description": "Read a file", "parameters": SCHEMA}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                "parameters": SCHEMA}}]
Env = tuple[InProcessProxy, SwitchableSampler]


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> Renderer:
    return Renderer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def env(tiny_model_dir: Path, renderer: Renderer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    sampler = SwitchableSampler(script=script_for(renderer, ANSWER), logprob=-0.25)
    proxy = start_fake_proxy(tiny_model_dir, tmp_path_factory.mktemp("responses"), sampler)
    yield proxy, sampler
    proxy.stop()


@pytest.fixture(autouse=True)
def _healthy_sampler(env: Env, renderer: Renderer) -> Iterator[None]:
    env[1].fail_with = None
    env[1].script = script_for(renderer, ANSWER)
    yield
    env[1].fail_with = None


def sdk(proxy: InProcessProxy, base: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=base or proxy.base + "/v1", api_key=proxy.state.keys.client, max_retries=0)


def turn_of(proxy: InProcessProxy, session: str, index: int = -1) -> dict[str, Any]:
    view = proxy.state.store.session_view(session)
    assert view is not None, f"session {session} was not recorded"
    return dict(view["turns"][index])


def test_plain_string_input_and_recorded_turn(env: Env, renderer: Renderer) -> None:
    proxy, sampler = env
    sampler.script = script_for(renderer, "Hello there.")
    raw = sdk(proxy).responses.with_raw_response.create(
        model="tiny", input="hi", instructions="Be brief.", max_output_tokens=50,
        extra_headers={"X-Session-Id": "resp-1"})
    resp = raw.parse()
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.status == "completed"
    assert resp.output_text == "Hello there."
    assert [item.type for item in resp.output] == ["message"]
    turn = turn_of(proxy, "resp-1")
    assert turn["prompt_token_ids"] == renderer.render([{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "hi"}])
    assert sampler.prompts[-1] == turn["prompt_token_ids"]
    assert turn["completion_token_ids"] == sampler.script
    assert renderer.decode(turn["completion_token_ids"][:-1]) == "Hello there."
    assert turn["completion_token_ids"][-1] in renderer.stop_token_ids
    assert turn["meta"]["api"] == "responses" and turn["turn_id"] == "turn_" + resp.id.removeprefix("resp_")
    assert resp.usage is not None and resp.usage.input_tokens == len(turn["prompt_token_ids"])
    assert resp.usage.output_tokens == len(sampler.script)
    assert turn["response"] == raw.http_response.json() and turn["request"]["input"] == "hi"


def test_reasoning_and_function_call_items(env: Env, renderer: Renderer) -> None:
    proxy, sampler = env
    resp = sdk(proxy).responses.create(model="tiny", input=[{"role": "user", "content": "read /tmp/a.txt"}],
                                       tools=TOOLS, tool_choice="auto", extra_headers={"X-Session-Id": "resp-2"})
    assert [item.type for item in resp.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = resp.output
    assert reasoning.type == "reasoning" and reasoning.summary[0].text == "The user wants the file."
    assert message.type == "message" and message.content[0].type == "output_text"
    assert message.content[0].text == "Let me look. "
    assert call.type == "function_call" and call.name == "read_file"
    assert call.arguments == '{"path": "/tmp/a.txt"}' and call.call_id
    turn = turn_of(proxy, "resp-2")
    assert turn["prompt_token_ids"] == renderer.render([{"role": "user", "content": "read /tmp/a.txt"}], CHAT_TOOLS,
                                                       "auto")
    assert turn["completion_token_ids"] == sampler.script


def test_streaming_events_and_final_response_equal_non_streaming(env: Env) -> None:
    proxy, sampler = env
    client = sdk(proxy)
    plain = client.responses.create(model="tiny", input="read /tmp/a.txt", tools=TOOLS)
    kinds: list[str] = []
    text = ""
    with client.responses.stream(model="tiny", input="read /tmp/a.txt", tools=TOOLS,
                                 extra_headers={"X-Session-Id": "resp-3"}) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") > 1, "text must be streamed piece by piece"
    assert "response.reasoning_summary_text.delta" in kinds
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert text == "Let me look. "

    def without_ids(r: Any) -> dict[str, Any]:
        d = r.model_dump()
        d.update(id=None, created_at=None)
        d["output"] = [dict(item, id=None, call_id=None) if item["type"] == "function_call" else dict(item, id=None)
                       for item in d["output"]]
        for item in d["output"]:  # the SDK's stream helper adds `parsed`/`parsed_arguments` fields
            item.pop("parsed_arguments", None)
            for part in item.get("content") or []:
                part.pop("parsed", None)
        return dict(d)

    assert without_ids(final) == without_ids(plain)
    turn = turn_of(proxy, "resp-3")
    assert turn["status"] == "ok" and turn["completion_token_ids"] == sampler.script
    recorded = openai.types.responses.Response.model_validate(turn["response"])
    assert recorded.id == final.id and [i.id for i in recorded.output] == [i.id for i in final.output]  # type: ignore[union-attr]
    assert without_ids(recorded) == without_ids(final)


def test_function_call_output_round_trip_renders_like_chat(env: Env, renderer: Renderer) -> None:
    """The output items of one response, sent back with a function_call_output, render as the chat history."""
    proxy, sampler = env
    client = sdk(proxy)
    first = client.responses.create(model="tiny", input=[{"role": "user", "content": "read /tmp/a.txt"}],
                                    tools=TOOLS, extra_headers={"X-Session-Id": "resp-4"})
    call = first.output[2]
    assert call.type == "function_call"
    sampler.script = script_for(renderer, "It says 42.")
    items: Any = [{"role": "user", "content": "read /tmp/a.txt"},
                  *[item.model_dump(exclude_none=True) for item in first.output],
                  {"type": "function_call_output", "call_id": call.call_id, "output": "file contents: 42"}]
    second = client.responses.create(model="tiny", input=items, tools=TOOLS, extra_headers={"X-Session-Id": "resp-4"})
    assert second.output_text == "It says 42."
    chat_history: list[dict[str, Any]] = [
        {"role": "user", "content": "read /tmp/a.txt"},
        {"role": "assistant", "content": "Let me look. ", "reasoning_content": "The user wants the file.",
         "tool_calls": [{"id": call.call_id, "type": "function",
                         "function": {"name": "read_file", "arguments": '{"path": "/tmp/a.txt"}'}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "file contents: 42"},
    ]
    turn = turn_of(proxy, "resp-4")
    assert turn["prompt_token_ids"] == renderer.render(chat_history, CHAT_TOOLS)
    # The recorded ids decode to what was sent: the tool output and the earlier answer are in the prompt.
    prompt_text = renderer.decode(turn["prompt_token_ids"])
    assert "file contents: 42" in prompt_text and "Let me look." in prompt_text and "/tmp/a.txt" in prompt_text

    # previous_response_id continues the same conversation without resending it.
    third = client.responses.create(model="tiny", previous_response_id=first.id, tools=TOOLS,
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": "file contents: 42"}],
                                    extra_headers={"X-Session-Id": "resp-4"})
    assert third.previous_response_id == first.id
    assert turn_of(proxy, "resp-4")["prompt_token_ids"] == turn["prompt_token_ids"]
    assert client.responses.retrieve(first.id).output[2].model_dump() == call.model_dump()


def test_store_false_is_training_data_only(env: Env, renderer: Renderer) -> None:
    proxy, sampler = env
    sampler.script = script_for(renderer, "ok")
    client = sdk(proxy)
    resp = client.responses.create(model="tiny", input="hi", store=False, extra_headers={"X-Session-Id": "resp-5"})
    turn = turn_of(proxy, "resp-5")
    assert turn["status"] == "ok" and turn["meta"]["store"] is False and getattr(resp, "store", None) is False
    with pytest.raises(openai.NotFoundError, match="store: false"):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.BadRequestError, match="store: false") as err:
        client.responses.create(model="tiny", input="again", previous_response_id=resp.id)
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_max_output_tokens_is_incomplete(env: Env) -> None:
    proxy, _ = env
    resp = sdk(proxy).responses.create(model="tiny", input="hi", max_output_tokens=3,
                                       extra_headers={"X-Session-Id": "resp-6"})
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert len(turn_of(proxy, "resp-6")["completion_token_ids"]) == 3
    events = []
    with httpx.stream("POST", proxy.base + "/responses", json={"input": "hi", "max_output_tokens": 3, "stream": True},
                      headers={"Authorization": f"Bearer {proxy.state.keys.client}"}) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line.removeprefix("event: "))
    assert events[-1] == "response.incomplete" and "response.completed" not in events


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": "hi", "previous_response_id": "resp_doesnotexist"}, "previous_response_id"),
    ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": ""}, "input"),
    ({"instructions": "no input"}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0.text"),
    ({"input": [{"role": "user", "content": ["bare"]}]}, "input.0.content.0"),
    ({"input": [{"type": "reasoning", "summary": "thought"}]}, "input.0.summary"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
])
def test_bad_input_is_a_400_with_an_openai_error(env: Env, body: dict[str, Any], param: str) -> None:
    proxy, sampler = env
    n = len(sampler.prompts)
    r = httpx.post(proxy.base + "/v1/responses", json={"model": "tiny", **body},
                   headers={"Authorization": f"Bearer {proxy.state.keys.client}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert len(sampler.prompts) == n, "nothing is sampled for a refused request"


def test_malformed_json_unknown_model_and_unreachable_sampler(env: Env) -> None:
    proxy, sampler = env
    headers = {"Authorization": f"Bearer {proxy.state.keys.client}"}
    r = httpx.post(proxy.base + "/v1/responses", content=b"{nope", headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(proxy.base + "/v1/responses", json={"model": "gpt-9", "input": "hi"}, headers=headers)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(proxy.base + "/v1/responses", json={"input": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    sampler.fail_with = SamplerUnavailable("engine down")
    with pytest.raises(openai.APIStatusError) as err:
        sdk(proxy).responses.create(model="tiny", input="hi")
    assert err.value.status_code == 502


def test_a_session_key_reads_and_continues_only_its_own_responses(env: Env) -> None:
    proxy, _ = env
    admin = {"Authorization": f"Bearer {proxy.state.keys.admin}"}
    keys = [httpx.post(proxy.base + "/rl/start_session", json={"task_id": "t"}, headers=admin).json()["api_key"]
            for _ in range(2)]
    mine, theirs = (openai.OpenAI(base_url=proxy.base + "/v1", api_key=k, max_retries=0) for k in keys)
    first = mine.responses.create(model="tiny", input="hi")
    assert mine.responses.retrieve(first.id).id == first.id
    assert mine.responses.create(model="tiny", input="more", previous_response_id=first.id).status == "completed"
    with pytest.raises(openai.PermissionDeniedError):
        theirs.responses.retrieve(first.id)
    with pytest.raises(openai.PermissionDeniedError):
        theirs.responses.create(model="tiny", input="more", previous_response_id=first.id)


WEIRD_BODIES: list[bytes] = [
    b"[]", b"{", b"null", b'"text"', b'{"input": null}', b'{"input": {}}', b'{"input": [null]}',
    b'{"input": [{"type": "function_call", "name": 5, "call_id": []}]}', b'{"input": "hi", "tools": {"a": 1}}',
    b'{"input": "hi", "tool_choice": {"type": "allowed_tools"}}', b'{"input": "hi", "temperature": 1e400}',
    b'{"input": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": 5}]}]}',
    b'{"messages": "x", "input": [], "max_tokens": -1}', b'{"input": "hi", "previous_response_id": ""}',
]


@pytest.mark.parametrize("path", ["/v1/responses", "/responses", "/s/weird/v1/responses", "/traj/p/v1/responses",
                                  "/messages", "/chat/completions", "/traj/p/v1/messages"])
def test_weird_bodies_never_get_a_5xx(env: Env, path: str) -> None:
    proxy, _ = env
    headers = {"Authorization": f"Bearer {proxy.state.keys.client}", "Content-Type": "application/json"}
    for body in WEIRD_BODIES:
        r = httpx.post(proxy.base + path, content=body, headers=headers)
        assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"].endswith("_error"), (path, body, r.text)


def test_mid_stream_failure_is_an_error_event_and_recorded_cancelled(tiny_model_dir: Path, renderer: Renderer,
                                                                   tmp_path: Path) -> None:
    from tests.test_anthropic_api import FailingMidStream

    proxy = start_fake_proxy(tiny_model_dir, tmp_path, FailingMidStream(script=script_for(renderer, ANSWER)))
    try:
        events: list[Any] = []
        with sdk(proxy).responses.stream(model="tiny", input="hi", extra_headers={"X-Session-Id": "resp-fail"}) as s:
            events.extend(s)
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "error" and "response.completed" not in kinds
        assert events[-1].code == "model_unreachable" and "engine died" in events[-1].message
        with pytest.raises(openai.APIStatusError) as err:  # non-streaming: a 502
            sdk(proxy).responses.create(model="tiny", input="hi", extra_headers={"X-Session-Id": "resp-fail2"})
        assert err.value.status_code == 502
        for sid in ("resp-fail", "resp-fail2"):
            deadline = time.monotonic() + 10
            while not (proxy.state.store.session_view(sid) or {}).get("turns") and time.monotonic() < deadline:
                time.sleep(0.05)
            turn = turn_of(proxy, sid)
            assert turn["status"] == "cancelled" and len(turn["completion_token_ids"]) == 8
    finally:
        proxy.stop()


def test_recorded_responses_turns_read_back_for_judge_dashboard_and_export(env: Env, renderer: Renderer) -> None:
    """What the judge, on-policy distillation, the dashboard and the exports read of a Responses turn:
    its request (instructions, input items, tools) and its answer (text, reasoning, function calls)
    in OpenAI shape, also across a previous_response_id continuation."""
    from clawbridge.dashboard.data import session_detail
    from clawbridge.export.records import ExportFilter, export_records
    from clawbridge.rewards.next_state import extract_next_states, turn_view
    from clawbridge.store.rewards import RewardStore

    proxy, sampler = env
    client, sid = sdk(proxy), "resp-readback"
    first = client.responses.create(model="tiny", instructions="Be brief.", tools=TOOLS, tool_choice="auto",
                                    input=[{"role": "user", "content": "read /tmp/a.txt"}],
                                    extra_headers={"X-Session-Id": sid})
    call = first.output[2]
    assert call.type == "function_call"
    sampler.script = script_for(renderer, "It says 42.")
    client.responses.create(model="tiny", previous_response_id=first.id, tools=TOOLS,
                            input=[{"type": "function_call_output", "call_id": call.call_id,
                                    "output": "file contents: 42"}],
                            extra_headers={"X-Session-Id": sid})
    asked = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "read /tmp/a.txt"}]
    answered_call = [{"id": call.call_id, "type": "function",
                      "function": {"name": "read_file", "arguments": '{"path": "/tmp/a.txt"}'}}]

    # The judge's and on-policy distillation's reading (the reward worker's transcript).
    views = [turn_view(t.turn_id, t.seq, t.turn_type, t.request, t.response, t.api)
             for t in RewardStore(proxy.state.store).transcript(sid)]
    assert [v.messages for v in views] == [
        asked, [{"role": "tool", "tool_call_id": call.call_id, "content": "file contents: 42"}]]
    assert views[0].answer == {"role": "assistant", "content": "Let me look. ",
                               "reasoning_content": "The user wants the file.", "tool_calls": answered_call}
    assert views[1].answer == {"role": "assistant", "content": "It says 42."}
    nxt = extract_next_states(views)[views[0].turn_id]
    assert nxt.kind == "tool" and nxt.messages[0]["content"] == "file contents: 42"

    # The dashboard's session page.
    detail = session_detail(proxy.state, sid)
    assert detail is not None
    shown = detail["turns"][0]
    assert [m["content"] for m in shown["messages"]] == ["Be brief.", "read /tmp/a.txt"]
    assert shown["answer"]["content"] == "Let me look. " and shown["answer"]["reasoning"] == "The user wants the file."
    assert [c["name"] for c in shown["answer"]["tool_calls"]] == ["read_file"]
    assert detail["turns"][1]["answer"]["content"] == "It says 42."

    # The exports: messages, answer and tools in OpenAI shape.
    records = [r for r in export_records(proxy.state.store, proxy.state.settings, ExportFilter())
               if r["session_id"] == sid]
    assert records[0]["messages"] == asked and records[0]["answer"] == views[0].answer
    assert records[0]["tools"] == CHAT_TOOLS and records[1]["answer"]["content"] == "It says 42."


@pytest.mark.parametrize("request_body", [
    {"input": 5}, {"input": []}, {"input": [{"type": "image", "url": "x"}]}, {"input": "hi", "tools": "nope"},
    {"input": [{"role": "wizard", "content": "x"}]},
])
def test_a_recorded_responses_request_that_does_not_convert_reads_as_empty(request_body: dict[str, Any]) -> None:
    """What a reader sees of a request no validator foresaw: nothing, never an exception."""
    from clawbridge.shapes.recorded import OpenAIView, answer_message, openai_view

    assert openai_view({"model": "tiny", **request_body}, "responses") == OpenAIView()
    odd_outputs: list[Any] = [[{"type": "web_search_call"}], [5, "x"], [{"type": "function_call"}]]
    for output in odd_outputs:
        assert answer_message({"output": output}) == {"role": "assistant", "content": ""}
