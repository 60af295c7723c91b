"""Who is calling: the client key (model calls), the admin key (everything), or a session key.

Invariants:
- Keys are compared in constant time; a session key is looked up by its sha256 only.
- The key lookup runs off the event loop (`asyncio.to_thread`): the store's lock may be held by a
  trainer thread for a whole transaction, and no request may wait on it with the loop.
- A session key reaches model calls (recorded in its own session) and `/rl/set_reward`,
  `/rl/end_session` of its own session; never another session's data.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from fastapi import Request

from clawbridge.keys import keys_equal
from clawbridge.proxy.errors import ApiError
from clawbridge.store import Store


@dataclass(frozen=True)
class Principal:
    """The authenticated caller."""

    kind: Literal["admin", "client", "session"]
    session_id: str | None = None
    """For kind 'session': the session the key belongs to."""


@dataclass(frozen=True)
class Keys:
    client: str
    admin: str


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
        return Principal("client")
    session_id = await asyncio.to_thread(store.session_for_key, key)
    if session_id is not None:
        return Principal("session", session_id)
    raise ApiError(401, "invalid API key", code="invalid_api_key")


def require_admin(principal: Principal) -> None:
    if principal.kind != "admin":
        raise ApiError(403, "this endpoint needs the admin key (CLAWBRIDGE_ADMIN_KEY)", code="admin_key_required")
