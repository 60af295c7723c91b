"""One chat message, parsed once: the typed form every API's request becomes and the renderer takes.

Each API adapter converts its wire shape (chat completions, Anthropic Messages, Responses) into
OpenAI-shaped message objects; those are parsed exactly once, into `ChatMessage`s, when the
request is validated (`clawbridge.proxy.request.ChatRequest.messages`), and the renderer takes the
parsed messages as they are. Callers that hold plain message objects (recorded turns, eval sets,
on-policy distillation, tests) have them parsed by the same rules through `parse_messages`.

What a `ChatMessage` accepts (one rule set):
- `role`: one of `ROLES`;
- `content`: text by `clawbridge.chat.content.content_text` (null -> "", text parts joined with
  "\\n"); a `tool` message must have content;
- assistant only: `reasoning_content` (a string), `tool_calls` (a list of objects with a function
  name; arguments that are a JSON object in a string become that object, other strings stay as
  they are, null or "" become {});
- `name` and `tool_call_id` when they are strings; every other key is dropped.

Invariants:
- Parsing never mutates its input; a `ChatMessage` is frozen and already normalized, so passing
  one through validation again returns it unchanged.
- A message that breaks a rule fails validation with a message naming the field: inside a request
  model that is a pydantic `ValidationError` at `messages.<i>` (the proxy's 422); `parse_messages`
  raises `RenderError` naming `messages[<i>]` (the renderer's 400).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

from clawbridge.chat.content import ContentError, content_text

__all__ = ["ROLES", "ChatMessage", "Messages", "RenderError", "Role", "parse_messages"]


class RenderError(ValueError):
    """The request cannot be rendered (bad messages, tools or template failure): HTTP 400.
    Defined here, below the chat formats (`clawbridge.chat.chatformat` re-exports it), because parsing
    a message is the first thing that can fail."""


Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: frozenset[str] = frozenset(get_args(Role))
"""Message roles a request may use."""

_WIRE_CONTENT = WithJsonSchema({
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "object"}]}},
        {"type": "null"},
    ],
    "description": "text, or a list of text parts ({'type': 'text', 'text': ...}); parsed to one string",
})


class ChatMessage(BaseModel):
    """One OpenAI-shaped chat message, validated and normalized (module rules)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    role: Role
    content: Annotated[str, _WIRE_CONTENT] = ""
    """The text of the message's content."""
    reasoning_content: str | None = None
    """An assistant's reasoning text, when it sent one."""
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant's calls: {"type": "function", "function": {"name", "arguments"}, "id"?}."""
    name: str | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, raw: Any) -> Any:
        if isinstance(raw, ChatMessage):
            return raw
        try:
            return _normalized(raw)
        except ValueError as exc:
            raise PydanticCustomError("invalid_message", "{reason}", {"reason": str(exc)}) from None

    def template_dict(self, *, developer_as_system: bool) -> dict[str, Any]:
        """The message as a chat template reads it; `developer` becomes `system` when asked."""
        role = "system" if developer_as_system and self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _normalized(raw: Any) -> dict[str, Any]:
    """The fields of a `ChatMessage` from a message object (module rules), or a `ValueError`."""
    if not isinstance(raw, Mapping):
        raise ValueError("each message must be an object")
    role = raw.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ValueError(f"unknown role {role!r} (expected one of {', '.join(sorted(ROLES))})")
    if role == "tool" and raw.get("content") is None:
        raise ValueError("a tool message needs 'content'")
    try:
        out: dict[str, Any] = {"role": role, "content": content_text(raw.get("content"), "content")}
    except ContentError as exc:
        raise ValueError(str(exc)) from None
    if role == "assistant":
        reasoning = raw.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ValueError("'reasoning_content' must be a string")
            out["reasoning_content"] = reasoning
        calls = raw.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise ValueError("'tool_calls' must be a list")
            out["tool_calls"] = [_tool_call(c, f"tool_calls[{j}]") for j, c in enumerate(calls)]
    for key in ("name", "tool_call_id"):
        if isinstance(raw.get(key), str):
            out[key] = raw[key]
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise ValueError(f"{where}: each tool call must be an object")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping):
        raise ValueError(f"{where}: tool call 'function' must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: tool call without a function name")
    args: Any = fn.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            args = parsed
    elif not isinstance(args, Mapping):
        raise ValueError(f"{where}: tool call arguments must be a JSON string or an object")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


Messages = Sequence[ChatMessage] | Sequence[Mapping[str, Any]]
"""What a renderer takes: parsed messages (used as they are), or plain message objects (parsed)."""


def parse_messages(messages: Any) -> list[ChatMessage]:
    """`messages` (a list of message objects, or of `ChatMessage`s) parsed by the module's rules;
    `RenderError` naming `messages[<i>]` when one breaks them."""
    if not isinstance(messages, list | tuple) or not messages:
        raise RenderError("'messages' must be a non-empty list")
    out: list[ChatMessage] = []
    for i, msg in enumerate(messages):
        if isinstance(msg, ChatMessage):
            out.append(msg)
            continue
        if not isinstance(msg, Mapping):
            raise RenderError(f"messages[{i}] must be an object")
        try:
            out.append(ChatMessage.model_validate(msg))
        except ValidationError as exc:
            errors = exc.errors()
            reason = str(errors[0].get("msg", "invalid")) if errors else "invalid"
            raise RenderError(f"messages[{i}]: {reason}") from None
    return out
