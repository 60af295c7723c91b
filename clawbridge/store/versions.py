"""Policy versions and the checkpoints behind them: the store owns the numbering.

Operates on a `Store` through its `write()` / `read()` seam, like `clawbridge.store.training`.

Invariants:
- A version is RESERVED (a committed row) before any backend serves it, and its number comes from
  the store's persisted counter (`clawbridge.store.counters`): greater than every version this
  store has ever given, even when the rows naming the newest were deleted since (a forgotten
  user's lane), so no number names two different sets of weights, across any number of restarts,
  forgets and prunes.
- A version is COMMITTED only together with the checkpoint that holds its weights and optimizer
  state (for a training step: in the step's own commit transaction, see
  `TrainingStore.commit_step`). The version a restarted server serves is the newest committed one.
- A reservation that never committed (a crash, a failed publish or checkpoint) is marked
  `abandoned` at the next start (`abandon_reserved`): its number stays used.
- Version 0 is the base model; its row (kind `base`) is committed with the checkpoint of the
  untrained trainer state, written before the first step so a failed first step can be undone.
- Gaps are normal: numbers are only ever reserved, never handed back. A step that fails after
  its version was reserved (publish, checkpoint or commit failed, or the process was killed)
  abandons that number, and the weights reloaded after it are served under a NEW number (kind
  `restore`), because the abandoned number may already label recorded turns sampled from weights
  that were never committed. Reusing it would make one number name two sets of weights; a gap
  costs nothing. So committed versions increase but need not be consecutive.
- Retention: a committed version whose checkpoint was deleted (`pruned_at` set, see
  `clawbridge.trainer.checkpoints`) stays committed, but is no restore or rollback target.
  `prunable` never offers a checkpoint named by one of the `keep` newest committed versions (the
  newest, the one served, is always among them; a rollback version names its source's
  checkpoint, which so stays as long as the rollback version is recent), nor, however old, the
  checkpoint of the lane's base (version 0 for the shared lane: `clawbridge rollback 0` always
  works), of the version promotion serves or has on trial, or of the drift guard's anchor
  (`PromotionStore.anchor_version`, `clawbridge.store.promotion`). A checkpoint written
  for a version that never committed (`note_checkpoint`, then a kill or a failure) is prunable
  once the version is abandoned.
- Lanes (per-user adapters, `clawbridge.trainer.lanes`): every version belongs to one lane, ''
  for the shared policy or a user's name for that user's adapter. Numbers are shared by all lanes
  (one sequence, never reused); "newest committed", listings, `get`, reservations abandoned at
  start and retention are per lane (a `VersionStore` is bound to one), so a keeper, a rollback or
  the promoter never takes another lane's version for its own. Only `find` looks in every lane
  and says which (`VersionRow.lane`): the version router's lookup, which then asks
  `clawbridge.access` whether the caller may have it. Version 0 is the shared lane's base; a user
  lane's base (its untrained adapter) is a version of kind `base` reserved like any other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from clawbridge.store.counters import take
from clawbridge.store.promotion import PromotionStore
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
    pruned_at: float | None = None
    """When its checkpoint was deleted by retention (None: the checkpoint is kept)."""
    lane: str = ""
    """The trainer lane it belongs to: '' the shared policy, else the user whose adapter it is."""

    @property
    def restorable(self) -> bool:
        """Committed with a checkpoint that still exists: a restore or rollback target."""
        return self.status == "committed" and self.checkpoint is not None and self.pruned_at is None


class VersionStore:
    """Reserve, commit and look up policy versions of one lane on a `Store`."""

    def __init__(self, store: Store, lane: str = "") -> None:
        self.store = store
        self.lane = lane
        """The lane this view reserves in and lists ('' the shared policy; see the module invariants)."""

    def reserve(self, kind: VersionKind, step: int | None = None, source_version: int | None = None) -> int:
        """A new version number, greater than any this store has ever given (`clawbridge.store.counters`),
        committed as `reserved`, durably (a backend names weights, files or adapters after it)."""
        with self.store.write(durable=True) as c:
            seen = c.execute(  # a version a turn or step carries without a row (a backend's own numbering)
                "SELECT MAX(v) FROM (SELECT MAX(policy_version) AS v FROM turns UNION ALL "
                "SELECT MAX(policy_version) FROM steps)").fetchone()[0]
            version = take(c, "policy_version", above=None if seen is None else int(seen))
            c.execute(
                "INSERT INTO policy_versions(version, status, kind, step, source_version, created_at, lane) "
                "VALUES(?, 'reserved', ?, ?, ?, ?, ?)",
                (version, kind, step, source_version, self.store.clock.now(), self.lane),
            )
        return version

    def commit(self, version: int, checkpoint: str, identity: dict[str, Any] | None) -> None:
        """Mark a reserved version committed with its checkpoint (rollback / restore versions), durably."""
        with self.store.write(durable=True) as c:
            commit_in(c, version, checkpoint, identity, self.store.clock.now())

    def commit_base(self, checkpoint: str, identity: dict[str, Any] | None) -> None:
        """Record the lane's base with the checkpoint of the untrained trainer state: version 0 for
        the shared lane, a newly reserved number for a user's lane."""
        if self.lane:
            self.commit(self.reserve("base"), checkpoint, identity)
            return
        now = self.store.clock.now()
        with self.store.write(durable=True) as c:
            c.execute(
                "INSERT INTO policy_versions(version, status, kind, checkpoint, identity_json, created_at, "
                "committed_at) VALUES(0, 'committed', 'base', ?, ?, ?, ?) ON CONFLICT(version) DO UPDATE SET "
                "status='committed', checkpoint=excluded.checkpoint, identity_json=excluded.identity_json, "
                "committed_at=excluded.committed_at",
                (checkpoint, _dump(identity), now, now),
            )

    def abandon_reserved(self) -> int:
        """Mark reservations left by an earlier process abandoned; returns how many."""
        with self.store.write() as c:
            return c.execute("UPDATE policy_versions SET status='abandoned' WHERE status='reserved' AND lane=?",
                             (self.lane,)).rowcount

    def abandon(self, version: int) -> None:
        with self.store.write() as c:
            c.execute("UPDATE policy_versions SET status='abandoned' WHERE version=? AND status='reserved'", (version,))

    def last_committed(self) -> VersionRow | None:
        """The newest committed version: the one a (re)started server serves."""
        rows = self._select("WHERE status='committed' AND lane=? ORDER BY version DESC LIMIT 1", (self.lane,))
        return rows[0] if rows else None

    def get(self, version: int) -> VersionRow | None:
        """Version `version` of this store's lane (None: no such version, or another lane's)."""
        rows = self._select("WHERE version=? AND lane=?", (version, self.lane))
        return rows[0] if rows else None

    def find(self, version: int) -> VersionRow | None:
        """Version `version` in whichever lane it is (`VersionRow.lane`); who may use it is
        `clawbridge.access`'s to say."""
        rows = self._select("WHERE version=?", (version,))
        return rows[0] if rows else None

    def listing(self, limit: int = 50, committed_only: bool = True) -> list[VersionRow]:
        """The lane's versions, newest first."""
        where = "WHERE lane=? " + ("AND status='committed' " if committed_only else "")
        return self._select(where + "ORDER BY version DESC LIMIT ?", (self.lane, limit))

    def note_checkpoint(self, version: int, checkpoint: str) -> None:
        """A reserved version's checkpoint is written (not yet committed): if the step never
        commits, retention can still find and delete it."""
        with self.store.write() as c:
            c.execute("UPDATE policy_versions SET checkpoint=? WHERE version=? AND status='reserved'",
                      (checkpoint, version))

    def prunable(self, keep: int) -> list[str]:
        """Checkpoints that retention may delete, oldest first: named only by committed versions
        older than the `keep` newest committed ones (and not the lane's base, nor the serving,
        candidate or anchor version), or written for a version that was then abandoned (see the
        module invariants)."""
        rows = [r for r in self._select("WHERE status='committed' AND lane=? ORDER BY version DESC", (self.lane,))
                if r.checkpoint]
        kept = {r.checkpoint for r in rows[: max(1, keep)]}
        kept |= {r.checkpoint for r in self._select(
            "WHERE version IN (SELECT serving_version FROM promotion_state "
            "UNION SELECT candidate_version FROM promotion_state) OR (kind='base' AND lane=?)", (self.lane,))}
        anchor = PromotionStore(self.store).anchor_version()
        if anchor is not None:
            kept |= {r.checkpoint for r in self._select("WHERE version=?", (anchor,))}
        old = rows[max(1, keep):] + self._select("WHERE status='abandoned' AND checkpoint IS NOT NULL AND lane=?",
                                                 (self.lane,))
        out: list[str] = []
        for r in sorted(old, key=lambda r: r.version):
            if r.pruned_at is None and r.checkpoint not in kept and r.checkpoint not in out:
                out.append(str(r.checkpoint))
        return out

    def mark_pruned(self, checkpoint: str) -> int:
        """Record that `checkpoint` was deleted (every version naming it); returns how many rows."""
        with self.store.write() as c:
            return c.execute(
                "UPDATE policy_versions SET pruned_at=? WHERE checkpoint=? AND pruned_at IS NULL",
                (self.store.clock.now(), checkpoint),
            ).rowcount

    def delete_lane(self) -> dict[str, int]:
        """Delete a user lane's versions, training steps and the samples those steps consumed (the
        user's own: a step never mixes users), forgetting the user; the rows deleted per table.
        The shared lane cannot be deleted."""
        if not self.lane:
            raise StoreError("the shared lane's versions are never deleted")
        with self.store.write() as c:  # the samples its steps consumed are the user's own (a step never mixes)
            samples = c.execute("DELETE FROM samples WHERE consumed_step IN (SELECT step FROM steps WHERE lane=?)",
                                (self.lane,)).rowcount
            steps = c.execute("DELETE FROM steps WHERE lane=?", (self.lane,)).rowcount
            versions = c.execute("DELETE FROM policy_versions WHERE lane=?", (self.lane,)).rowcount
        return {"policy_versions": versions, "steps": steps, "samples": samples}

    def _select(self, tail: str, args: tuple[Any, ...]) -> list[VersionRow]:
        with self.store.read() as c:
            rows = c.execute(f"SELECT * FROM policy_versions {tail}", args).fetchall()
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
                pruned_at=r["pruned_at"],
                lane=str(r["lane"]),
            )
            for r in rows
        ]


def commit_in(c: Any, version: int, checkpoint: str, identity: dict[str, Any] | None, now: float) -> None:
    """Inside an open transaction: reserved -> committed, with its checkpoint; StoreError otherwise."""
    cur = c.execute(
        "UPDATE policy_versions SET status='committed', checkpoint=?, identity_json=?, committed_at=? "
        "WHERE version=? AND status='reserved'",
        (checkpoint, _dump(identity), now, version),
    )
    if cur.rowcount != 1:
        raise StoreError(f"policy version {version} is not reserved (abandoned by a restart?)")


def _dump(identity: dict[str, Any] | None) -> str | None:
    return json.dumps(identity, sort_keys=True) if identity is not None else None
