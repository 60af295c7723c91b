"""The session API (`/rl/*`), shaped like AReaL's online proxy.

- POST /rl/start_session {task_id?, api_key?} -> {session_id, api_key}   (admin key)
- POST /rl/end_session {session_id?}                                    (admin, or the session's key)
- POST /rl/set_reward {reward, interaction_id?, session_id?}            (admin, or the session's key)
- GET  /rl/sessions?limit&offset&status, GET /rl/sessions/{id}, GET /rl/status   (admin)

Invariant: a reward is accepted (200) only after it is committed.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from clawbridge.proxy.auth import Principal, authenticate, require_admin
from clawbridge.proxy.errors import ApiError
from clawbridge.proxy.request import parse_json_object, read_body
from clawbridge.proxy.state import ProxyState
from clawbridge.store import StoreError

MAX_OFFSET = 2**62
"""Far past any real store, and inside SQLite's 64-bit integers (a larger offset overflowed: 500)."""


class StartSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task_id: str | None = None
    api_key: str | None = None


class EndSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: str | None = None


class SetReward(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float
    interaction_id: str | None = None
    session_id: str | None = None


def _validate(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ApiError(422, f"invalid field {loc}: {err['msg']}", param=loc) from None


def _target_session(principal: Principal, asked: str | None) -> str:
    if principal.kind == "session":
        if asked is not None and asked != principal.session_id:
            raise ApiError(403, "a session key can only manage its own session", code="session_mismatch")
        assert principal.session_id is not None
        return principal.session_id
    require_admin(principal)
    if not asked:
        raise ApiError(400, "session_id is required with the admin key", param="session_id")
    return asked


def build_rl_router(state: ProxyState) -> APIRouter:
    router = APIRouter(prefix="/rl")

    async def body_of(request: Request) -> dict[str, Any]:
        return parse_json_object(await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s))

    @router.post("/start_session")
    async def start_session(request: Request) -> dict[str, Any]:
        require_admin(authenticate(request, state.keys, state.store))
        req = _validate(StartSession, await body_of(request))
        # --- trainer capacity mode (owned by clawbridge/trainer): new sessions only, never model calls
        if state.trainer is not None:
            over, retry_after = state.trainer.backlog_exceeded()
            if over:
                raise ApiError(429, "the training backlog is full; start the session later", code="training_backlog",
                               headers={"Retry-After": str(math.ceil(retry_after))})
        # --- end trainer capacity mode
        key = req.api_key or f"cbs-{secrets.token_urlsafe(24)}"
        if len(key) < 16:
            raise ApiError(400, "api_key must be at least 16 characters", param="api_key")
        session_id = await state.writer.call(state.store.start_keyed_session, key, req.task_id)
        return {"session_id": session_id, "api_key": key}

    @router.post("/end_session")
    async def end_session(request: Request) -> dict[str, Any]:
        principal = authenticate(request, state.keys, state.store)
        req = _validate(EndSession, await body_of(request))
        sid = _target_session(principal, req.session_id)
        if state.store.get_session(sid) is None:
            raise ApiError(404, f"unknown session {sid!r}", code="session_not_found")
        ended = await state.writer.call(state.store.end_session, sid, "end_session")
        if state.trainer is not None:
            state.trainer.notify()
        return {"session_id": sid, "ended": ended}

    @router.post("/set_reward")
    async def set_reward(request: Request) -> dict[str, Any]:
        principal = authenticate(request, state.keys, state.store)
        req = _validate(SetReward, await body_of(request))
        if not math.isfinite(req.reward):
            raise ApiError(422, "reward must be a finite number", param="reward")
        turn_id = req.interaction_id
        if turn_id is not None:
            owner = state.store.turn_session(turn_id)
            if owner is None:
                raise ApiError(404, f"unknown interaction {turn_id!r}", code="interaction_not_found")
            sid = _target_session(principal, req.session_id or owner)
            if sid != owner:
                raise ApiError(400, f"interaction {turn_id!r} is not in session {sid!r}")
        else:
            sid = _target_session(principal, req.session_id)
            if state.store.get_session(sid) is None:
                raise ApiError(404, f"unknown session {sid!r}", code="session_not_found")
            turn_id = state.store.last_turn_id(sid)
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
        principal = authenticate(request, state.keys, state.store)
        req = _validate(SetReward, await body_of(request))
        if not math.isfinite(req.reward):
            raise ApiError(422, "reward must be a finite number", param="reward")
        sid = _target_session(principal, req.session_id)
        try:
            reward_id = await state.writer.call(state.store.add_reward, sid, req.reward, "api", None)
        except StoreError as exc:
            raise ApiError(404, str(exc)) from None
        return {"reward_id": reward_id, "session_id": sid, "interaction_id": None, "reward": req.reward}

    @router.get("/sessions")
    async def list_sessions(request: Request, limit: int = 50, offset: int = 0,
                            status: str | None = None) -> dict[str, Any]:
        require_admin(authenticate(request, state.keys, state.store))
        if not 1 <= limit <= 1000:
            raise ApiError(422, "limit must be 1..1000", param="limit")
        if not 0 <= offset <= MAX_OFFSET:
            raise ApiError(422, f"offset must be 0..{MAX_OFFSET}", param="offset")
        rows = state.store.list_sessions(limit, offset, status)
        return {"sessions": [r.__dict__ for r in rows]}

    @router.get("/sessions/{session_id}")
    async def get_session(request: Request, session_id: str) -> dict[str, Any]:
        principal = authenticate(request, state.keys, state.store)
        _target_session(principal, session_id)
        view = state.store.session_view(session_id)
        if view is None:
            raise ApiError(404, f"unknown session {session_id!r}", code="session_not_found")
        return view

    @router.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        require_admin(authenticate(request, state.keys, state.store))
        return {"model": state.model_info.name, "backend": state.backend.name,
                "policy_version": state.sampler.policy_version, "store": state.store.stats(),
                "trainer": state.trainer.status() if state.trainer is not None else None,
                "judge": state.judge.status() if state.judge is not None else None}

    return router
