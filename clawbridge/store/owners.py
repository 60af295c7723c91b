"""Which user owns a session: the check every write to a session makes, and a memory of owners so
a model call can check without a read.

The owner is part of every write that adds to or creates a session (`check_session_write`, inside
the write's own transaction, so no route can forget it and no race slips between a check and the
write): a turn (`TurnRecord.user_id`), `ensure_session`, a keyed session's start. A session of
user U takes writes for U only, and a new session whose id is in user U's namespace (`U:...`,
`clawbridge.access.namespace_of`) is created only for U while U is a user (a users row, or
sessions of U's); otherwise `SessionOwnerError`, answered like the proxy's own check
(`clawbridge.access.not_recordable`) so the store never says more than the route would.

Every model call that names a session checks that the caller may record into it
(`clawbridge.proxy.ownership.check_recordable`). Reading the owner from SQLite means a hop to a
worker thread and a wait for the store's lock, which the writer holds through each group commit.
A session's owner is set when the session is created and never changed (`clawbridge.store.store`),
so the answer can be kept.

Invariants:
- An entry is only ever what the store committed: it is added after a read of the row, or after
  the transaction that created the session committed; never for a write that may roll back.
- Only a session that exists is remembered (a miss says nothing; the caller reads the store).
- Sessions are deleted only by forgetting a user (`UserStore.forget`), which clears every entry
  after its transaction commits, so an id reused after a forget is never answered with the old owner.
- Bounded: at most `max_entries` sessions, least recently used dropped first. Thread safe.
"""

from __future__ import annotations

import sqlite3
import threading
from collections import OrderedDict

from clawbridge.access import Denied, namespace_of, not_recordable

_MISSING = object()


class SessionOwnerError(Denied):
    """A write into a session of another owner, or a new session in another user's namespace."""

    def __init__(self, session_id: str, owner: str | None) -> None:
        d = not_recordable(session_id, owner)
        super().__init__(d.status, d.message, d.code, d.param)
        self.session_id = session_id
        self.owner = owner


def namespace_user(c: sqlite3.Connection, session_id: str) -> str | None:
    """The user whose namespace `session_id` is in, if that user exists (a users row, active or
    revoked, or sessions of theirs: a trusted `X-User-Id` never added); else None."""
    ns = namespace_of(session_id)
    if ns is None:
        return None
    known = c.execute("SELECT 1 FROM users WHERE user_id=? UNION ALL SELECT 1 FROM sessions WHERE user_id=? LIMIT 1",
                      (ns, ns)).fetchone()
    return ns if known is not None else None


def check_session_write(c: sqlite3.Connection, session_id: str, owner: str | None) -> sqlite3.Row | None:
    """Inside a write transaction: the session's row (`status`, `user_id`), None when it does not
    exist; `SessionOwnerError` unless `owner` may write it (module docstring)."""
    row = c.execute("SELECT status, user_id FROM sessions WHERE session_id=?", (session_id,)).fetchone()
    if row is not None:
        if row["user_id"] != owner:
            raise SessionOwnerError(session_id, row["user_id"])
        return row
    ns = namespace_user(c, session_id)
    if ns is not None and ns != owner:
        raise SessionOwnerError(session_id, ns)
    return None


class SessionOwners:
    """LRU map from session id to the user owning it (None: a session without a user)."""

    def __init__(self, max_entries: int = 65536) -> None:
        self.max_entries = max_entries
        self._data: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, session_id: str) -> tuple[bool, str | None]:
        """(known, owner): known False when the session is not remembered (it may still exist)."""
        with self._lock:
            owner = self._data.get(session_id, _MISSING)
            if owner is _MISSING:
                return False, None
            self._data.move_to_end(session_id)
            assert owner is None or isinstance(owner, str)
            return True, owner

    def put(self, session_id: str, owner: str | None) -> None:
        """Remember that committed session `session_id` belongs to `owner`."""
        with self._lock:
            self._data[session_id] = owner
            self._data.move_to_end(session_id)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)
