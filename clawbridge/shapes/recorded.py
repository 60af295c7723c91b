"""The OpenAI-shaped view of a request as the store recorded it, whatever API it came in by.

Invariants:
- `api == "anthropic"`: the request is validated and converted by `clawbridge.shapes.anthropic`
  (so a `tool_result` block is a `tool` message, a `tool_use` a tool call); a request that does
  not convert gives an empty view (no messages, no tools), never an exception.
- Any other api: `messages` are the request's message objects (others skipped), `tools` its list
  of tools when it has one, `tool_choice` as recorded.
- The recorded request is never mutated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clawbridge.shapes.anthropic import openai_data, validate_messages_request


@dataclass(frozen=True)
class OpenAIView:
    """Messages, tools and tool_choice of a recorded request, in OpenAI shape."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None


def openai_view(request: Mapping[str, Any], api: str) -> OpenAIView:
    """The recorded `request` (sent to API `api`) in OpenAI shape (module invariants)."""
    if api == "anthropic":
        try:
            data = openai_data(validate_messages_request(dict(request), need_max_tokens=False))
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
