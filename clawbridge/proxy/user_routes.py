"""The user API (`/rl/users`, admin key): create, list, revoke and forget users.

- POST   /rl/users {"user": "alice"} -> {"user", "api_key", "created_at"}   the key is shown this once
- GET    /rl/users -> {"users": [{user, status, created_at, revoked_at, sessions, turns, ...}]}   no keys
- DELETE /rl/users/{user} -> {"user", "status": "revoked", ...}               the key stops working (401)
- DELETE /rl/users/{user}?forget=true, POST /rl/users/{user}/forget -> {"user", "deleted": {table: rows},
  "remote_deletions_owed", ...}

Invariants: a name outside `USER_NAME_RE` is 422, an existing name 409 (or one whose namespace
`name:...` already holds sessions recorded without that user: `clawbridge.store.users`), an
unknown user 404 (all OpenAI-style bodies). A forget, in this order: revokes the user and opens her grave
(`UserStore.begin_forget`: her key, her name as `X-User-Id` and her session keys' calls are
refused from now on, and no turn of hers is recorded); cuts her running model calls and waits for
every request that began before and may act for her (`clawbridge.proxy.inflight`, at most
`drain_grace_s`); lets each `ForgetHook` of the server delete what it keeps for her (her adapter's
trainer lane, its versions on every engine, checkpoints, versions and steps:
`clawbridge.trainer.lanes`); then deletes her rows from the store and vacuums the file, so nothing
a hook deleted from the store stays in its free pages. It is answered only after that committed,
with every hook's counts joined, `cut` (her calls ended), and how many deletions on a hosted
service forgetting users still owes (`remote_deletions_owed`: retried until done,
`clawbridge.trainer.deletions`). A failure on the way leaves her revoked and her grave open:
forgetting her again finishes the job.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from clawbridge.access import Action
from clawbridge.proxy.errors import ApiError, validated
from clawbridge.proxy.inflight import ticket_of
from clawbridge.proxy.ownership import caller
from clawbridge.proxy.request import parse_json_object, read_body
from clawbridge.proxy.state import ProxyState
from clawbridge.store.deletions import OwedDeletionStore
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
    """Delete everything of `user` (module invariants); what was deleted, per table/hook."""
    try:
        epoch = await state.writer.call(UserStore(state.store).begin_forget, user)
    except UserError as exc:
        raise _api_error(exc) from None
    cut = state.inflight.cut(user)
    await state.inflight.drain(user, epoch, state.settings.drain_grace_s)
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
        state.inflight.sweep()
    if state.notes is not None:  # her notes left the store: the proxy's copy in memory goes too
        await state.read(state.notes.refresh)
    deleted = dict(report.deleted)
    for name, n in hooked.items():  # a hook may have deleted rows of a table the store counts too
        deleted[name] = deleted.get(name, 0) + n
    if state.trainer is not None:
        state.trainer.notify()
    log.info("forgot user %s: %d running call(s) cut; deleted %s; store vacuumed%s", user, cut,
             ", ".join(f"{k} {v}" for k, v in sorted(deleted.items())) or "nothing",
             "" if report.wal_truncated else " (WAL not truncated: another connection was reading)")
    owed = await state.read(OwedDeletionStore(state.store).count, "forget")
    if owed:
        log.warning("forgetting users still owes %d deletion(s) on the hosted service; retried until done "
                    "(`clawbridge status`)", owed)
    return {"user": user, "forgotten": True, "deleted": deleted, "cut": cut, "vacuumed": True,
            "wal_truncated": report.wal_truncated, "remote_deletions_owed": owed}


def build_user_router(state: ProxyState, hooks: list[ForgetHook] | None = None) -> APIRouter:
    router = APIRouter(prefix="/rl/users")
    forget_hooks = hooks if hooks is not None else []
    users = UserStore(state.store)

    async def admin(request: Request, action: Action = "write") -> None:
        await caller(state, request, "users", action)
        ticket = ticket_of(request.scope)
        if ticket is not None:  # the admin's: a forget never waits for it (two forgets never wait on each other)
            state.inflight.identify(ticket, None)

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
