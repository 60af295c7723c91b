"""Which session a model call belongs to.

Resolution order (first match wins):
1. `X-Session-Id` header (with `X-Turn-Type: main|side`, default main): source `header`.
2. A session key from `/rl/start_session` used as the bearer key: source `session_key`.
3. A URL prefix `/s/{session_id}/v1/...`: source `url`.
4. OpenClaw's `Runtime: ... session=<key>` line in the first user message: source `openclaw_runtime`.
5. Nothing: the call is its own one-turn session (source `implicit`), ended after the call.
Nothing is dropped: every call is recorded in some session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from clawbridge.openclaw.runtime_line import SESSION_ID_RE, parse_runtime_session, validate_session_headers
from clawbridge.proxy.auth import Principal
from clawbridge.proxy.errors import ApiError
from clawbridge.store import new_id

SESSION_HEADER = "x-session-id"
TURN_TYPE_HEADER = "x-turn-type"
TURN_ID_HEADER = "x-turn-id"
TURN_TRIGGER_HEADER = "x-turn-trigger"
SESSION_DONE_HEADER = "x-session-done"

@dataclass(frozen=True)
class CallSession:
    """The session a call is recorded in, and how the call relates to it."""

    session_id: str
    source: str
    turn_type: str
    end_after: str | None = None
    """'done_header' or 'single_call' when the session ends after this call."""
    meta: dict[str, Any] = field(default_factory=dict)


def check_session_id(value: str, what: str) -> str:
    if not SESSION_ID_RE.match(value):
        raise ApiError(
            400,
            f"invalid {what} {value[:80]!r}: use 1-256 characters from letters, digits and ._:@/+=-",
            code="invalid_session_id",
        )
    return value


def resolve_call_session(
    request: Request, principal: Principal, url_session: str | None, messages: list[dict[str, Any]]
) -> CallSession:
    h = request.headers
    problem = validate_session_headers(h.get(SESSION_HEADER), h.get(TURN_TYPE_HEADER))
    if problem is not None:
        raise ApiError(400, problem, code="invalid_session_headers")
    turn_type = (h.get(TURN_TYPE_HEADER) or "main").strip().lower()
    meta: dict[str, Any] = {}
    for name, key in ((TURN_ID_HEADER, "turn_id_header"), (TURN_TRIGGER_HEADER, "trigger")):
        if h.get(name):
            meta[key] = h[name][:256]
    done = (h.get(SESSION_DONE_HEADER) or "").strip().lower() in ("1", "true", "yes")
    end_after = "done_header" if done else None

    header_sid = h.get(SESSION_HEADER)
    if header_sid is not None:
        sid = header_sid.strip()
        if principal.kind == "session" and principal.session_id != sid:
            raise ApiError(403, "a session key can only record into its own session", code="session_mismatch")
        return CallSession(sid, "header", turn_type, end_after, meta)
    if principal.kind == "session" and principal.session_id:
        return CallSession(principal.session_id, "session_key", turn_type, end_after, meta)
    if url_session is not None:
        return CallSession(check_session_id(url_session, "session id in the URL"), "url", turn_type, end_after, meta)
    runtime = parse_runtime_session(messages)
    if runtime is not None:
        return CallSession(runtime, "openclaw_runtime", turn_type, end_after, meta)
    return CallSession(new_id("sess"), "implicit", turn_type, "single_call", meta)
