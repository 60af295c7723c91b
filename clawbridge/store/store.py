"""The store: the only state shared by the proxy, rewards and the trainer (SQLite, WAL).

Invariants:
- Every method that writes commits before it returns; the proxy awaits `record_turn` before it
  sends the last byte of a response, so an answered turn survives `kill -9` (WAL with
  synchronous=NORMAL is durable against process crashes). A power loss may roll the store back to
  an earlier commit, never to a torn one; the commits something outside the store acts on (a
  version number reserved, a step or version committed with its checkpoint) are `write(durable=True)`:
  flushed before they return, with every commit before them. WAL checkpoints run inside a commit
  (SQLite's default) or, once `checkpoint_in_background` is called (the proxy's store writer),
  on a thread of their own (`clawbridge.store.walcheckpoint`), never inside a commit.
- One `Store` object is safe to share between threads (a lock serialises use of its connection);
  the repositories beside it (`training`, `rewards`, `versions`, `observe`) reach the connection
  only through `write()` (one committed transaction) and `read()`, never its private fields.
  Other processes (the CLI) open their own `Store` on the same file: WAL lets them read while the
  server writes.
- Secrets are never stored: session keys and user keys are kept as their sha256.
- A session belongs to at most one user (`sessions.user_id`, set when the session is created and
  never changed); every turn, reward and sample of the session is that user's (`clawbridge.store.users`).
  Every write that adds to or creates a session checks its owner in its own transaction
  (`clawbridge.store.owners.check_session_write`).
- A turn of a user who was forgotten after its call began, or is being forgotten, is never written
  (`tombstones`, `clawbridge.store.tombstones`): a late turn cannot bring a forgotten user back.
- Deleted rows leave no bytes behind: `secure_delete` is on, and `vacuum()` rebuilds the file and
  truncates the WAL (how `clawbridge users forget` makes sure nothing of a user remains).
- Timestamps come from `Store.clock` (`clawbridge.runtime.clock`), so a test can move time instead of waiting.
- The file (and so its -wal and -shm) is created 0600; see `health` for the checks made before a
  server uses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawbridge.runtime.clock import SYSTEM_CLOCK, Clock
from clawbridge.store.codec import encode_floats, encode_ids
from clawbridge.store.files import DB_FILENAME, create_private
from clawbridge.store.lifecycle import DefaultReward, end_in
from clawbridge.store.owners import SessionOwnerError, SessionOwners, check_session_write
from clawbridge.store.schema import MIGRATIONS, SCHEMA_VERSION
from clawbridge.store.tombstones import Tombstones
from clawbridge.store.turns import TurnRecord, decode_turn, new_id
from clawbridge.store.walcheckpoint import DEFAULT_AUTOCHECKPOINT_PAGES, WalCheckpointer


class StoreError(Exception):
    """A request the store cannot satisfy (unknown session or turn)."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class SessionRow:
    """One session as stored."""

    session_id: str
    task_id: str | None
    source: str
    status: str
    end_reason: str | None
    created_at: float
    updated_at: float
    ended_at: float | None
    turn_count: int = 0
    user_id: str | None = None
    """The user whose key made the session (None: the shared client key or the admin key)."""


@dataclass(frozen=True)
class RewardRow:
    reward_id: int
    session_id: str
    turn_id: str | None
    value: float
    source: str
    created_at: float


