"""Which user owns a session, remembered in memory so a model call can check it without a read.

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

import threading
from collections import OrderedDict

_MISSING = object()


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
