"""The session API (`/rl/*`), shaped like AReaL's online proxy.

- POST /rl/start_session {task_id?, api_key?} -> {session_id, api_key}   (admin key, or a user's: the session is theirs)
- POST /rl/end_session {session_id?} -> {session_id, ended, interaction_count}  (admin, the session's key, its user)
- POST /rl/set_reward {reward, interaction_id?, session_id?}            (admin, the session's key, its user)
  (with the admin key or a user's, the session may also be named by the `X-Session-Id` header the
  model calls named it by, on these and `/rl/set_session_reward`; a body `session_id` that differs is 400)
- GET  /rl/sessions?limit&offset&status, GET /rl/sessions/{id}     (admin: all; a user: their own; a
  session key: its own session by id)
- GET  /rl/status                                                   (admin; per-user counts under `users`,
  what serves and the promotion decisions under `promotion`: clawbridge.proxy.promotion_routes;
  every user's notes from talk and how their sessions met each under `notes`, None when notes are off)

Who may call which route on which session is `clawbridge.access`'s table, asked through
`clawbridge.proxy.ownership`: a user's key reaches only that user's sessions (another user's
session or interaction is 404, exactly as if it did not exist), a session key only its own.

AReaL compatibility:
- `interaction_id` may be the turn id or any id the client received for the call
  (`chatcmpl-...`, `msg_...`, `resp_...`).
- A session key (`api_key` of start_session) must be at least `MIN_SESSION_KEY_LEN` characters,
  not blank, without surrounding whitespace, and neither the client nor the admin key: else 400.
  Starting a session with the key of an active session refreshes it: the old session ends.
- A keyed session refreshed or ended without any reward gets `default_reward_value` on its last
  turn (setting `default_session_reward`; AReaL's "a default reward of 0 is assigned"), unless a
  judge is configured: `clawbridge.runtime.lifecycle`, the same rule on every path that ends a session.
- Fields these routes do not know (AReaL's `model` on set_reward, ...) are ignored, logged once
  per route and field; `group_size` above 1 is a 400 (one session per call here).

Invariant: a reward is accepted (200) only after it is committed.
"""

from __future__ import annotations

import logging
import math
import secrets
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from clawbridge.access import Action, Denied, Hidden, Principal, Resource, Scope, check, scope_of
from clawbridge.promotion.report import promotion_status
from clawbridge.proxy.call import turn_id_for
from clawbridge.proxy.errors import ApiError, validated
from clawbridge.proxy.ownership import caller, find_session, require, session_target
from clawbridge.proxy.request import parse_json_object, read_body
from clawbridge.proxy.sessions import SESSION_HEADER
from clawbridge.proxy.state import ProxyState
from clawbridge.runtime.keys import keys_equal
from clawbridge.serving.sampler import engine_status
from clawbridge.store import StoreError
from clawbridge.store.deletions import OwedDeletionStore
from clawbridge.store.owners import SessionOwnerError
from clawbridge.store.users import UserStore

log = logging.getLogger("clawbridge.proxy")

MIN_SESSION_KEY_LEN = 16
_ignored_logged: set[tuple[str, str]] = set()

MAX_OFFSET = 2**62
"""Far past any real store, and inside SQLite's 64-bit integers (a larger offset overflowed: 500)."""


class StartSession(BaseModel):
    model_config = ConfigDict(extra="ignore")
    task_id: str | None = None
    api_key: str | None = None
    group_size: int | None = None


class EndSession(BaseModel):
    model_config = ConfigDict(extra="ignore")
    session_id: str | None = None


class SetReward(BaseModel):
    model_config = ConfigDict(extra="ignore")
    reward: float
    interaction_id: str | None = None
    session_id: str | None = None


def _validate(model: type[BaseModel], data: dict[str, Any], route: str = "") -> Any:
    for name in sorted(set(data) - set(model.model_fields)):
        if (route, name) not in _ignored_logged:
            _ignored_logged.add((route, name))
            log.info("ignoring field %r in %s requests (not used by clawbridge; logged once)", name[:64], route)
    return validated(model, data)


async def _target_session(state: ProxyState, principal: Principal, asked: str | None, resource: Resource,
                          action: Action) -> str:
    """The stored id of the session a management call names (a session key's own when it names
    none) on which the caller may do `action`; 404 as for an unknown session otherwise."""
    if asked is None and principal.kind == "session":
        asked = principal.session_id
    if not asked:
        raise ApiError(400, f"session_id (in the body, or an X-Session-Id header) is required with the "
                       f"{principal.kind} key", param="session_id")
    return await find_session(state, principal, asked, resource, action)