class Store:
    """Typed access to the SQLite file in the state dir."""

    def __init__(self, path: Path, clock: Clock = SYSTEM_CLOCK) -> None:
        self.path = path
        self.clock = clock
        """Stamps every row; the trainer, the reward worker and the reaper measure elapsed time on it."""
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        create_private(path)  # SQLite would create it 0644; its -wal and -shm copy this mode
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30.0)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        self.owners = SessionOwners()
        """Committed sessions' owners, kept in memory (`clawbridge.store.owners`)."""
        self.tombstones = Tombstones()
        """Users being forgotten, and since when calls of theirs may not record (`clawbridge.store.tombstones`)."""
        self._checkpointer: WalCheckpointer | None = None
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._conn.execute("PRAGMA busy_timeout=30000")
        self._conn.execute("PRAGMA secure_delete=ON")  # a deleted row's bytes are overwritten, not left free
        self._migrate()

    @classmethod
    def open(cls, state_dir: Path, clock: Clock = SYSTEM_CLOCK) -> Store:
        return cls(state_dir / DB_FILENAME, clock)

    def close(self) -> None:
        self.checkpoint_on_commit()
        with self._lock:
            self._conn.close()

    def checkpoint_in_background(self) -> None:
        """WAL checkpoints on a thread of their own from now on (`clawbridge.store.walcheckpoint`):
        for a process that commits often and cannot wait (the proxy's store writer)."""
        with self._lock:
            if self._checkpointer is None:
                self._conn.execute("PRAGMA wal_autocheckpoint=0")
                self._checkpointer = WalCheckpointer(self.path)

    def checkpoint_on_commit(self) -> None:
        """Back to SQLite's default (the committing connection checkpoints), after a last
        background checkpoint."""
        with self._lock:
            checkpointer, self._checkpointer = self._checkpointer, None
            if checkpointer is not None:
                self._conn.execute(f"PRAGMA wal_autocheckpoint={DEFAULT_AUTOCHECKPOINT_PAGES}")
        if checkpointer is not None:
            checkpointer.stop()

    # ------------------------------------------------------------------ the seam for repositories
    @contextlib.contextmanager
    def write(self, durable: bool = False) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE ... COMMIT) on the connection, under the lock.

        Committed when the block ends; rolled back (nothing written) when it raises. Every write of
        this store and of its repositories (`training`, `rewards`, `versions`) goes through here.
        `durable`: the commit flushes the WAL to the disk before it returns (synchronous=FULL for
        this one transaction), so it survives a power loss too, with every commit before it; for
        what something outside the store acts on (a version number, a checkpoint committed)."""
        with self._lock:
            if durable:
                self._conn.execute("PRAGMA synchronous=FULL")
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self._conn
                except BaseException:
                    if self._conn.in_transaction:  # SQLite already rolled back on SQLITE_FULL / IOERR
                        self._conn.execute("ROLLBACK")
                    raise
                self._conn.execute("COMMIT")
            finally:
                if durable:
                    self._conn.execute("PRAGMA synchronous=NORMAL")
            if self._checkpointer is not None:
                self._checkpointer.committed()

    def vacuum(self) -> bool:
        """Rebuild the file without free pages and truncate the WAL, so deleted rows leave no bytes
        in either. Holds the lock (writes wait) for as long as the rebuild takes. Returns whether
        the WAL was truncated (False when another connection's open read kept it)."""
        checkpointer = self._checkpointer
        with self._lock, checkpointer.lock if checkpointer is not None else contextlib.nullcontext():
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._conn.execute("VACUUM")
            busy = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        return int(busy) == 0

    @contextlib.contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """The connection for reads (rows are `sqlite3.Row`), under the lock. Do not write in it:
        a write outside `write()` would commit statement by statement."""
        with self._lock:
            yield self._conn

    def _migrate(self) -> None:
        with self._lock:
            self._conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            row = self._conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            version = int(row[0]) if row else 0
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} has schema version {version}, newer than this clawbridge ({SCHEMA_VERSION}); upgrade"
                )
            for target in range(version, SCHEMA_VERSION):
                with self.write() as c:
                    for stmt in MIGRATIONS[target].split(";"):
                        if stmt.strip():
                            c.execute(stmt)
                    c.execute(
                        "INSERT INTO meta(key, value) VALUES('schema_version', ?) "
                        "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                        (str(target + 1),),
                    )

    @property
    def schema_version(self) -> int:
        with self.read() as c:
            row = c.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        return int(row[0])

    # ------------------------------------------------------------------ sessions
    def ensure_session(self, session_id: str, source: str, task_id: str | None = None,
                       user_id: str | None = None) -> SessionRow:
        """Get the session, creating it for `user_id` (or reopening it if it had ended);
        `SessionOwnerError` when it is another owner's (`clawbridge.store.owners`)."""
        now = self.clock.now()
        with self.write() as c:
            row = check_session_write(c, session_id, user_id)
            if row is None:
                c.execute(
                    "INSERT INTO sessions(session_id, task_id, source, status, created_at, updated_at, user_id) "
                    "VALUES(?,?,?,?,?,?,?)",
                    (session_id, task_id, source, "active", now, now, user_id),
                )
            elif row["status"] != "active":
                c.execute(
                    "UPDATE sessions SET status='active', end_reason=NULL, ended_at=NULL, updated_at=? "
                    "WHERE session_id=?",
                    (now, session_id),
                )
        session = self.get_session(session_id)
        assert session is not None
        return session

    def start_keyed_session(self, key: str, task_id: str | None, user_id: str | None = None,
                            default: DefaultReward | None = None) -> str:
        """Start a session (of `user_id`) reached by `key`; a session already on that key is ended
        first ("replaced", with its `default` reward: `clawbridge.store.lifecycle`), if it is
        `user_id`'s too (else `SessionOwnerError`)."""
        now = self.clock.now()
        kh = hash_key(key)
        session_id = new_id("sess")
        with self.write() as c:
            for replaced, owner in c.execute("SELECT session_id, user_id FROM sessions WHERE key_hash=?",
                                             (kh,)).fetchall():
                if owner != user_id:  # the key would move to another owner: its holder's calls with it
                    raise SessionOwnerError(str(replaced), owner)
                end_in(c, str(replaced), "replaced", default, now)
            c.execute(
                "INSERT INTO sessions(session_id, key_hash, task_id, source, status, created_at, updated_at, "
                "user_id) VALUES(?,?,?,?,?,?,?,?)",
                (session_id, kh, task_id, "session_key", "active", now, now, user_id),
            )
        return session_id

    def session_for_key(self, key: str) -> str | None:
        """The active session started with this session key, if any."""
        with self.read() as c:
            row = c.execute(
                "SELECT session_id FROM sessions WHERE key_hash=? AND status='active'", (hash_key(key),)
            ).fetchone()
        return None if row is None else str(row[0])

    def end_session(self, session_id: str, reason: str, default: DefaultReward | None = None) -> bool:
        """End an active session, with its `default` reward when it is owed one
        (`clawbridge.store.lifecycle`); False when it was unknown or already ended. The server,
        the CLI and the reaper end sessions through `clawbridge.runtime.lifecycle`, which passes `default`."""
        now = self.clock.now()
        with self.write() as c:
            return end_in(c, session_id, reason, default, now)

    def end_idle_sessions(self, idle_s: float, default: DefaultReward | None = None) -> list[str]:
        """End every active session untouched for `idle_s` seconds (as `end_session`); return their ids."""
        now = self.clock.now()
        with self.write() as c:
            rows = c.execute(
                "SELECT session_id FROM sessions WHERE status='active' AND updated_at < ?", (now - idle_s,)
            ).fetchall()
            return [str(r[0]) for r in rows if end_in(c, str(r[0]), "idle", default, now)]

    def get_session(self, session_id: str) -> SessionRow | None:
        with self.read() as c:
            row = c.execute(
                "SELECT s.*, (SELECT COUNT(*) FROM turns t WHERE t.session_id=s.session_id) AS n "
                "FROM sessions s WHERE session_id=?",
                (session_id,),
            ).fetchone()
        return None if row is None else _session_row(row)

    def list_sessions(self, limit: int = 50, offset: int = 0, status: str | None = None,
                      user: str | None = None) -> list[SessionRow]:
        """Newest first; only `user`'s sessions when given."""
        sql = "SELECT s.*, (SELECT COUNT(*) FROM turns t WHERE t.session_id=s.session_id) AS n FROM sessions s"
        where: list[str] = []
        args: list[Any] = []
        if status:
            where.append("status=?")
            args.append(status)
        if user is not None:
            where.append("user_id=?")
            args.append(user)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, session_id LIMIT ? OFFSET ?"
        args += [limit, offset]
        with self.read() as c:
            rows = c.execute(sql, args).fetchall()
        return [_session_row(r) for r in rows]

    # ------------------------------------------------------------------ turns
    def record_turn(self, turn: TurnRecord, session_source: str = "implicit", end_reason: str | None = None) -> str:
        """Insert one turn in one committed transaction: create (or reopen) its session first, and
        end the session afterwards when `end_reason` is given. `UserForgotten` (nothing written)
        for a turn of a user forgotten since its call began."""
        self.tombstones.check(turn.caller or turn.user_id, turn.epoch)
        with self.write() as c:
            created = self._insert_turn(c, turn, session_source, end_reason)
        if created:
            self.owners.put(turn.session_id, turn.user_id)
        return turn.turn_id

    def record_turns(self, turns: Sequence[tuple[TurnRecord, str, str | None]]) -> list[Exception | None]:
        """`record_turn` for each `(turn, session_source, end_reason)`, in order, in ONE committed
        transaction (a group commit: the proxy's writer thread gives it every turn waiting).

        Each turn is its own savepoint: a turn SQLite refuses (say a duplicate id) is rolled back
        alone and its error returned in its slot (None: written). A failure of the transaction
        itself (disk full, I/O error, the commit) raises, and then none of them is written. A turn of
        a user forgotten since its call began gets `UserForgotten` in its slot, unwritten."""
        results: list[Exception | None] = []
        created: list[tuple[str, str | None]] = []
        with self.write() as c:
            for turn, source, end_reason in turns:
                c.execute("SAVEPOINT turn")
                try:
                    self.tombstones.check(turn.caller or turn.user_id, turn.epoch)
                    new = self._insert_turn(c, turn, source, end_reason)
                except Exception as exc:
                    if not c.in_transaction:  # SQLite rolled the whole transaction back (SQLITE_FULL, IOERR)
                        raise
                    c.execute("ROLLBACK TO turn")
                    c.execute("RELEASE turn")
                    results.append(exc)
                    continue
                c.execute("RELEASE turn")
                results.append(None)
                if new:
                    created.append((turn.session_id, turn.user_id))
        for session_id, owner in created:  # committed: the sessions exist with these owners
            self.owners.put(session_id, owner)
        return results

    @staticmethod
    def _insert_turn(c: sqlite3.Connection, turn: TurnRecord, session_source: str, end_reason: str | None) -> bool:
        """The statements of `record_turn`, inside the caller's transaction; whether it created the
        session. `SessionOwnerError` when the session is another owner's (`clawbridge.store.owners`)."""
        row = check_session_write(c, turn.session_id, turn.user_id)
        created = row is None
        if row is None:
            c.execute(
                "INSERT INTO sessions(session_id, task_id, source, status, created_at, updated_at, user_id) "
                "VALUES(?,?,?,?,?,?,?)",
                (turn.session_id, None, session_source, "active", turn.created_at, turn.completed_at, turn.user_id),
            )
        elif row["status"] != "active":
            c.execute(
                "UPDATE sessions SET status='active', end_reason=NULL, ended_at=NULL WHERE session_id=?",
                (turn.session_id,),
            )
        seq = c.execute(
            "SELECT COALESCE(MAX(seq), -1) + 1 FROM turns WHERE session_id=?", (turn.session_id,)
        ).fetchone()[0]
        c.execute(
            "INSERT INTO turns(turn_id, session_id, seq, turn_type, status, model, prompt_token_ids, "
            "completion_token_ids, completion_logprobs, policy_version, finish_reason, request_json, "
            "response_json, meta_json, prompt_tokens, completion_tokens, created_at, first_token_at, "
            "completed_at, train_prompt_token_ids) VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                turn.turn_id,
                turn.session_id,
                seq,
                turn.turn_type,
                turn.status,
                turn.model,
                encode_ids(turn.prompt_token_ids),
                encode_ids(turn.completion_token_ids),
                encode_floats(turn.completion_logprobs),
                turn.policy_version,
                turn.finish_reason,
                turn.request_json,
                turn.response_json,
                json.dumps(turn.meta) if turn.meta else None,
                len(turn.prompt_token_ids),
                len(turn.completion_token_ids),
                turn.created_at,
                turn.first_token_at,
                turn.completed_at,
                None if turn.train_prompt_token_ids is None else encode_ids(turn.train_prompt_token_ids),
            ),
        )
        c.execute("UPDATE sessions SET updated_at=? WHERE session_id=?", (turn.completed_at, turn.session_id))
        if end_reason is not None:
            c.execute(
                "UPDATE sessions SET status='ended', end_reason=?, ended_at=?, key_hash=NULL WHERE session_id=?",
                (end_reason, turn.completed_at, turn.session_id),
            )
        return created

    def last_turn_id(self, session_id: str) -> str | None:
        with self.read() as c:
            row = c.execute(
                "SELECT turn_id FROM turns WHERE session_id=? AND status='ok' ORDER BY seq DESC LIMIT 1",
                (session_id,),
            ).fetchone()
        return None if row is None else str(row[0])

    def turn_session(self, turn_id: str) -> str | None:
        with self.read() as c:
            row = c.execute("SELECT session_id FROM turns WHERE turn_id=?", (turn_id,)).fetchone()
        return None if row is None else str(row[0])

    def session_turns(self, session_id: str) -> list[dict[str, Any]]:
        """The turns of a session in order, decoded (the `show --json` turn shape plus timing)."""
        with self.read() as c:
            rows = c.execute("SELECT * FROM turns WHERE session_id=? ORDER BY seq", (session_id,)).fetchall()
            rewards = c.execute(
                "SELECT turn_id, value FROM rewards WHERE session_id=? AND turn_id IS NOT NULL ORDER BY reward_id",
                (session_id,),
            ).fetchall()
        latest = {str(r["turn_id"]): float(r["value"]) for r in rewards}
        return [decode_turn(r).view(latest.get(str(r["turn_id"]))) for r in rows]

    # ------------------------------------------------------------------ rewards
    def add_reward(self, session_id: str, value: float, source: str, turn_id: str | None = None) -> int:
        """Attach a reward to a turn, or to the whole session when `turn_id` is None."""
        now = self.clock.now()
        with self.write() as c:
            if c.execute("SELECT 1 FROM sessions WHERE session_id=?", (session_id,)).fetchone() is None:
                raise StoreError(f"unknown session {session_id!r}")
            if turn_id is not None:
                row = c.execute("SELECT session_id FROM turns WHERE turn_id=?", (turn_id,)).fetchone()
                if row is None or row[0] != session_id:
                    raise StoreError(f"unknown turn {turn_id!r} in session {session_id!r}")
            cur = c.execute(
                "INSERT INTO rewards(session_id, turn_id, value, source, created_at) VALUES(?,?,?,?,?)",
                (session_id, turn_id, value, source, now),
            )
            c.execute("UPDATE sessions SET updated_at=? WHERE session_id=?", (now, session_id))
            return int(cur.lastrowid or 0)

    def session_rewards(self, session_id: str) -> list[RewardRow]:
        with self.read() as c:
            rows = c.execute(
                "SELECT * FROM rewards WHERE session_id=? ORDER BY reward_id", (session_id,)
            ).fetchall()
        return [
            RewardRow(
                int(r["reward_id"]), str(r["session_id"]), r["turn_id"], float(r["value"]), str(r["source"]),
                float(r["created_at"]),
            )
            for r in rows
        ]

    # ------------------------------------------------------------------ views
    def session_view(self, session_id: str) -> dict[str, Any] | None:
        """The `clawbridge sessions show --json` document."""
        session = self.get_session(session_id)
        if session is None:
            return None
        return {
            "session_id": session.session_id,
            "status": session.status,
            "source": session.source,
            "task_id": session.task_id,
            "user": session.user_id,
            "end_reason": session.end_reason,
            "created_at": session.created_at,
            "ended_at": session.ended_at,
            "turns": self.session_turns(session_id),
            "rewards": [
                {"reward_id": r.reward_id, "turn_id": r.turn_id, "value": r.value, "source": r.source,
                 "created_at": r.created_at}
                for r in self.session_rewards(session_id)
            ],
        }

    def stats(self) -> dict[str, Any]:
        """Counts for `clawbridge status`."""
        with self.read() as c:
            sessions = dict(c.execute("SELECT status, COUNT(*) FROM sessions GROUP BY status").fetchall())
            turns = dict(c.execute("SELECT turn_type, COUNT(*) FROM turns GROUP BY turn_type").fetchall())
            n_rewards = c.execute("SELECT COUNT(*) FROM rewards").fetchone()[0]
            tokens = c.execute(
                "SELECT COALESCE(SUM(prompt_tokens),0), COALESCE(SUM(completion_tokens),0) FROM turns"
            ).fetchone()
            version = c.execute("SELECT MAX(policy_version) FROM turns").fetchone()[0]
            steps = c.execute("SELECT COUNT(*), MAX(policy_version) FROM steps WHERE status='ok'").fetchone()
            last_turn = c.execute("SELECT MAX(completed_at) FROM turns").fetchone()[0]
        return {
            "sessions": {"active": sessions.get("active", 0), "ended": sessions.get("ended", 0)},
            "turns": {"main": turns.get("main", 0), "side": turns.get("side", 0)},
            "rewards": n_rewards,
            "prompt_tokens": tokens[0],
            "completion_tokens": tokens[1],
            "last_recorded_policy_version": version,
            "training_steps": steps[0],
            "last_trained_policy_version": steps[1],
            "last_turn_at": last_turn,
            "size_bytes": self.size_bytes(),
        }

    def size_bytes(self) -> int:
        """Bytes on disk of the store file and its WAL."""
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += Path(f"{self.path}{suffix}").stat().st_size
            except OSError:
                pass
        return total


def _session_row(row: sqlite3.Row) -> SessionRow:
    return SessionRow(
        session_id=str(row["session_id"]),
        task_id=row["task_id"],
        source=str(row["source"]),
        status=str(row["status"]),
        end_reason=row["end_reason"],
        created_at=float(row["created_at"]),
        updated_at=float(row["updated_at"]),
        ended_at=row["ended_at"],
        turn_count=int(row["n"]),
        user_id=row["user_id"],
    )
