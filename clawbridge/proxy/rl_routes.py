"""The session API (`/rl/*`), shaped like AReaL's online proxy.

- POST /rl/start_session {task_id?, api_key?} -> {session_id, api_key}   (admin key, or a user's: the session is theirs)
- POST /rl/end_session {session_id?} -> {session_id, ended, interaction_count}  (admin, the session's key, its user)
- POST /rl/set_reward {reward, interaction_id?, session_id?}            (admin, the session's key, its user)
- GET  /rl/sessions?limit&offset&status, GET /rl/sessions/{id}     (admin: all; a user: their own)
- GET  /rl/status                                                   (admin; per-user counts under `users`,
  what serves and the promotion decisions under `promotion`: clawbridge.proxy.promotion_routes;
  every user's notes from talk and how their sessions met each under `notes`, None when notes are off)

A user's key (`clawbridge.proxy.user_routes`) reaches only that user's sessions; another user's
session or interaction is 404, exactly as if it did not exist (`clawbridge.proxy.ownership`).

AReaL compatibility:
- `interaction_id` may be the turn id or any id the client received for the call
  (`chatcmpl-...`, `msg_...`, `resp_...`).
- A session key (`api_key` of start_session) must be at least `MIN_SESSION_KEY_LEN` characters,
  not blank, without surrounding whitespace, and neither the client nor the admin key: else 400.
  Starting a session with the key of an active session refreshes it: the old session ends.
- A keyed session refreshed or ended without any reward gets `default_reward_value` on its last
  turn (setting `default_session_reward`; AReaL's "a default reward of 0 is assigned"), unless a
  judge is configured: `clawbridge.lifecycle`, the same rule on every path that ends a session.
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

from clawbridge.keys import keys_equal
from clawbridge.proxy.auth import Principal, authenticate, require_admin
from clawbridge.proxy.call import turn_id_for
from clawbridge.proxy.errors import ApiError, validated
from clawbridge.proxy.ownership import find_session, visible
from clawbridge.proxy.request import parse_json_object, read_body
from clawbridge.proxy.state import ProxyState
from clawbridge.sampler import engine_status
from clawbridge.store import StoreError
from clawbridge.store.deletions import OwedDeletionStore
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


def _is_user(principal: Principal) -> bool:
    """A user's key (or the client key naming a user with a trusted X-User-Id)."""
    return principal.kind != "session" and principal.user is not None