def _named_session(request: Request, principal: Principal, body_sid: str | None) -> str | None:
    """The session a call names: the body's `session_id`, else (not with a session key, whose
    session is its own) the `X-Session-Id` header, as the model calls named the session."""
    if principal.kind == "session":
        return body_sid
    header = (request.headers.get(SESSION_HEADER) or "").strip() or None
    if body_sid and header and body_sid != header:
        raise ApiError(400, f"the body's session_id {body_sid!r} and X-Session-Id {header!r} differ; send one",
                       param="session_id")
    return body_sid or header


def _check_session_key(key: str, state: ProxyState) -> None:
    """400 unless `key` can be a session key (see the module docstring)."""
    def bad(why: str) -> ApiError:
        return ApiError(400, f"api_key {why}", param="api_key", code="invalid_session_key")

    if not key.strip():
        raise bad("is blank")
    if key != key.strip():
        raise bad("has leading or trailing whitespace (an HTTP header would drop it, so no call could use it)")
    if len(key) < MIN_SESSION_KEY_LEN:
        raise bad(f"must be at least {MIN_SESSION_KEY_LEN} characters")
    if keys_equal(key, state.keys.admin) or keys_equal(key, state.keys.client):
        raise bad("is the server's client or admin key; a session key must differ from both "
                  "(omit api_key to get a new one)")


