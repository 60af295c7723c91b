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

A wire adapter whose API has more text-carrying parts passes its own `fields` (part type -> the
key holding its text) and joiner: the Responses API reader accepts `summary_text`,
`reasoning_text` and `refusal` parts (text under `refusal`) and joins a message's parts with `""`
(they are pieces of one sampled text), by these same functions.

Invariants:
- `content_text` raises `ContentError` (a `ValueError` whose message names `where` and is fit for
  an HTTP 400 body) on anything else: a non-text part (image, audio, file), a part that is not an
  object, a text part without a string `text`, content of another type.
- `loose_text` never raises: it reads the same parts and skips what is not text (a nested
  `content` of a part, as in an Anthropic `tool_result`, is read the same way); other content
  types come out as their JSON. It is for recorded data and headers, never for validation.
- Both read parts by one function (`_texts`, judging each part by `part_error`), so the rule set
  is written once. A `ContentError` about one part carries its `index` (and the missing `field`),
  so an adapter can point an error's `param` at it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["TEXT_PART_FIELDS", "TEXT_PART_TYPES", "ContentError", "content_text", "loose_text", "part_error"]

TEXT_PART_FIELDS: Mapping[str, str] = {"text": "text", "input_text": "text", "output_text": "text"}
"""Content part types that carry text, each with the key holding its text (module docstring)."""

TEXT_PART_TYPES: frozenset[str] = frozenset(TEXT_PART_FIELDS)
"""Content part types that carry text (see the module docstring); every other type is refused."""


class ContentError(ValueError):
    """Content that is not text by the module's rules; the message names where it is.

    `index` is the offending part's place in the content list (None when the content as a whole
    is wrong) and `field` the text key that part lacks (None when its type or shape is wrong)."""

    def __init__(self, message: str, index: int | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.index = index
        self.field = field


def part_error(part: Any, where: str, fields: Mapping[str, str] = TEXT_PART_FIELDS) -> str | None:
    """Why `part` (one item of a content list) is not a text part, or None when it is."""
    if isinstance(part, str):
        return None
    if not isinstance(part, Mapping):
        return f"{where}: content parts must be objects"
    ptype = part.get("type")
    if not isinstance(ptype, str) or ptype not in fields:
        return f"{where}: content part type {ptype!r} is not supported (text only)"
    if not isinstance(part.get(fields[ptype]), str):
        return f"{where}: {ptype} content part without a string {fields[ptype]!r}"
    return None


def _texts(content: list[Any], where: str, *, strict: bool, fields: Mapping[str, str] = TEXT_PART_FIELDS) -> list[str]:
    """The texts of a content list's parts: a part that is not text raises `ContentError` when
    `strict`, else is skipped (its nested `content` read loosely, as in an Anthropic tool_result)."""
    texts: list[str] = []
    for i, part in enumerate(content):
        err = part_error(part, where, fields)
        if err is None:
            texts.append(part if isinstance(part, str) else str(part[fields[part["type"]]]))
        elif strict:
            missing = part.get("type") in fields if isinstance(part, Mapping) else False
            raise ContentError(err, index=i, field=fields[part["type"]] if missing else None)
        elif isinstance(part, Mapping) and "content" in part:
            texts.append(loose_text(part.get("content")))
    return texts


def content_text(content: Any, where: str = "content", *, fields: Mapping[str, str] = TEXT_PART_FIELDS,
                 join: str = "\n") -> str:
    """`content` as one string; raises `ContentError` on what is not text (module rules).

    `fields` and `join` are a wire adapter's own part types and joiner (module docstring)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return join.join(_texts(content, where, strict=True, fields=fields))
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
