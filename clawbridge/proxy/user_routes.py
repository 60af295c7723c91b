"""The user API (`/rl/users`, admin key): create, list, revoke and forget users.

- POST   /rl/users {"user": "alice"} -> {"user", "api_key", "created_at"}   the key is shown this once
- GET    /rl/users -> {"users": [{user, status, created_at, revoked_at, sessions, turns, ...}]}   no keys
- DELETE /rl/users/{user} -> {"user", "status": "revoked", ...}               the key stops working (401)
- DELETE /rl/users/{user}?forget=true, POST /rl/users/{user}/forget -> {"user", "deleted": {table: rows}, ...}

Invariants: a name outside `USER_NAME_RE` is 422, an existing name 409 (or one whose namespace
`name:...` already holds sessions recorded without that user: `clawbridge.store.users`), an
unknown user 404 (all OpenAI-style bodies). A forget first lets each `ForgetHook` of the server delete what it keeps
for the user (their adapter's trainer lane, checkpoints, versions and steps:
`clawbridge.trainer.lanes`), then deletes the user's rows from the store and vacuums the file, so
nothing a hook deleted from the store stays in its free pages; it is answered only after that
committed, with every hook's counts joined.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from clawbridge.access import Action
from clawbridge.proxy.errors import ApiError, validated
from clawbridge.proxy.ownership import caller
from clawbridge.proxy.request import parse_json_object, read_body
from clawbridge.proxy.state import ProxyState
from clawbridge.store.users import UserError, UserStore

log = logging.getLogger("clawbridge.proxy")


class ForgetHook(Protocol):
    """Something outside the store that keeps data of a user (per-user adapters, their
    checkpoints): deletes all of it for `user` and says what it deleted (name -> count)."""

    async def forget_user(self, user: str) -> dict[str, int]: ...

    def forgotten(self, user: str) -> None:
        """The store's part of forgetting `user` is over (done or failed): what `forget_user`
        paused for them may resume (a lane for a user who comes back)."""
        ...


class NewUser(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user: str


def _api_error(exc: UserError) -> ApiError:
    status = {"invalid": 422, "exists": 409, "unknown": 404}[exc.reason]
    code = {"invalid": "invalid_user", "exists": "user_exists", "unknown": "user_not_found"}[exc.reason]
    return ApiError(status, str(exc), param="user" if exc.reason != "unknown" else None, code=code)


async def forget_user(state: ProxyState, user: str, hooks: list[ForgetHook]) -> dict[str, Any]:
    """Delete everything of `user` (the store, then each hook); what was deleted, per table/hook."""
    try:
        await state.read(UserStore(state.store).require_known, user)
    except UserError as exc:
        raise _api_error(exc) from None
    hooked: dict[str, int] = {}
    try:
        for hook in hooks:
            hooked.update(await hook.forget_user(user))
        report = await state.writer.call(UserStore(state.store).forget, user)
    except UserError as exc:
        raise _api_error(exc) from None
    finally:
        for hook in hooks:
            hook.forgotten(user)
    deleted = dict(report.deleted)
    for name, n in hooked.items():  # a hook may have deleted rows of a table the store counts too
        deleted[name] = deleted.get(name, 0) + n
    if state.trainer is not None:
        state.trainer.notify()
    log.info("forgot user %s: deleted %s; store vacuumed%s", user,
             ", ".join(f"{k} {v}" for k, v in sorted(deleted.items())) or "nothing",
             "" if report.wal_truncated else " (WAL not truncated: another connection was reading)")
    return {"user": user, "forgotten": True, "deleted": deleted, "vacuumed": True,
            "wal_truncated": report.wal_truncated}


def build_user_router(state: ProxyState, hooks: list[ForgetHook] | None = None) -> APIRouter:
    router = APIRouter(prefix="/rl/users")
    forget_hooks = hooks if hooks is not None else []
    users = UserStore(state.store)

    async def admin(request: Request, action: Action = "write") -> None:
        await caller(state, request, "users", action)

    @router.post("")
    async def add(request: Request) -> dict[str, Any]:
        await admin(request)
        raw = await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
        req = validated(NewUser, parse_json_object(raw), code="invalid_user", empty_loc="user",
                        message='send {{"user": "NAME"}}: {loc}: {msg}')
        try:
            key = await state.writer.call(users.add, req.user)
        except UserError as exc:
            raise _api_error(exc) from None
        row = await state.read(users.get, req.user)
        log.info("user %s created", req.user)
        return {"user": req.user, "api_key": key, "created_at": row.created_at if row else None}

    @router.get("")
    async def listing(request: Request) -> dict[str, Any]:
        await admin(request, "read")
        rows = {u.user: u for u in await state.read(users.all)}
        counts = {c["user"]: c for c in await state.read(users.stats) if c["user"] is not None}
        return {"users": [{**counts.get(name, {"user": name}), "status": "active" if u.active else "revoked",
                           "created_at": u.created_at, "revoked_at": u.revoked_at}
                          for name, u in rows.items()]}

    @router.delete("/{user}")
    async def revoke(request: Request, user: str, forget: bool = False) -> dict[str, Any]:
        await admin(request)
        if forget:
            return await forget_user(state, user, forget_hooks)
        try:
            row = await state.writer.call(users.revoke, user)
        except UserError as exc:
            raise _api_error(exc) from None
        log.info("user %s revoked", user)
        return {"user": user, "status": "revoked", "revoked_at": row.revoked_at}

    @router.post("/{user}/forget")
    async def forget(request: Request, user: str) -> dict[str, Any]:
        await admin(request)
        return await forget_user(state, user, forget_hooks)

    return router
