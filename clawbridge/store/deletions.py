"""Deletions owed on a hosted service: what a pruned checkpoint or a forgotten user left there.

Operates on a `Store` through its `write()` / `read()` seam, like `clawbridge.store.versions`.
The retrying (when, how often, with what) is `clawbridge.trainer.deletions`; this module keeps
the list.

Invariants:
- An object is recorded (`owe`) BEFORE anything tries to delete it, and its row is removed only
  once the service confirmed it gone (`done`): a crash, a refusal or a service that is down never
  loses a deletion, and the list shows exactly what is still owed.
- One row per object (the service's name for it is the key): the training state and the sampler
  weights of one checkpoint are owed, tried and done each on their own, so one that fails never
  holds back or repeats the other.
- Pruning decides once: the checkpoint's objects are owed and its versions marked pruned
  (`policy_versions.pruned_at`) in ONE transaction, so retention never offers it again and
  `checkpoints list` never shows as restorable what is being deleted.
- Rows name no user: what forgetting a user owes is recorded by the objects' own names, so the
  list keeps nothing of hers once the service has deleted them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from clawbridge.store.store import Store

OwedReason = Literal["prune", "forget"]

STATUS_ITEMS = 5
"""Owed objects `status` lists one by one (the next ones due); the rest are counted."""


@dataclass(frozen=True)
class OwedRow:
    """One row of `owed_deletions`."""

    object: str
    kind: str
    backend: str
    reason: str
    created_at: float
    attempts: int
    """Tries so far (0: not tried yet)."""
    last_error: str | None
    next_try_at: float

    def as_dict(self) -> dict[str, Any]:
        return {"object": self.object, "kind": self.kind, "backend": self.backend, "reason": self.reason,
                "created_at": self.created_at, "attempts": self.attempts, "last_error": self.last_error,
                "next_try_at": self.next_try_at}


class OwedDeletionStore:
    """The list of deletions owed on hosted services (module invariants)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def owe(self, objects: Sequence[tuple[str, str]], backend: str, reason: OwedReason,
            prune_checkpoint: str | None = None) -> int:
        """Record `(object, kind)` pairs as owed by `backend` (due now); with `prune_checkpoint`,
        mark every version naming that checkpoint pruned in the same transaction. Objects already
        owed keep their row. Returns how many were added."""
        now = self.store.clock.now()
        with self.store.write() as c:
            added = 0
            for obj, kind in objects:
                added += c.execute(
                    "INSERT OR IGNORE INTO owed_deletions(object, kind, backend, reason, created_at, next_try_at) "
                    "VALUES(?,?,?,?,?,?)", (obj, kind, backend, reason, now, now)).rowcount
            if prune_checkpoint is not None:
                c.execute("UPDATE policy_versions SET pruned_at=? WHERE checkpoint=? AND pruned_at IS NULL",
                          (now, prune_checkpoint))
        return added

    def due(self, backend: str, now: float, limit: int = 100) -> list[OwedRow]:
        """`backend`'s owed objects whose next try is due at `now`, the longest waiting first."""
        return self._select("WHERE backend=? AND next_try_at <= ? ORDER BY next_try_at, object LIMIT ?",
                            (backend, now, limit))

    def done(self, obj: str) -> None:
        """The service confirmed `obj` gone: nothing is owed for it any more."""
        with self.store.write() as c:
            c.execute("DELETE FROM owed_deletions WHERE object=?", (obj,))

    def failed(self, obj: str, error: str, next_try_at: float) -> int:
        """A try at `obj` failed with `error`: count it and try again at `next_try_at`; returns the
        tries so far (0: no longer owed, e.g. deleted by a concurrent try)."""
        with self.store.write() as c:
            c.execute("UPDATE owed_deletions SET attempts=attempts+1, last_error=?, next_try_at=? WHERE object=?",
                      (error[:2000], next_try_at, obj))
            row = c.execute("SELECT attempts FROM owed_deletions WHERE object=?", (obj,)).fetchone()
        return int(row[0]) if row is not None else 0

    def attempts(self, obj: str) -> int:
        """Tries so far at `obj` (0 when not owed)."""
        with self.store.read() as c:
            row = c.execute("SELECT attempts FROM owed_deletions WHERE object=?", (obj,)).fetchone()
        return int(row[0]) if row is not None else 0

    def next_due(self, backend: str) -> float | None:
        """When `backend`'s next owed object is due (None: nothing owed)."""
        with self.store.read() as c:
            row = c.execute("SELECT MIN(next_try_at) FROM owed_deletions WHERE backend=?", (backend,)).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def count(self, reason: OwedReason | None = None) -> int:
        with self.store.read() as c:
            if reason is None:
                return int(c.execute("SELECT COUNT(*) FROM owed_deletions").fetchone()[0])
            return int(c.execute("SELECT COUNT(*) FROM owed_deletions WHERE reason=?", (reason,)).fetchone()[0])

    def listing(self, limit: int = 1000) -> list[OwedRow]:
        """Every owed object (up to `limit`), the next due first."""
        return self._select("ORDER BY next_try_at, object LIMIT ?", (limit,))

    def status(self) -> dict[str, Any]:
        """What `clawbridge status` and `GET /rl/status` show: how many are owed and why, since
        when, the next try, and the next few objects with their last error."""
        with self.store.read() as c:
            by_reason = {str(r[0]): int(r[1]) for r in c.execute(
                "SELECT reason, COUNT(*) FROM owed_deletions GROUP BY reason ORDER BY reason")}
            oldest, next_try = c.execute("SELECT MIN(created_at), MIN(next_try_at) FROM owed_deletions").fetchone()
        return {"owed": sum(by_reason.values()), "by_reason": by_reason, "oldest_at": oldest,
                "next_try_at": next_try, "items": [r.as_dict() for r in self.listing(STATUS_ITEMS)]}

    def _select(self, tail: str, args: tuple[Any, ...]) -> list[OwedRow]:
        with self.store.read() as c:
            rows = c.execute(f"SELECT object, kind, backend, reason, created_at, attempts, last_error, next_try_at "
                             f"FROM owed_deletions {tail}", args).fetchall()
        return [OwedRow(str(r[0]), str(r[1]), str(r[2]), str(r[3]), float(r[4]), int(r[5]), r[6], float(r[7]))
                for r in rows]
