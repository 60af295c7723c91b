"""Policy versions and the checkpoints behind them: the store owns the numbering.

Operates on a `Store`'s connection through its `_tx` and `_lock`, like `clawbridge.store.training`.

Invariants:
- A version is RESERVED (a committed row) before any backend serves it, and the number is
  greater than every version this store has ever seen (reserved, abandoned, recorded on a turn or
  a step), so no number names two different sets of weights, across any number of restarts.
- A version is COMMITTED only together with the checkpoint that holds its weights and optimizer
  state (for a training step: in the step's own commit transaction, see
  `TrainingStore.commit_step`). The version a restarted server serves is the newest committed one.
- A reservation that never committed (a crash, a failed publish or checkpoint) is marked
  `abandoned` at the next start (`abandon_reserved`): its number stays used.
- Version 0 is the base model; its row (kind `base`) is committed with the checkpoint of the
  untrained trainer state, written before the first step so a failed first step can be undone.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

from clawbridge.store.store import Store, StoreError

VersionKind = Literal["base", "step", "rollback", "restore"]


@dataclass(frozen=True)
class VersionRow:
    """One row of `policy_versions`."""

    version: int
    status: str
    """reserved | committed | abandoned"""
    kind: str
    """base | step | rollback | restore"""
    step: int | None
    source_version: int | None
    """rollback / restore: the version whose weights this one serves."""
    checkpoint: str | None
    identity: dict[str, Any] | None
    created_at: float
    committed_at: float | None


class VersionStore:
    """Reserve, commit and look up policy versions on a `Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def reserve(self, kind: VersionKind, step: int | None = None, source_version: int | None = None) -> int:
        """A new version number, greater than any this store has seen, committed as `reserved`."""
        with self.store._tx() as c:
            seen = c.execute(
                "SELECT MAX(v) FROM (SELECT MAX(version) AS v FROM policy_versions "
                "UNION ALL SELECT MAX(policy_version) FROM turns UNION ALL SELECT MAX(policy_version) FROM steps)"
            ).fetchone()[0]
            version = int(seen) + 1 if seen is not None else 1
            c.execute(
                "INSERT INTO policy_versions(version, status, kind, step, source_version, created_at) "
                "VALUES(?, 'reserved', ?, ?, ?, ?)",
                (version, kind, step, source_version, time.time()),
            )
        return version

    def commit(self, version: int, checkpoint: str, identity: dict[str, Any] | None) -> None:
        """Mark a reserved version committed with its checkpoint (rollback / restore versions)."""
        with self.store._tx() as c:
            commit_in(c, version, checkpoint, identity)

    def commit_base(self, checkpoint: str, identity: dict[str, Any] | None) -> None:
        """Record version 0 (the base model) with the checkpoint of the untrained trainer state."""
        now = time.time()
        with self.store._tx() as c:
            c.execute(
                "INSERT INTO policy_versions(version, status, kind, checkpoint, identity_json, created_at, "
                "committed_at) VALUES(0, 'committed', 'base', ?, ?, ?, ?) ON CONFLICT(version) DO UPDATE SET "
                "status='committed', checkpoint=excluded.checkpoint, identity_json=excluded.identity_json, "
                "committed_at=excluded.committed_at",
                (checkpoint, _dump(identity), now, now),
            )

    def abandon_reserved(self) -> int:
        """Mark reservations left by an earlier process abandoned; returns how many."""
        with self.store._tx() as c:
            return c.execute("UPDATE policy_versions SET status='abandoned' WHERE status='reserved'").rowcount

    def abandon(self, version: int) -> None:
        with self.store._tx() as c:
            c.execute("UPDATE policy_versions SET status='abandoned' WHERE version=? AND status='reserved'", (version,))

    def last_committed(self) -> VersionRow | None:
        """The newest committed version: the one a (re)started server serves."""
        rows = self._select("WHERE status='committed' ORDER BY version DESC LIMIT 1", ())
        return rows[0] if rows else None

    def get(self, version: int) -> VersionRow | None:
        rows = self._select("WHERE version=?", (version,))
        return rows[0] if rows else None

    def listing(self, limit: int = 50, committed_only: bool = True) -> list[VersionRow]:
        """Newest first."""
        where = "WHERE status='committed' " if committed_only else ""
        return self._select(where + "ORDER BY version DESC LIMIT ?", (limit,))

    def _select(self, tail: str, args: tuple[Any, ...]) -> list[VersionRow]:
        with self.store._lock:
            rows = self.store._conn.execute(f"SELECT * FROM policy_versions {tail}", args).fetchall()
        return [
            VersionRow(
                version=int(r["version"]),
                status=str(r["status"]),
                kind=str(r["kind"]),
                step=r["step"],
                source_version=r["source_version"],
                checkpoint=r["checkpoint"],
                identity=json.loads(r["identity_json"]) if r["identity_json"] else None,
                created_at=float(r["created_at"]),
                committed_at=r["committed_at"],
            )
            for r in rows
        ]


def commit_in(c: Any, version: int, checkpoint: str, identity: dict[str, Any] | None) -> None:
    """Inside an open transaction: reserved -> committed, with its checkpoint; StoreError otherwise."""
    cur = c.execute(
        "UPDATE policy_versions SET status='committed', checkpoint=?, identity_json=?, committed_at=? "
        "WHERE version=? AND status='reserved'",
        (checkpoint, _dump(identity), time.time(), version),
    )
    if cur.rowcount != 1:
        raise StoreError(f"policy version {version} is not reserved (abandoned by a restart?)")


def _dump(identity: dict[str, Any] | None) -> str | None:
    return json.dumps(identity, sort_keys=True) if identity is not None else None
