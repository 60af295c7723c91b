"""The proxy's side of `clawbridge.access`: every route asks the table through here.

This module decides nothing itself: it authenticates, reads the facts the table needs (who owns
a session, whose namespace a new session id is in), calls `clawbridge.access.check`, and answers
its verdicts as `ApiError`s.

Invariants:
- A refusal the table hides (`access.Hidden`) is answered with the route's own answer for an
  object that does not exist (`not_found`), byte for byte, so a key never learns that another
  user's session, turn or version exists.
- A session key naming another session is refused before anything is read (its answer cannot
  depend on whether that session exists).
- What a route reads here is only a pre-check for a clear answer before any work (sampling):
  the store checks the owner again inside the write itself (`clawbridge.store.owners`).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request

from clawbridge.access import Action, Denied, Hidden, Principal, Resource, Target, check, scoped_session_id
from clawbridge.proxy.auth import authenticate
from clawbridge.proxy.errors import ApiError, denied
from clawbridge.proxy.state import ProxyState
from clawbridge.store.users import UserStore


def unknown_session(session_id: str) -> ApiError:
    return ApiError(404, f"unknown session {session_id!r}", code="session_not_found")


def require(principal: Principal, resource: Resource, action: Action, target: Target | None = None,
            not_found: Callable[[], ApiError] | None = None) -> None:
    """`access.check`, answered: a `Denied` as itself, a `Hidden` as `not_found()`."""
    try:
        check(principal, resource, action, target)
    except Denied as d:
        raise denied(d) from None
    except Hidden:
        assert not_found is not None, "a check with a target names its not-found answer"
        raise not_found() from None


async def caller(state: ProxyState, request: Request, resource: Resource, action: Action) -> Principal:
    """Authenticate the request and check that its key may do `action` on `resource` at all."""
    principal = await authenticate(request, state.keys, state.store)
    require(principal, resource, action)
    return principal


async def session_owner(state: ProxyState, session_id: str) -> tuple[bool, str | None]:
    """(whether the session exists, its user): from memory when the store knows it (no thread hop,
    no wait for the writer's lock), else read on a worker thread."""
    known, owner = state.store.owners.get(session_id)
    if known:
        return True, owner
    return await state.read(UserStore(state.store).session_owner, session_id)


async def session_target(state: ProxyState, session_id: str) -> Target | None:
    """The session as the table sees it, None when it does not exist."""
    exists, owner = await session_owner(state, session_id)
    return Target(owner, session_id) if exists else None


async def find_session(state: ProxyState, principal: Principal, asked: str, resource: Resource = "sessions",
                       action: Action = "read") -> str:
    """The stored id of the session `asked` on which the caller may do `action`, or 404 as for an
    unknown session.
    A caller with a user names its sessions as its agent named them (`asked`, stored `user:asked`)
    or by their stored id."""
    if principal.kind == "session":
        require(principal, resource, action, Target(None, asked))  # its own session, or 403 before any read
    candidates = [asked]
    if principal.kind == "user" and principal.user is not None:
        candidates.insert(0, scoped_session_id(principal.user, asked))
    for sid in candidates:
        target = await session_target(state, sid)
        if target is None:
            continue
        try:
            check(principal, resource, action, target)
        except Hidden:
            continue
        except Denied as d:
            raise denied(d) from None
        return sid
    raise unknown_session(asked)


async def check_recordable(state: ProxyState, principal: Principal, session_id: str) -> None:
    """403 when a model call names a session the caller may not record into: another owner's, or
    a new id in another user's namespace (the same answer whether or not it exists)."""
    target = await session_target(state, session_id)
    if target is None:  # a new session: the caller's own, unless its id is in another (existing) user's namespace
        user = await state.read(UserStore(state.store).namespace_user, session_id)
        target = Target(user if user is not None else principal.owner, session_id)
    require(principal, "sessions", "record", target)
