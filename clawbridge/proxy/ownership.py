"""Which sessions a caller may use: the one check every route that names a session makes.

Invariant: a session the caller does not see (`Principal.sees`: another user's, or a user's for
the shared client key) is answered exactly like a session that does not exist (404 with the same
body), so a key never learns that another user's session exists.
"""

from __future__ import annotations

from clawbridge.proxy.auth import Principal
from clawbridge.proxy.errors import ApiError
from clawbridge.proxy.state import ProxyState
from clawbridge.store.users import UserStore, scoped_session_id


def unknown_session(session_id: str) -> ApiError:
    return ApiError(404, f"unknown session {session_id!r}", code="session_not_found")


async def session_owner(state: ProxyState, session_id: str) -> tuple[bool, str | None]:
    """(whether the session exists, its user): from memory when the store knows it (no thread hop,
    no wait for the writer's lock), else read on a worker thread."""
    known, owner = state.store.owners.get(session_id)
    if known:
        return True, owner
    return await state.read(UserStore(state.store).session_owner, session_id)


async def visible(state: ProxyState, principal: Principal, session_id: str) -> bool:
    """Whether the session exists and the caller sees it."""
    exists, owner = await session_owner(state, session_id)
    return exists and principal.sees(session_id, owner)


async def find_session(state: ProxyState, principal: Principal, asked: str) -> str:
    """The stored id of session `asked` for this caller, or 404: a caller with a user names its
    sessions as it named them in model calls (`asked`, stored `user:asked`) or by their stored id."""
    candidates = [asked]
    if principal.kind != "session" and principal.user is not None:
        candidates.insert(0, scoped_session_id(principal.user, asked))
    for sid in candidates:
        if await visible(state, principal, sid):
            return sid
    raise unknown_session(asked)


async def check_recordable(state: ProxyState, principal: Principal, session_id: str) -> None:
    """404 when a model call names an existing session the caller does not see (a new id is
    created as the caller's)."""
    exists, owner = await session_owner(state, session_id)
    if exists and not principal.sees(session_id, owner):
        raise unknown_session(session_id)
