"""Reading an OpenAI Responses request and turning it into the chat-shaped data the renderer takes.

It sits below the proxy (which answers its `ShapeError`s as 400 `invalid_request`) and the
readers of recorded turns (`clawbridge.shapes.recorded`: judge, distillation, dashboard, exports).

Invariants:
- Every field that changes what the model sees or how it samples is converted exactly
  (`instructions`, `input` items, function `tools`, `tool_choice`, `max_output_tokens`,
  `temperature`, `top_p`) or refused with a 400 naming it (images, files, hosted tools,
  structured output, background mode, stored prompts, conversations, item references);
  `parallel_tool_calls: false` ends the answer at its first tool call; fields
  that cannot change the prompt (metadata, reasoning settings, include, user, service tier,
  truncation) are accepted and not used: with truncation "auto" a prompt
  too long for the context is still a 400, never silently shortened.
- Input items become chat messages the way the model produced them: a `reasoning` item, an
  assistant `message` and the `function_call`s that follow it are ONE assistant message
  (`reasoning_content`, `content`, `tool_calls`), because the model sampled them as one turn;
  a `function_call_output` is a `tool` message with the same `call_id`.
- `instructions` is the first (system) message; per the Responses API, the instructions of a
  `previous_response_id` chain are not carried over, its input and output items are.
- The conversion never mutates the request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from clawbridge.chat.content import TEXT_PART_FIELDS, ContentError, content_text
from clawbridge.shapes.errors import invalid, validated

_REFUSED_FIELDS = {
    "background": "background responses are not served; send the request and wait (or stream)",
    "conversation": "conversations are not stored here; pass previous_response_id or the whole input",
    "prompt": "stored prompt templates are not served; send instructions and input",
    "top_logprobs": "logprobs are not returned on /v1/responses; use /v1/chat/completions with logprobs",
}


class ResponsesRequest(BaseModel):
    """The fields of /v1/responses that clawbridge reads."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    text: dict[str, Any] | None = None




def validate_responses_request(data: dict[str, Any]) -> ResponsesRequest:
    """The validated request, or a 400 naming the first bad field."""
    if not isinstance(data.get("input"), str | list):
        raise invalid("input is required: a string, or a list of input items", "input")
    req = validated(ResponsesRequest, data)
    for name, why in _REFUSED_FIELDS.items():
        if data.get(name) not in (None, False):
            raise invalid(f"unsupported option {name}: {why}", name)
    fmt = (req.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        raise invalid("unsupported option text.format: structured output is not enforced by this server",
                      "text.format")
    if isinstance(req.input, str) and not req.input:
        raise invalid("input must not be empty", "input")
    if isinstance(req.input, list) and not req.input and req.previous_response_id is None:
        raise invalid("input must have at least one item", "input")
    return req


# ---------------------------------------------------------------------- tools
def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (`{type, name, description, parameters}`) as chat tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise invalid(f"tools[{i}]: tool type {kind!r} is not served; only function tools are", f"tools.{i}")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"tools[{i}]: a function tool needs a name", f"tools.{i}.name")
        # Key order as in a chat tool (name, description, parameters): the template prints it.
        fn: dict[str, Any] = {"name": name}
        if tool.get("description"):
            fn["description"] = tool["description"]
        fn["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`auto`/`none`/`required`, or `{type: function, name}` as the chat form."""
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise invalid(f"tool_choice {choice!r} is not one of auto, none, required", "tool_choice")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str) and choice["name"]:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("tool_choice must be auto, none, required or {'type': 'function', 'name': ...}", "tool_choice")


# ---------------------------------------------------------------------- input items
RESPONSES_PART_FIELDS: Mapping[str, str] = {
    **TEXT_PART_FIELDS, "summary_text": "text", "reasoning_text": "text", "refusal": "refusal"}
"""The Responses API's text-carrying parts and the key of each one's text (`clawbridge.chat.content`)."""


def _content_text(content: Any, i: int, *, key: str = "content", join: str = "") -> str:
    """Item `i`'s content (a string or a list of text parts) as text, by `clawbridge.chat.content`'s
    rules with this API's part types; a message's parts are pieces of one text, joined with `""`."""
    if content is None:
        raise invalid(f"input[{i}].{key} must be a string or a list of parts", f"input.{i}.{key}")
    for j, part in enumerate(content if isinstance(content, list) else []):
        if not isinstance(part, dict):  # the Responses API has no bare-string parts (chat completions does)
            raise invalid(f"input[{i}].{key}[{j}] must be an object", f"input.{i}.{key}.{j}")
    try:
        return content_text(content, f"input[{i}].{key}", fields=RESPONSES_PART_FIELDS, join=join)
    except ContentError as e:
        param = ".".join(str(x) for x in ("input", i, key, e.index, e.field) if x is not None)
        raise invalid(str(e), param) from e


class _Messages:
    """Chat messages built item by item; one pending assistant message gathers a sampled turn."""

    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []
        self._assistant: dict[str, Any] | None = None

    def flush(self) -> None:
        if self._assistant is not None:
            self.out.append(self._assistant)
            self._assistant = None

    def assistant(self, *, new_if: tuple[str, ...]) -> dict[str, Any]:
        """The pending assistant message; a fresh one if the pending one already has any of `new_if`."""
        if self._assistant is not None and any(self._assistant.get(k) for k in new_if):
            self.flush()
        if self._assistant is None:
            self._assistant = {"role": "assistant", "content": None}
        return self._assistant

    def add(self, message: dict[str, Any]) -> None:
        self.flush()
        self.out.append(message)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages for a request's `input` (instructions not included)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    msgs = _Messages()
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise invalid(f"input[{i}] must be an object", f"input.{i}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"input[{i}].role must be user, system, developer or assistant", f"input.{i}.role")
            text = _content_text(item.get("content"), i)
            if role == "assistant":
                pending = msgs.assistant(new_if=("content", "tool_calls"))
                pending["content"] = text
            else:
                msgs.add({"role": role, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise invalid(f"input[{i}].summary must be a list of parts", f"input.{i}.summary")
            text = _content_text(parts, i, join="\n\n")
            pending = msgs.assistant(new_if=("content", "tool_calls", "reasoning_content"))
            pending["reasoning_content"] = text
        elif kind == "function_call":
            name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "")
            if not isinstance(name, str) or not name or not isinstance(call_id, str) or not call_id:
                raise invalid(f"input[{i}]: a function_call needs name and call_id", f"input.{i}")
            if not isinstance(args, str):
                args = json.dumps(args)
            pending = msgs.assistant(new_if=())
            pending.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid(f"input[{i}]: a function_call_output needs call_id", f"input.{i}.call_id")
            msgs.add({"role": "tool", "tool_call_id": call_id, "content": _content_text(item.get("output", ""), i)})
        else:
            raise invalid(f"input[{i}]: item type {kind!r} is not served (message, reasoning, function_call, "
                          "function_call_output are)", f"input.{i}.type")
    msgs.flush()
    return msgs.out


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items as the chat messages they continue a conversation with."""
    return input_messages(output) if output else []


def chat_data(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request equivalent to `req` after `history` (from previous_response_id)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages += history
    if not (isinstance(req.input, list) and not req.input):
        messages += input_messages(req.input)
    data: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    tools = chat_tools(req.tools)
    if tools:
        data["tools"] = tools
    choice = chat_tool_choice(req.tool_choice)
    if choice is not None:
        data["tool_choice"] = choice
    if req.parallel_tool_calls is False:
        data["parallel_tool_calls"] = False
    for name, value in (("max_completion_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p)):
        if value is not None:
            data[name] = value
    return data
