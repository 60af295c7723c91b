"""The OpenAI-shaped view of a turn as the store recorded it, whatever API it came in by: the one
place the judge, on-policy distillation, the dashboard, the CLI and the exports read recorded
requests and answers through.

Invariants:
- `api == "anthropic"`: the request is validated and converted by `clawbridge.shapes.anthropic`
  (so a `tool_result` block is a `tool` message, a `tool_use` a tool call).
- `api == "responses"`: the request is validated and converted by `clawbridge.shapes.responses`
  (`instructions` is the system message, input items are chat messages, function tools chat
  tools). A `previous_response_id` chain is NOT followed (that needs the store): the view holds
  what this call sent, which is what follows the previous turn's answer.
- A request that does not convert gives an empty view (no messages, no tools), never an exception.
- Any other api: `messages` are the request's message objects (others skipped), `tools` its list
  of tools when it has one, `tool_choice` as recorded.
- `answer_message` reads the three response shapes (chat `choices`, Anthropic `content` blocks,
  Responses `output` items) as one assistant message `{role, content, reasoning_content?,
  tool_calls?}`; `content` is always a string ("" when the answer has no text).
- Nothing recorded is mutated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clawbridge.shapes.anthropic import openai_data, validate_messages_request
from clawbridge.shapes.responses import chat_data, output_messages, validate_responses_request


@dataclass(frozen=True)
class OpenAIView:
    """Messages, tools and tool_choice of a recorded request, in OpenAI shape."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None


def _converted(request: Mapping[str, Any], api: str) -> dict[str, Any]:
    """The chat-shaped data of an Anthropic or Responses request (raises when it does not convert)."""
    if api == "anthropic":
        return openai_data(validate_messages_request(dict(request), need_max_tokens=False))
    return chat_data(validate_responses_request(dict(request)), [])


def openai_view(request: Mapping[str, Any], api: str) -> OpenAIView:
    """The recorded `request` (sent to API `api`) in OpenAI shape (module invariants)."""
    if api in ("anthropic", "responses"):
        try:
            data = _converted(request, api)
        except Exception:  # ShapeError, or data no validator foresaw: unusable, never fatal here
            return OpenAIView()
        return OpenAIView(list(data["messages"]), data.get("tools"), data.get("tool_choice"))
    msgs = request.get("messages")
    tools = request.get("tools")
    return OpenAIView(
        [dict(m) for m in msgs if isinstance(m, Mapping)] if isinstance(msgs, list) else [],
        list(tools) if isinstance(tools, list) else None,
        request.get("tool_choice"),
    )


def _assistant(content: Any, reasoning: Any, calls: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content if isinstance(content, str) else "",
            **({"reasoning_content": reasoning} if isinstance(reasoning, str) and reasoning else {}),
            **({"tool_calls": list(calls)} if isinstance(calls, list) and calls else {})}


def _output_answer(output: list[Any]) -> dict[str, Any]:
    """A Responses answer's output items as one assistant message."""
    try:
        msgs = output_messages([item for item in output if isinstance(item, dict)])
    except Exception:  # ShapeError: an output no validator foresaw, unusable, never fatal here
        return _assistant("", None, None)
    said = [m for m in msgs if m.get("role") == "assistant"]
    return _assistant("".join(str(m.get("content") or "") for m in said),
                      "\n\n".join(str(m["reasoning_content"]) for m in said if m.get("reasoning_content")),
                      [c for m in said for c in m.get("tool_calls") or []])


def answer_message(response: Mapping[str, Any] | None) -> dict[str, Any]:
    """The assistant message of a recorded response: chat-, Anthropic- or Responses-shaped."""
    if not response:
        return _assistant("", None, None)
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        msg = choices[0].get("message") or {}
        return _assistant(msg.get("content") or "", msg.get("reasoning_content"), msg.get("tool_calls"))
    output = response.get("output")
    if isinstance(output, list):
        return _output_answer(output)
    content = response.get("content")
    if isinstance(content, list):  # Anthropic message
        blocks = [b for b in content if isinstance(b, Mapping)]
        calls = [{"id": b.get("id"), "type": "function",
                  "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))}}
                 for b in blocks if b.get("type") == "tool_use"]
        return _assistant("".join(str(b.get("text", "")) for b in blocks if b.get("type") == "text"),
                          "".join(str(b.get("thinking", "")) for b in blocks if b.get("type") == "thinking"),
                          calls)
    return _assistant("", None, None)
