"""Who is calling: the client key (model calls), the admin key (everything), a user's key, or a
session key, as a `clawbridge.access.Principal`; what each may do is `clawbridge.access`'s table.

Invariants:
- Keys are compared in constant time; a user key and a session key are looked up by their sha256
  only. Unknown and revoked keys are the same 401 (`invalid_api_key`).
- A user key is a client key whose every call is that user's (`Principal.user`); a session key is
  its session's user's. With `trust_user_header`, the shared client key naming its user with
  `X-User-Id` is that user's key (kind `user`; a revoked user named so is 401 too).
- The key lookup runs off the event loop (`asyncio.to_thread`): the store's lock may be held by a
  trainer thread for a whole transaction, and no request may wait on it with the loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request

from clawbridge.access import Principal
from clawbridge.proxy.errors import ApiError
from clawbridge.runtime.keys import keys_equal
from clawbridge.store import Store
from clawbridge.store.users import UserError, UserStore, check_user_name

USER_HEADER = "x-user-id"


@dataclass(frozen=True)
class Keys:
    client: str
    admin: str
    trust_user_header: bool = False
    """Setting `trust_user_header`: the client key may name its user with `X-User-Id`."""


def presented_key(request: Request) -> str | None:
    """The key from `Authorization: Bearer ...` (OpenAI SDK) or `x-api-key` (Anthropic SDK)."""
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = request.headers.get("x-api-key")
    return key.strip() if key else None


async def authenticate(request: Request, keys: Keys, store: Store) -> Principal:
    key = presented_key(request)
    if key is None:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    if keys_equal(key, keys.admin):
        return Principal("admin")
    if keys_equal(key, keys.client):
        named = request.headers.get(USER_HEADER, "").strip()
        if not keys.trust_user_header or not named:
            return Principal("client")
        return await asyncio.to_thread(_header_user, store, named)
    principal = await asyncio.to_thread(_key_principal, store, key)
    if principal is not None:
        return principal
    raise ApiError(401, "invalid API key (unknown, or the user's key was revoked)", code="invalid_api_key")


def _key_principal(store: Store, key: str) -> Principal | None:
    user = UserStore(store).user_for_key(key)
    if user is not None:
        return Principal("user", user=user)
    session_id = store.session_for_key(key)
    if session_id is None:
        return None
    session = store.get_session(session_id)
    return Principal("session", user=None if session is None else session.user_id, session_id=session_id)


def _header_user(store: Store, named: str) -> Principal:
    try:
        check_user_name(named)
    except UserError as exc:
        raise ApiError(400, f"X-User-Id: {exc}", code="invalid_user") from None
    if UserStore(store).is_revoked(named):
        raise ApiError(401, f"user {named!r} was revoked", code="invalid_api_key")
    return Principal("user", user=named)


__all__ = ["USER_HEADER", "Keys", "Principal", "authenticate", "presented_key"]
