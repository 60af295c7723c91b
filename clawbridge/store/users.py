"""Users: a name and a key; every session made with the key is that user's (and so its turns,
rewards and samples). Operates on a `Store` through its `write()` / `read()` seam.

Invariants:
- Only the sha256 of a user's key is stored (`users.key_hash`); the key is returned once, by
  `add`, and never again. A revoked user keeps its row (name taken, `revoked_at` set) and its
  data, with `key_hash` NULL, so its key matches nobody.
- A user name matches `USER_NAME_RE`, so it can never contain `SCOPE_SEP` and a scoped session
  id (`scoped_session_id`) names its user unambiguously. A user's namespace (`alice:...`) is
  hers (`clawbridge.access`): a name is not added while sessions of another owner are in its
  namespace (the shared client key named `alice:x` before alice was added), else her agent's
  session `x` would be someone else's; the check runs in the insert's own transaction.
- Forgetting is two calls: `begin_forget` revokes the user first (her key, and her name for a
  trusted `X-User-Id`: a revoked row is written for a name that had none) and marks her grave
  (`Store.tombstones`: from then on no turn of hers is recorded); the server then ends her running
  calls (`clawbridge.proxy.inflight`) and lets its hooks delete what they keep; then `forget`
  deletes, in one transaction, every row of the user's sessions in every table that has a
  `session_id` or `turn_id` column, and every row of a table with a `user_id` column that names
  her (tables added by later migrations included: her notes), then the sessions
  and the user row, and takes her held-out items and the answers given to them out of the
  promotion figures (`clawbridge.store.promotion.scrub_items`); then `Store.vacuum` rebuilds the
  file and truncates the WAL, so no byte of what was deleted remains in either. Her grave then
  refuses only calls that began before the forget ended: a new user of the same name starts clean.
  Steps and policy versions of the shared lane are kept (they hold no text); a step that was
  training on the forgotten samples fails at commit (its samples are gone) and its update is
  undone, like any failed step.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from clawbridge.access import SCOPE_SEP, USER_NAME_RE, USER_NAME_RULE, namespace_of, scoped_session_id
from clawbridge.store.owners import namespace_user
from clawbridge.store.promotion import scrub_items
from clawbridge.store.store import Store, StoreError, hash_key

__all__ = ["SCOPE_SEP", "USER_NAME_RE", "USER_NAME_RULE", "ForgetReport", "UserError", "UserRow", "UserStore",
           "check_user_name", "scoped_session_id"]

KEY_PREFIX = "cbu-"

_KEEP_TABLES = ("sessions", "turns", "users", "meta")
"""Deleted last (sessions, turns) or never by table scan (users, meta)."""


class UserError(StoreError):
    """A user request the store cannot satisfy; `reason` is 'invalid', 'exists' or 'unknown'."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class UserRow:
    """One user as stored (never its key)."""

    user: str
    created_at: float
    revoked_at: float | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


@dataclass(frozen=True)
class ForgetReport:
    """What `forget` deleted: rows per table, and whether the WAL was truncated afterwards."""

    user: str
    deleted: dict[str, int]
    wal_truncated: bool


def check_user_name(name: str) -> str:
    if not isinstance(name, str) or not USER_NAME_RE.match(name):
        raise UserError("invalid", f"invalid user name {str(name)[:80]!r}: use {USER_NAME_RULE}")
    return name


