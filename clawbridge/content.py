"""Message content -> text: the one rule set every reader of an OpenAI-shaped message uses.

The renderer (prompt ids), the chat completions validator (400 on what is not served), the
reward judge and dashboard (recorded turns) and the OpenClaw `Runtime:` line reader all turn a
message's `content` into text here, so they agree on what counts as text.

Accepted content (OpenAI chat shape, after any API adapter has converted its own wire shape):
- `None` -> `""`; a string -> itself;
- a list of parts, joined with `"\\n"`, where each part is a string (as is) or an object whose
  `type` is one of `TEXT_PART_TYPES` with a string `text`:
  - `"text"`: chat completions and Anthropic text parts;
  - `"input_text"` / `"output_text"`: the Responses API's user and assistant text parts.

Invariants:
- `content_text` raises `ContentError` (a `ValueError` whose message names `where` and is fit for
  an HTTP 400 body) on anything else: a non-text part (image, audio, file), a part that is not an
  object, a text part without a string `text`, content of another type.
- `loose_text` never raises: it reads the same parts and skips what is not text (a nested
  `content` of a part, as in an Anthropic `tool_result`, is read the same way); other content
  types come out as their JSON. It is for recorded data and headers, never for validation.
- Both read parts by one function (`_texts`, judging each part by `part_error`), so the rule set
  is written once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["TEXT_PART_TYPES", "ContentError", "content_text", "loose_text", "part_error"]

TEXT_PART_TYPES: frozenset[str] = frozenset({"text", "input_text", "output_text"})
"""Content part types that carry text (see the module docstring); every other type is refused."""


class ContentError(ValueError):
    """Content that is not text by the module's rules; the message names where it is."""


def part_error(part: Any, where: str) -> str | None:
    """Why `part` (one item of a content list) is not a text part, or None when it is."""
    if isinstance(part, str):
        return None
    if not isinstance(part, Mapping):
        return f"{where}: content parts must be objects"
    ptype = part.get("type")
    if ptype not in TEXT_PART_TYPES:
        return f"{where}: content part type {ptype!r} is not supported (text only)"
    if not isinstance(part.get("text"), str):
        return f"{where}: text content part without a string 'text'"
    return None


def _texts(content: list[Any], where: str, *, strict: bool) -> list[str]:
    """The texts of a content list's parts: a part that is not text raises `ContentError` when
    `strict`, else is skipped (its nested `content` read loosely, as in an Anthropic tool_result)."""
    texts: list[str] = []
    for part in content:
        err = part_error(part, where)
        if err is None:
            texts.append(part if isinstance(part, str) else str(part["text"]))
        elif strict:
            raise ContentError(err)
        elif isinstance(part, Mapping) and "content" in part:
            texts.append(loose_text(part.get("content")))
    return texts


def content_text(content: Any, where: str = "content") -> str:
    """`content` as one string; raises `ContentError` on what is not text (module rules)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(_texts(content, where, strict=True))
    raise ContentError(f"{where}: content must be a string, null or a list of text parts")


def loose_text(content: Any) -> str:
    """`content` as one string, skipping what is not text; never raises (module rules)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(_texts(content, "content", strict=False))
    try:
        return json.dumps(content)
    except (TypeError, ValueError):
        return str(content)
