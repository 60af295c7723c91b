"""OpenClaw session identity on the wire: the `Runtime:` line and the session headers.

Invariants:
- OpenClaw (2026.9.x) appends a line to the first user message of a session's transcript:
  `Runtime: agent=main | session=agent:main:explicit:s1 | sessionId=s1 | host=... | model=...`
  (observed from a real `openclaw agent --local --session-id s1` turn). Only the *first* user
  message carries it; later user messages do not. `session=` is the session key, the same value
  the extension sends as `X-Session-Id`.
- A session id accepted here is 1-256 characters from letters, digits and `._:@/+=-` (the
  characters OpenClaw session keys use); the same rule as `clawbridge.proxy.sessions`.
- Validation never raises: it returns a message for a 400 body, or None.
"""

from __future__ import annotations

import re
from typing import Any

from clawbridge.chat.content import loose_text

MAX_SESSION_ID_LEN = 256
TURN_TYPES = ("main", "side")

SESSION_ID_RE = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,256}$")
_RUNTIME_RE = re.compile(r"(?m)^Runtime:[^\n]*?(?:^|[\s|])session=([^\s|]+)")


def parse_runtime_session(messages: list[dict[str, Any]]) -> str | None:
    """The session key from the `Runtime: ... session=<key> | sessionId=<id>` line of the first
    user message, or None when that message has no such line (or the key is malformed)."""
    for message in messages:
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        match = _RUNTIME_RE.search(loose_text(message.get("content")))
        if match is None:
            return None
        key = match.group(1)
        return key if SESSION_ID_RE.match(key) else None
    return None


def validate_session_headers(session_id: str | None, turn_type: str | None) -> str | None:
    """An error message for session headers of the wrong form, or None when they are fine.

    `session_id` is the raw `X-Session-Id` value and `turn_type` the raw `X-Turn-Type` value;
    None means the header was absent (which is allowed for both).
    """
    if session_id is not None:
        if session_id.strip() == "":
            return "X-Session-Id is empty"
        if len(session_id) > MAX_SESSION_ID_LEN:
            return f"X-Session-Id is {len(session_id)} characters long; the limit is {MAX_SESSION_ID_LEN}"
        if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in session_id):
            return "X-Session-Id contains control characters"
        if not SESSION_ID_RE.match(session_id.strip()):
            return f"X-Session-Id {session_id[:80]!r} has characters outside letters, digits and ._:@/+=-"
    if turn_type is not None and turn_type.strip().lower() not in TURN_TYPES:
        return f"X-Turn-Type {turn_type[:40]!r} is not one of: main, side"
    return None
