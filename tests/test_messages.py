"""Chat messages are parsed once (`clawbridge.chat.messages`): the validated request holds them parsed,
and the renderer takes them as they are, with the same ids as for the plain objects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import clawbridge.chat.messages as messages_module
from clawbridge.chat.messages import ChatMessage, parse_messages
from clawbridge.chat.render import Renderer
from clawbridge.proxy.errors import ApiError
from clawbridge.proxy.request import validate_chat_request

CHAT: list[dict[str, Any]] = [
    {"role": "developer", "content": [{"type": "text", "text": "Be brief."}, "Really."]},
    {"role": "user", "content": "List /tmp"},
    {"role": "assistant", "content": None, "reasoning_content": "use ls",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "/tmp"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
    {"role": "user", "content": "Thanks", "ignored_extra": 1},
]


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> Renderer:
    return Renderer.from_pretrained(str(tiny_model_dir))


def test_a_request_parses_each_message_once(renderer: Renderer, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    real = messages_module._normalized

    def counting(raw: Any) -> dict[str, Any]:
        calls.append(raw)
        return real(raw)

    monkeypatch.setattr(messages_module, "_normalized", counting)
    req = validate_chat_request({"model": "tiny", "messages": CHAT})
    assert len(calls) == len(CHAT)
    assert all(isinstance(m, ChatMessage) for m in req.messages)
    prompt = renderer.render_prompt(req.messages)
    assert len(calls) == len(CHAT), "the renderer took the parsed messages without parsing them again"
    assert parse_messages(req.messages) == req.messages  # parsed messages pass through unchanged
    monkeypatch.undo()
    assert prompt.ids == renderer.render(CHAT), "parsed or plain, the same prompt ids"


def test_parsed_messages_are_normalized() -> None:
    parsed = parse_messages(CHAT)
    assert parsed[0].content == "Be brief.\nReally."
    assert parsed[2].tool_calls == [{"type": "function", "id": "c1", "function": {"name": "ls", "arguments": {"path": "/tmp"}}}]
    assert parsed[2].reasoning_content == "use ls" and parsed[2].content == ""
    assert parsed[0].template_dict(developer_as_system=True)["role"] == "system"
    assert parsed[0].template_dict(developer_as_system=False)["role"] == "developer"
    assert "ignored_extra" not in parsed[4].template_dict(developer_as_system=False)
    with pytest.raises(ValueError):
        parsed[1].content = "changed"  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(("bad", "status", "param", "why"), [
    ({"role": "tool", "tool_call_id": "c1"}, 422, "messages.1", "a tool message needs 'content'"),
    ({"role": "assistant", "tool_calls": [{"function": {}}]}, 422, "messages.1", "tool_calls[0]: tool call without a function name"),
    ({"role": "user", "content": 5}, 422, "messages.1", "content must be"),
    ({"role": "wizard", "content": "x"}, 422, "messages.1", "unknown role 'wizard'"),
    ({"role": ["user"], "content": "x"}, 422, "messages.1", "unknown role ['user']"),  # unhashable: found by fuzzing
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, 400, "messages.1.content",
     "only text is served"),
])
def test_a_bad_message_is_refused_naming_it(bad: dict[str, Any], status: int, param: str, why: str) -> None:
    with pytest.raises(ApiError) as err:
        validate_chat_request({"model": "tiny", "messages": [{"role": "user", "content": "hi"}, bad]})
    assert (err.value.status, err.value.param) == (status, param)
    assert why in err.value.message