class UserStore:
    """Users, their keys, per-user counts and forgetting, on a `Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def add(self, name: str) -> str:
        """Create user `name`; returns its new key (shown once, stored only as its sha256)."""
        check_user_name(name)
        key = f"{KEY_PREFIX}{secrets.token_urlsafe(32)}"
        with self.store.write() as c:
            row = c.execute("SELECT revoked_at FROM users WHERE user_id=?", (name,)).fetchone()
            if row is not None:
                state = "revoked; `clawbridge users forget` removes it and its data" if row[0] else "active"
                raise UserError("exists", f"user {name!r} already exists ({state})")
            prefix = name + SCOPE_SEP
            taken = c.execute("SELECT COUNT(*) FROM sessions WHERE substr(session_id, 1, ?) = ? AND "
                              "(user_id IS NULL OR user_id != ?)", (len(prefix), prefix, name)).fetchone()[0]
            if taken:
                raise UserError("exists", f"{taken} session(s) named {name + SCOPE_SEP + '...'!r} were recorded "
                                f"without user {name!r} (by the shared client key); a user {name!r} could not "
                                "record into them: choose another name")
            c.execute("INSERT INTO users(user_id, key_hash, created_at) VALUES(?,?,?)",
                      (name, hash_key(key), self.store.clock.now()))
        return key

    def all(self) -> list[UserRow]:
        with self.store.read() as c:
            rows = c.execute("SELECT user_id, created_at, revoked_at FROM users ORDER BY user_id").fetchall()
        return [UserRow(str(r[0]), float(r[1]), r[2]) for r in rows]

    def get(self, name: str) -> UserRow | None:
        with self.store.read() as c:
            r = c.execute("SELECT user_id, created_at, revoked_at FROM users WHERE user_id=?", (name,)).fetchone()
        return None if r is None else UserRow(str(r[0]), float(r[1]), r[2])

    def revoke(self, name: str) -> UserRow:
        """Revoke the user's key (its data stays); revoking twice is a no-op. Durable: a power loss
        never brings the key back."""
        with self.store.write(durable=True) as c:
            cur = c.execute("UPDATE users SET key_hash=NULL, revoked_at=? WHERE user_id=? AND revoked_at IS NULL",
                            (self.store.clock.now(), name))
            if cur.rowcount == 0 and c.execute("SELECT 1 FROM users WHERE user_id=?", (name,)).fetchone() is None:
                raise UserError("unknown", f"unknown user {name!r}")
        row = self.get(name)
        assert row is not None
        return row

    def user_for_key(self, key: str) -> str | None:
        """The active user whose key this is, if any."""
        with self.store.read() as c:
            r = c.execute("SELECT user_id FROM users WHERE key_hash=?", (hash_key(key),)).fetchone()
        return None if r is None else str(r[0])

    def is_revoked(self, name: str) -> bool:
        row = self.get(name)
        return row is not None and not row.active

    def session_owner(self, session_id: str) -> tuple[bool, str | None]:
        """(whether the session exists, its user): from memory when known (`Store.owners`)."""
        known, owner = self.store.owners.get(session_id)
        if known:
            return True, owner
        with self.store.read() as c:
            r = c.execute("SELECT user_id FROM sessions WHERE session_id=?", (session_id,)).fetchone()
        if r is None:
            return False, None
        self.store.owners.put(session_id, r[0])
        return True, r[0]

    def namespace_user(self, session_id: str) -> str | None:
        """The existing user whose namespace `session_id` is in (`clawbridge.store.owners.namespace_user`)."""
        if namespace_of(session_id) is None:
            return None
        with self.store.read() as c:
            return namespace_user(c, session_id)

    # ------------------------------------------------------------------ counts
    def stats(self) -> list[dict[str, Any]]:
        """Per user (every user row, and any user named on sessions only): sessions, turns, main
        turns waiting to train (ok main turns not consumed by a step nor dropped), rewards and
        their mean. Sessions without a user are the row with `user` None."""
        with self.store.read() as c:
            rows = c.execute(
                "SELECT s.user_id, COUNT(DISTINCT s.session_id), "
                "SUM(s.status='active'), "
                "(SELECT COUNT(*) FROM turns t JOIN sessions s2 ON s2.session_id=t.session_id "
                " WHERE s2.user_id IS s.user_id), "
                "(SELECT COUNT(*) FROM turns t JOIN sessions s2 ON s2.session_id=t.session_id "
                " LEFT JOIN samples sa ON sa.turn_id=t.turn_id WHERE s2.user_id IS s.user_id "
                " AND t.turn_type='main' AND t.status='ok' AND sa.consumed_step IS NULL AND sa.dropped_reason IS NULL), "
                "(SELECT COUNT(*) FROM rewards r JOIN sessions s2 ON s2.session_id=r.session_id "
                " WHERE s2.user_id IS s.user_id), "
                "(SELECT AVG(r.value) FROM rewards r JOIN sessions s2 ON s2.session_id=r.session_id "
                " WHERE s2.user_id IS s.user_id) "
                "FROM sessions s GROUP BY s.user_id"
            ).fetchall()
        counted = {r[0]: r for r in rows}
        out: list[dict[str, Any]] = []
        users = {u.user: u for u in self.all()}
        for name in sorted(set(users) | {k for k in counted if k is not None}) + ([None] if None in counted else []):
            r = counted.get(name)
            u = users.get(name) if name is not None else None
            out.append({
                "user": name,
                "status": None if name is None else ("active" if u is None or u.active else "revoked"),
                "sessions": int(r[1]) if r else 0,
                "active_sessions": int(r[2] or 0) if r else 0,
                "turns": int(r[3]) if r else 0,
                "pending_turns": int(r[4]) if r else 0,
                "rewards": int(r[5]) if r else 0,
                "mean_reward": None if r is None or r[6] is None else float(r[6]),
            })
        return out

    # ------------------------------------------------------------------ forget
    def require_known(self, name: str) -> None:
        """`UserError` unless `name` is a valid name that was added or has sessions (what `forget` takes)."""
        check_user_name(name)
        with self.store.read() as c:
            _require_known(c, name)

    def begin_forget(self, name: str) -> int:
        """Revoke `name` (a revoked row for a name that had none, so a trusted `X-User-Id` naming it
        is refused too) and mark her grave: no turn of hers is recorded from now on. Returns the
        forget epoch: calls that began before it may still be running (module invariants)."""
        check_user_name(name)
        now = self.store.clock.now()
        with self.store.write(durable=True) as c:
            _require_known(c, name)
            c.execute("INSERT INTO users(user_id, key_hash, created_at, revoked_at) VALUES(?, NULL, ?, ?) "
                      "ON CONFLICT(user_id) DO UPDATE SET key_hash=NULL, revoked_at=COALESCE(revoked_at, ?)",
                      (name, now, now, now))
        return self.store.tombstones.bury(name)

    def forget(self, name: str) -> ForgetReport:
        """Delete the user and every row of its sessions (see the module invariants), then vacuum.
        Called alone (no `begin_forget` before), it marks the grave itself. When it fails the grave
        stays open (no turn of hers is recorded) until a forget succeeds."""
        check_user_name(name)
        if not self.store.tombstones.refuses(name, None):  # no `begin_forget` before
            self.require_known(name)
            self.store.tombstones.bury(name)
        deleted: dict[str, int] = {}
        with self.store.write(durable=True) as c:
            _require_known(c, name)
            self._delete(c, name, deleted)
        self.store.tombstones.buried(name)  # calls that began before now stay refused; new ones may begin
        self.store.owners.clear()  # committed: none of the user's sessions exists any more
        truncated = self.store.vacuum()
        return ForgetReport(name, {k: v for k, v in deleted.items() if v}, truncated)

    @staticmethod
    def _delete(c: Any, name: str, deleted: dict[str, int]) -> None:
        """The statements of `forget`, inside its transaction; rows deleted per table into `deleted`."""
        sessions = "SELECT session_id FROM sessions WHERE user_id=?"
        turns = f"SELECT turn_id FROM turns WHERE session_id IN ({sessions})"
        deleted["promotion_figures"] = scrub_items(c, {str(r[0]) for r in c.execute(turns, (name,))})
        tables = [str(r[0]) for r in c.execute(
            "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%' ORDER BY name")]
        for table in tables:
            if table in _KEEP_TABLES:
                continue
            cols = {str(r[1]) for r in c.execute(f'PRAGMA table_info("{table}")')}
            conditions: list[str] = []
            if "session_id" in cols:
                conditions.append(f"session_id IN ({sessions})")
            if "turn_id" in cols:  # a row may name a turn of the user under another session id
                conditions.append(f"turn_id IN ({turns})")
            if "user_id" in cols:  # a row of hers that names no turn (a note she wrote by hand)
                conditions.append("user_id = ?")
            if not conditions:
                continue
            where = " OR ".join(conditions)
            deleted[table] = c.execute(f'DELETE FROM "{table}" WHERE {where}', [name] * len(conditions)).rowcount
        deleted["turns"] = c.execute(f"DELETE FROM turns WHERE session_id IN ({sessions})", (name,)).rowcount
        deleted["sessions"] = c.execute("DELETE FROM sessions WHERE user_id=?", (name,)).rowcount
        deleted["users"] = c.execute("DELETE FROM users WHERE user_id=?", (name,)).rowcount


def _require_known(c: Any, name: str) -> None:
    known = c.execute("SELECT 1 FROM users WHERE user_id=?", (name,)).fetchone() is not None
    if not known and c.execute("SELECT 1 FROM sessions WHERE user_id=?", (name,)).fetchone() is None:
        raise UserError("unknown", f"unknown user {name!r}")
