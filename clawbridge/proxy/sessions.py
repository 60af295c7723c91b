"""Which session a model call belongs to.

Resolution order (first match wins):
1. `X-Session-Id` header: source `header`. An empty header counts as absent (OpenClaw-RL's
   extension sends `X-Session-Id: ""` when it has no session).
2. `session_id` in the request body (OpenClaw-RL's servers read it there too): source `body`.
3. A session key from `/rl/start_session` used as the bearer key: source `session_key`.
4. A URL prefix `/s/{session_id}/v1/...` (source `url`) or Claw-R1's
   `/{trajectory_uid}/{prompt_uid}/v1/...` (source `trajectory`).
5. OpenClaw's `Runtime: ... session=<key>` line in the first user message: source `openclaw_runtime`.
(A session key with a different session in the header, body or URL is 403, never re-routed.)
A caller with a user key (`Principal.user`) records into `user:id` for an id it named (1, 2, 4, 5):
two users' agents may both name their session `main` (`clawbridge.access.scoped_session_id`).
Whether the caller may record into the session is `clawbridge.access`'s table (`ownership.check_recordable`).
6. Nothing: the call is its own one-turn session (source `implicit`), ended after the call.
Nothing is dropped: every call is recorded in some session.

Turn type: `X-Turn-Type`, else the body's `turn_type`, else `main` (OpenClaw-RL's own servers
default to `side`; clawbridge trains on calls that say nothing, so its default is `main`).
The session ends after the call when `X-Session-Done` or the body's `session_done` is one of
1/true/yes/on. The body fields are removed (`pop_session_fields`) before the request is rendered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from clawbridge.access import OPERATOR, Principal, Target, check, scoped_session_id
from clawbridge.openclaw.runtime_line import SESSION_ID_RE, parse_runtime_session, validate_session_headers
from clawbridge.proxy.errors import ApiError
from clawbridge.store import new_id

SESSION_HEADER = "x-session-id"
TURN_TYPE_HEADER = "x-turn-type"
TURN_ID_HEADER = "x-turn-id"
TURN_TRIGGER_HEADER = "x-turn-trigger"
SESSION_DONE_HEADER = "x-session-done"
BODY_SESSION_FIELDS = ("session_id", "turn_type", "session_done")
"""OpenClaw-RL's non-standard request-body fields, honoured and stripped before rendering."""
TRUTHY = ("1", "true", "yes", "on")

@dataclass(frozen=True)
class CallSession:
    """The session a call is recorded in, and how the call relates to it."""

    session_id: str
    source: str
    turn_type: str
    end_after: str | None = None
    """'done_header' or 'single_call' when the session ends after this call."""
    meta: dict[str, Any] = field(default_factory=dict)
    principal: Principal = OPERATOR
    """Who calls: which versions it may name (`clawbridge.access`), and whose own adapter answers
    it with per-user adapters (`clawbridge.trainer.lanes`)."""

    @property
    def user(self) -> str | None:
        """The owner of the turn: the caller's user (a session key's: its session's user); the
        session is created as theirs and the store takes the turn only into a session of theirs."""
        return self.principal.owner


def check_session_id(value: str, what: str) -> str:
    if not SESSION_ID_RE.match(value):
        raise ApiError(
            400,
            f"invalid {what} {value[:80]!r}: use 1-256 characters from letters, digits and ._:@/+=-",
            code="invalid_session_id",
        )
    return value


def pop_session_fields(body: dict[str, Any]) -> dict[str, Any]:
    """Remove OpenClaw-RL's `session_id`, `turn_type`, `session_done` from `body`; return them."""
    return {name: body.pop(name) for name in BODY_SESSION_FIELDS if name in body}


def _present(value: str | None) -> str | None:
    """A header or body value, None when absent or blank."""
    return value if value is not None and value.strip() != "" else None


def _body_str(fields: dict[str, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"body field {name} must be a string", param=name, code="invalid_session_fields")
    return _present(value)


def resolve_call_session(
    request: Request, principal: Principal, url_session: str | None, messages: list[dict[str, Any]],
    body_fields: dict[str, Any] | None = None, url_source: str = "url",
) -> CallSession:
    """The session of one model call; `body_fields` are what `pop_session_fields` took out."""
    h = request.headers
    fields = body_fields or {}
    header_sid = _present(h.get(SESSION_HEADER))
    header_turn = _present(h.get(TURN_TYPE_HEADER))
    problem = validate_session_headers(header_sid, header_turn)
    if problem is not None:
        raise ApiError(400, problem, code="invalid_session_headers")
    body_turn = _body_str(fields, "turn_type")
    if header_turn is None and body_turn is not None:
        problem = validate_session_headers(None, body_turn)
        if problem is not None:
            raise ApiError(400, problem.replace("X-Turn-Type", "body field turn_type"), param="turn_type",
                           code="invalid_session_fields")
    turn_type = (header_turn or body_turn or "main").strip().lower()
    meta: dict[str, Any] = {}
    for name, key in ((TURN_ID_HEADER, "turn_id_header"), (TURN_TRIGGER_HEADER, "trigger")):
        if h.get(name):
            meta[key] = h[name][:256]
    body_done = fields.get("session_done")
    done = ((h.get(SESSION_DONE_HEADER) or "").strip().lower() in TRUTHY
            or (body_done is not None and str(body_done).strip().lower() in TRUTHY))
    end_after = "done_header" if done else None

    scope = principal.user if principal.kind == "user" else None
    body_sid = _body_str(fields, "session_id")
    for sid, source, what in ((header_sid, "header", None), (body_sid, "body", "body field session_id")):
        if sid is None:
            continue
        sid = check_session_id(sid.strip(), what) if what else sid.strip()
        _own_session(principal, sid)
        return CallSession(scoped_session_id(scope, sid), source, turn_type, end_after, meta, principal)
    if principal.kind == "session" and principal.session_id:
        if url_session is not None:
            _own_session(principal, url_session)
        return CallSession(principal.session_id, "session_key", turn_type, end_after, meta, principal)
    if url_session is not None:
        sid = check_session_id(url_session, "session id in the URL")
        return CallSession(scoped_session_id(scope, sid), url_source, turn_type, end_after, meta, principal)
    runtime = parse_runtime_session(messages)
    if runtime is not None:
        return CallSession(scoped_session_id(scope, runtime), "openclaw_runtime", turn_type, end_after, meta, principal)
    return CallSession(new_id("sess"), "implicit", turn_type, "single_call", meta, principal)


def _own_session(principal: Principal, session_id: str) -> None:
    """A session key names only its own session (403 otherwise, decided before anything is read)."""
    if principal.kind == "session":
        check(principal, "sessions", "record", Target(principal.owner, session_id))