async def _target_session(state: ProxyState, principal: Principal, asked: str | None) -> str:
    if principal.kind == "session":
        if asked is not None and asked != principal.session_id:
            raise ApiError(403, "a session key can only manage its own session", code="session_mismatch")
        assert principal.session_id is not None
        return principal.session_id
    if not _is_user(principal):
        require_admin(principal)
    if not asked:
        raise ApiError(400, f"session_id is required with the {principal.kind} key", param="session_id")
    return asked if principal.kind == "admin" else await find_session(state, principal, asked)


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
        principal = await authenticate(request, state.keys, state.store)
        if not _is_user(principal):
            require_admin(principal)
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
        replaced = await state.read(state.store.session_for_key, key)
        if replaced is not None and not await visible(state, principal, replaced):
            raise ApiError(400, "api_key is in use by another session; omit api_key to get a new one",
                           param="api_key", code="invalid_session_key")
        session_id = await state.writer.call(state.sessions.start_keyed, key, req.task_id, principal.user)
        if replaced is not None:
            log.info("session %s refreshed: key now records into %s", replaced, session_id)
        return {"session_id": session_id, "api_key": key}

    @router.post("/end_session")
    async def end_session(request: Request) -> dict[str, Any]:
        principal = await authenticate(request, state.keys, state.store)
        req = _validate(EndSession, await body_of(request), "/rl/end_session")
        sid = await _target_session(state, principal, req.session_id)
        if await state.read(state.store.get_session, sid) is None:
            raise ApiError(404, f"unknown session {sid!r}", code="session_not_found")
        ended = await state.end_session(sid)
        session = await state.read(state.store.get_session, sid)
        count = session.turn_count if session is not None else 0
        return {"message": "success", "session_id": sid, "ended": ended, "interaction_count": count}

    @router.post("/set_reward")
    async def set_reward(request: Request) -> dict[str, Any]:
        principal = await authenticate(request, state.keys, state.store)
        req = _validate(SetReward, await body_of(request), "/rl/set_reward")
        if not math.isfinite(req.reward):
            raise ApiError(422, "reward must be a finite number", param="reward")
        turn_id = turn_id_for(req.interaction_id) if req.interaction_id is not None else None
        if turn_id is not None:
            owner = await state.read(state.store.turn_session, turn_id)
            if owner is None or (_is_user(principal) and not await visible(state, principal, owner)):
                raise ApiError(404, f"unknown interaction {req.interaction_id!r}", code="interaction_not_found")
            sid = await _target_session(state, principal, req.session_id or owner)
            if sid != owner:
                raise ApiError(400, f"interaction {turn_id!r} is not in session {sid!r}")
        else:
            sid = await _target_session(state, principal, req.session_id)
            if await state.read(state.store.get_session, sid) is None:
                raise ApiError(404, f"unknown session {sid!r}", code="session_not_found")
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
        principal = await authenticate(request, state.keys, state.store)
        req = _validate(SetReward, await body_of(request))
        if not math.isfinite(req.reward):
            raise ApiError(422, "reward must be a finite number", param="reward")
        sid = await _target_session(state, principal, req.session_id)
        try:
            reward_id = await state.writer.call(state.store.add_reward, sid, req.reward, "api", None)
        except StoreError as exc:
            raise ApiError(404, str(exc)) from None
        return {"reward_id": reward_id, "session_id": sid, "interaction_id": None, "reward": req.reward}

    @router.get("/sessions")
    async def list_sessions(request: Request, limit: int = 50, offset: int = 0,
                            status: str | None = None) -> dict[str, Any]:
        principal = await authenticate(request, state.keys, state.store)
        if not _is_user(principal):
            require_admin(principal)
        if not 1 <= limit <= 1000:
            raise ApiError(422, "limit must be 1..1000", param="limit")
        if not 0 <= offset <= MAX_OFFSET:
            raise ApiError(422, f"offset must be 0..{MAX_OFFSET}", param="offset")
        rows = await state.read(state.store.list_sessions, limit, offset, status, principal.user)
        return {"sessions": [r.__dict__ for r in rows]}

    @router.get("/sessions/{session_id}")
    async def get_session(request: Request, session_id: str) -> dict[str, Any]:
        principal = await authenticate(request, state.keys, state.store)
        session_id = await _target_session(state, principal, session_id)
        view = await state.read(state.store.session_view, session_id)
        if view is None:
            raise ApiError(404, f"unknown session {session_id!r}", code="session_not_found")
        return view

    @router.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        require_admin(await authenticate(request, state.keys, state.store))
        trainer, judge = state.trainer, state.judge
        return {"model": state.model_info.name, "backend": state.backend.name,
                "policy_version": state.sampler.policy_version, "store": await state.read(state.store.stats),
                "users": await state.read(UserStore(state.store).stats),
                "trainer": await state.read(trainer.status) if trainer is not None else None,
                "lanes": await state.read(state.lanes.status) if state.lanes is not None else None,
                "judge": await state.read(judge.status) if judge is not None else None,
                "privacy": state.privacy.status() if state.privacy is not None else None,
                "promotion": await state.read(state.promotion.status) if state.promotion is not None else None,
                "notes": await state.read(state.notes.status) if state.notes is not None else None,
                "remote_deletions": await state.read(OwedDeletionStore(state.store).status),
                "engine": engine_status(state.backend.sampler())}

    return router