def build_rl_router(state: ProxyState) -> APIRouter:
    router = APIRouter(prefix="/rl")

    async def body_of(request: Request) -> dict[str, Any]:
        return parse_json_object(await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s))

    @router.post("/start_session")
    async def start_session(request: Request) -> dict[str, Any]:
        principal = await caller(state, request, "sessions", "start")
        req = _validate(StartSession, await body_of(request), "/rl/start_session")
        # --- trainer capacity mode (owned by clawbridge/trainer): new sessions only, never model calls
        if state.trainer is not None:
            over, retry_after = await state.read(state.trainer.backlog_exceeded)
            if over:
                raise ApiError(429, "the training backlog is full; start the session later", code="training_backlog",
                               headers={"Retry-After": str(math.ceil(retry_after))})
        # --- end trainer capacity mode
        if req.group_size is not None and req.group_size != 1:
            raise ApiError(400, "group_size: clawbridge starts one session per call; call start_session once per "
                           "sample with the same task_id (sessions sharing a task_id form the baseline group)",
                           param="group_size")
        key = req.api_key or f"cbs-{secrets.token_urlsafe(24)}"
        _check_session_key(key, state)
        if await state.read(UserStore(state.store).user_for_key, key) is not None:
            raise ApiError(400, "api_key is a user's key; a session key must differ from every user's key "
                           "(omit api_key to get a new one)", param="api_key", code="invalid_session_key")
        in_use = ApiError(400, "api_key is in use by another session; omit api_key to get a new one",
                          param="api_key", code="invalid_session_key")
        replaced = await state.read(state.store.session_for_key, key)
        target = await session_target(state, replaced) if replaced is not None else None
        if target is not None:  # starting on its key ends it and moves the key: the caller must own it
            try:
                check(principal, "sessions", "record", target)
            except (Denied, Hidden):
                raise in_use from None
        try:
            session_id = await state.writer.call(state.sessions.start_keyed, key, req.task_id, principal.owner)
        except SessionOwnerError:
            raise in_use from None
        if replaced is not None:
            log.info("session %s refreshed: key now records into %s", replaced, session_id)
        return {"session_id": session_id, "api_key": key}

    @router.post("/end_session")
    async def end_session(request: Request) -> dict[str, Any]:
        principal = await caller(state, request, "sessions", "end")
        req = _validate(EndSession, await body_of(request), "/rl/end_session")
        sid = await _target_session(state, principal, _named_session(request, principal, req.session_id),
                                    "sessions", "end")
        ended = await state.end_session(sid)
        session = await state.read(state.store.get_session, sid)
        count = session.turn_count if session is not None else 0
        return {"message": "success", "session_id": sid, "ended": ended, "interaction_count": count}

    @router.post("/set_reward")
    async def set_reward(request: Request) -> dict[str, Any]:
        principal = await caller(state, request, "rewards", "write")
        req = _validate(SetReward, await body_of(request), "/rl/set_reward")
        if not math.isfinite(req.reward):
            raise ApiError(422, "reward must be a finite number", param="reward")
        turn_id = turn_id_for(req.interaction_id) if req.interaction_id is not None else None
        if turn_id is not None:
            def unknown() -> ApiError:
                return ApiError(404, f"unknown interaction {req.interaction_id!r}", code="interaction_not_found")

            in_session = await state.read(state.store.turn_session, turn_id)
            target = await session_target(state, in_session) if in_session is not None else None
            if target is None:
                raise unknown()
            require(principal, "rewards", "write", target, unknown)
            named = _named_session(request, principal, req.session_id)
            sid = in_session if named is None else await _target_session(state, principal, named, "rewards", "write")
            if sid != in_session:
                raise ApiError(400, f"interaction {turn_id!r} is not in session {sid!r}")
        else:
            sid = await _target_session(state, principal, _named_session(request, principal, req.session_id),
                                        "rewards", "write")
            turn_id = await state.read(state.store.last_turn_id, sid)
            if turn_id is None:
                raise ApiError(400, f"session {sid!r} has no answered turn to reward yet")
        try:
            reward_id = await state.writer.call(state.store.add_reward, sid, req.reward, "api", turn_id)
        except StoreError as exc:
            raise ApiError(404, str(exc)) from None
        return {"reward_id": reward_id, "session_id": sid, "interaction_id": turn_id, "reward": req.reward}

    @router.post("/set_session_reward")
    async def set_session_reward(request: Request) -> dict[str, Any]:
        """A reward for the whole session (spread over its turns by the trainer)."""
        principal = await caller(state, request, "rewards", "write")
        req = _validate(SetReward, await body_of(request))
        if not math.isfinite(req.reward):
            raise ApiError(422, "reward must be a finite number", param="reward")
        sid = await _target_session(state, principal, _named_session(request, principal, req.session_id),
                                    "rewards", "write")
        try:
            reward_id = await state.writer.call(state.store.add_reward, sid, req.reward, "api", None)
        except StoreError as exc:
            raise ApiError(404, str(exc)) from None
        return {"reward_id": reward_id, "session_id": sid, "interaction_id": None, "reward": req.reward}

    @router.get("/sessions")
    async def list_sessions(request: Request, limit: int = 50, offset: int = 0,
                            status: str | None = None) -> dict[str, Any]:
        principal = await caller(state, request, "sessions", "list")
        if not 1 <= limit <= 1000:
            raise ApiError(422, "limit must be 1..1000", param="limit")
        if not 0 <= offset <= MAX_OFFSET:
            raise ApiError(422, f"offset must be 0..{MAX_OFFSET}", param="offset")
        every = scope_of(principal, "sessions", "list") is Scope.ANY  # else its own (the table's OWN)
        rows = await state.read(state.store.list_sessions, limit, offset, status, None if every else principal.owner)
        return {"sessions": [r.__dict__ for r in rows]}

    @router.get("/sessions/{session_id}")
    async def get_session(request: Request, session_id: str) -> dict[str, Any]:
        principal = await caller(state, request, "sessions", "read")
        session_id = await _target_session(state, principal, session_id, "sessions", "read")
        view = await state.read(state.store.session_view, session_id)
        if view is None:
            raise ApiError(404, f"unknown session {session_id!r}", code="session_not_found")
        return view

    @router.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        await caller(state, request, "status", "read")
        trainer, judge = state.trainer, state.judge
        return {"model": state.model_info.name, "backend": state.backend.name,
                "policy_version": state.sampler.policy_version, "store": await state.read(state.store.stats),
                "users": await state.read(UserStore(state.store).stats),
                "trainer": await state.read(trainer.status) if trainer is not None else None,
                "lanes": await state.read(state.lanes.status) if state.lanes is not None else None,
                "judge": await state.read(judge.status) if judge is not None else None,
                "privacy": state.privacy.status() if state.privacy is not None else None,
                "promotion": await state.read(promotion_status, state.promotion) if state.promotion is not None else None,
                "notes": await state.read(state.notes.status) if state.notes is not None else None,
                "remote_deletions": await state.read(OwedDeletionStore(state.store).status),
                "engine": engine_status(state.backend.sampler())}

    return router
