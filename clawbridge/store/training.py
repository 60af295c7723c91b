"""The trainer's view of the store: samples, steps and the traces advantages are computed from.

Operates on a `Store` through its `write()` (one BEGIN IMMEDIATE ... COMMIT transaction) and
`read()` seam, so it shares the Store's thread safety and clock and never changes its own methods.

Invariants:
- When a turn becomes trainable: once its session has ENDED (any end reason), `ingest_ended`
  inserts one `samples` row per ok main turn, with the turn's policy_version. Side turns and
  cancelled/errored turns never get a sample. Ingestion is idempotent (`INSERT OR IGNORE` on the
  turn id), so rescanning is always safe.
- A noted turn whose answer echoed its note (`meta.notes_echoed`) becomes a sample already dropped
  as `echoed_note` (`clawbridge.rewards.notes`): it is counted, never trained.
- A sample is READY when it is unconsumed, not dropped, its session is (still) ended and has at
  least one reward (turn-level or session-level). Samples of sessions that stay unrewarded for
  `reward_wait_s` after ending are dropped with reason `no_reward`.
- Exactly-once in the store: `commit_step` records the step as ok AND sets `consumed_step` on its
  samples in ONE transaction, and refuses (rolls back) if any sample was already consumed or
  dropped. A failed, cancelled or killed step leaves its samples untouched; a `running` row left by
  a killed process is marked failed by `recover_interrupted`.
- A task is UNSETTLED (`unsettled_tasks`) while one of its sessions is active or has pending
  samples that are not READY; its READY samples may still wait for the rest of their group.
- With `wait_for_judge` (a judge is configured), a sample is READY only once the judge has also
  finished its session (`reward_sessions`, see `clawbridge.store.rewards`), and `no_reward` drops
  wait for that too. Judge verdicts (rewards with source `judge`) are NOT part of `SessionTrace`:
  the trainer reads them from `judgements` and combines them with the explicit rewards it sees here.
- Lanes (per-user adapters, `clawbridge.trainer.lanes`): a `TrainingStore` bound to a lane
  (`lane` not None) sees as ready only the samples of that lane's user ('' : sessions without a
  user), begins its steps in that lane, and lists and recovers only that lane's steps; so a step
  never mixes two users' turns and one lane's restart never touches another lane's running step.
  Unbound (`lane=None`, per-user adapters off) it sees everything, as before lanes existed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from clawbridge.store.counters import take
from clawbridge.store.notes import ECHO_DROP, ECHO_META
from clawbridge.store.store import Store, StoreError
from clawbridge.store.turns import StoredTurn, decode_turn
from clawbridge.store.versions import commit_in

INGEST_MARGIN_S = 60.0
"""Sessions ended up to this long before the last watermark are rescanned (out-of-order commits)."""

INTERRUPTED_ERROR = "interrupted: the process ended during this step; its samples stay for the next step"


@dataclass(frozen=True)
class PendingSample:
    """A ready sample with what batching needs (no token blobs)."""

    turn_id: str
    session_id: str
    seq: int
    """The turn's position in its session."""
    policy_version: int
    """The version that sampled the turn."""
    task_id: str | None
    """The session's task id: the group id for group baselines."""
    source: str
    """How the session was resolved (header, session_key, ...): the running-mean key without a task."""
    completion_tokens: int
    created_at: float
    user_id: str | None = None
    """The session's user (`clawbridge.store.users`): per-user adapters batch one user at a time."""


@dataclass(frozen=True)
class TraceTurn:
    """One ok turn of a session, for reward bookkeeping."""

    turn_id: str
    seq: int
    trainable: bool
    """A main turn with status ok (the only kind that becomes a datum)."""
    reward: float | None
    """The latest turn-level reward, if any."""


@dataclass(frozen=True)
class SessionTrace:
    """A session's ok turns in order, with its rewards."""

    session_id: str
    task_id: str | None
    source: str
    turns: tuple[TraceTurn, ...]
    session_reward: float | None
    """The latest session-level reward (`/rl/set_session_reward`), if any."""


@dataclass(frozen=True)
class StepRow:
    """One row of `steps`."""

    step: int
    policy_version: int | None
    status: str
    """running | ok | failed"""
    metrics: dict[str, Any]
    error: str | None
    started_at: float
    finished_at: float | None
    samples: int = 0
    """How many samples this step consumed (0 unless ok)."""
    lane: str = ""
    """The trainer lane that ran it ('' the shared policy, else the user whose adapter it trained)."""


class TrainingStore:
    """Samples and steps on a `Store`'s connection."""

    def __init__(self, store: Store, wait_for_judge: bool = False, lane: str | None = None) -> None:
        self.store = store
        self.lane = lane
        """The lane whose samples and steps this view trains (module invariants); None: all."""
        self.wait_for_judge = wait_for_judge
        """Samples become ready only after the judge finished their session."""
        self._judged = (
            " AND EXISTS (SELECT 1 FROM reward_sessions rs WHERE rs.session_id = {0}.session_id)"
            if wait_for_judge else ""
        )

    # ------------------------------------------------------------------ samples
    def ingest_ended(self, since: float = 0.0) -> tuple[int, float]:
        """Insert samples for ok main turns of sessions ended at or after `since - INGEST_MARGIN_S`.

        Returns (rows inserted, the new watermark to pass next time)."""
        now = self.store.clock.now()
        with self.store.write() as c:
            row = c.execute("SELECT MAX(ended_at) FROM sessions WHERE status='ended'").fetchone()
            watermark = max(since, float(row[0])) if row[0] is not None else since
            cur = c.execute(
                "INSERT OR IGNORE INTO samples(turn_id, session_id, policy_version, created_at, dropped_reason) "
                "SELECT t.turn_id, t.session_id, t.policy_version, ?, "
                f"CASE WHEN json_extract(t.meta_json, '$.{ECHO_META}') THEN ? END FROM sessions s "
                "JOIN turns t ON t.session_id = s.session_id "
                "WHERE s.status='ended' AND s.ended_at >= ? AND t.turn_type='main' AND t.status='ok'",
                (now, ECHO_DROP, since - INGEST_MARGIN_S if since > 0 else float("-inf")),
            )
            return cur.rowcount, watermark

    def ready_samples(self, every_lane: bool = False) -> list[PendingSample]:
        """READY samples (see the module invariants), oldest first, a session's turns in order: of
        this view's lane, or of every lane with `every_lane`."""
        with self.store.read() as c:
            rows = c.execute(
                "SELECT sa.turn_id, sa.session_id, t.seq, sa.policy_version, s.task_id, s.source, "
                "t.completion_tokens, sa.created_at, s.user_id FROM samples sa "
                "JOIN turns t ON t.turn_id = sa.turn_id JOIN sessions s ON s.session_id = sa.session_id "
                "WHERE sa.consumed_step IS NULL AND sa.dropped_reason IS NULL AND s.status='ended' "
                "AND EXISTS (SELECT 1 FROM rewards r WHERE r.session_id = sa.session_id) "
                + self._judged.format("sa")
                + " ORDER BY sa.created_at, s.ended_at, sa.session_id, t.seq"
            ).fetchall()
        lane = None if every_lane else self.lane
        return [
            PendingSample(str(r[0]), str(r[1]), int(r[2]), int(r[3]), r[4], str(r[5]), int(r[6]), float(r[7]), r[8])
            for r in rows if lane is None or (r[8] or "") == lane
        ]

    def unsettled_tasks(self) -> set[str]:
        """Task ids with a session that may still add a sample to its group: a session still active,
        or an ended one whose pending samples are not READY yet (no reward, or the judge has not
        finished it). A group baseline compares a task's sessions with each other, so the trainer
        holds a task's ready samples while it is unsettled (`clawbridge.trainer.loop`)."""
        with self.store.read() as c:
            rows = c.execute(
                "SELECT DISTINCT task_id FROM sessions WHERE status='active' AND task_id IS NOT NULL "
                "UNION SELECT DISTINCT s.task_id FROM samples sa JOIN sessions s ON s.session_id = sa.session_id "
                "WHERE sa.consumed_step IS NULL AND sa.dropped_reason IS NULL AND s.task_id IS NOT NULL "
                "AND NOT (EXISTS (SELECT 1 FROM rewards r WHERE r.session_id = sa.session_id)"
                + self._judged.format("sa") + ")"
            ).fetchall()
        return {str(r[0]) for r in rows}

    def drop_samples(self, turn_ids: Iterable[str], reason: str) -> int:
        """Mark unconsumed samples dropped; returns how many changed."""
        ids = list(turn_ids)
        with self.store.write() as c:
            return sum(
                c.execute(
                    "UPDATE samples SET dropped_reason=? WHERE turn_id=? AND consumed_step IS NULL "
                    "AND dropped_reason IS NULL",
                    (reason, tid),
                ).rowcount
                for tid in ids
            )

    def drop_unrewarded(self, wait_s: float) -> int:
        """Drop (`no_reward`) pending samples of sessions ended over `wait_s` ago without any reward."""
        cutoff = self.store.clock.now() - wait_s
        with self.store.write() as c:
            return c.execute(
                "UPDATE samples SET dropped_reason='no_reward' WHERE consumed_step IS NULL AND dropped_reason IS NULL "
                "AND session_id IN (SELECT session_id FROM sessions WHERE status='ended' AND ended_at < ?) "
                "AND NOT EXISTS (SELECT 1 FROM rewards r WHERE r.session_id = samples.session_id)"
                + self._judged.format("samples"),
                (cutoff,),
            ).rowcount

    def session_traces(self, session_ids: Iterable[str]) -> dict[str, SessionTrace]:
        """Each session's ok turns (main and side) in order, with the latest reward per turn."""
        out: dict[str, SessionTrace] = {}
        with self.store.read() as c:
            for sid in dict.fromkeys(session_ids):
                s = c.execute("SELECT task_id, source FROM sessions WHERE session_id=?", (sid,)).fetchone()
                if s is None:
                    raise StoreError(f"unknown session {sid!r}")
                turns = c.execute(
                    "SELECT turn_id, seq, turn_type FROM turns WHERE session_id=? AND status='ok' ORDER BY seq",
                    (sid,),
                ).fetchall()
                latest_turn: dict[str, float] = {}
                session_reward: float | None = None
                for r in c.execute(
                    "SELECT turn_id, value FROM rewards WHERE session_id=? AND source != 'judge' ORDER BY reward_id",
                    (sid,),
                ).fetchall():
                    if r[0] is None:
                        session_reward = float(r[1])
                    else:
                        latest_turn[str(r[0])] = float(r[1])
                out[sid] = SessionTrace(
                    session_id=sid,
                    task_id=s[0],
                    source=str(s[1]),
                    turns=tuple(
                        TraceTurn(str(t[0]), int(t[1]), t[2] == "main", latest_turn.get(str(t[0])))
                        for t in turns
                    ),
                    session_reward=session_reward,
                )
        return out

    def turn_tokens(self, turn_ids: Sequence[str]) -> dict[str, StoredTurn]:
        """The turns a batch is built from: prompt ids, completion ids and logprobs exactly as recorded."""
        out: dict[str, StoredTurn] = {}
        with self.store.read() as c:
            for tid in turn_ids:
                r = c.execute("SELECT * FROM turns WHERE turn_id=?", (tid,)).fetchone()
                if r is None:
                    raise StoreError(f"unknown turn {tid!r}")
                out[tid] = decode_turn(r)
        return out

    def backlog(self, since: float = 0.0) -> int:
        """Datums on their way to the trainer: unconsumed, undropped samples; ok main turns of
        sessions ended at or after `since - INGEST_MARGIN_S` that are not samples yet; and, for
        every active session, its ok main turns (at least 1: a started session will bring one)."""
        with self.store.read() as c:
            pending = c.execute(
                "SELECT COUNT(*) FROM samples WHERE consumed_step IS NULL AND dropped_reason IS NULL"
            ).fetchone()[0]
            not_ingested = c.execute(
                "SELECT COUNT(*) FROM sessions s JOIN turns t ON t.session_id = s.session_id "
                "WHERE s.status='ended' AND s.ended_at >= ? AND t.turn_type='main' AND t.status='ok' "
                "AND NOT EXISTS (SELECT 1 FROM samples sa WHERE sa.turn_id = t.turn_id)",
                (since - INGEST_MARGIN_S if since > 0 else float("-inf"),),
            ).fetchone()[0]
            active = c.execute(
                "SELECT COALESCE(SUM(MAX(1, (SELECT COUNT(*) FROM turns t WHERE t.session_id = s.session_id "
                "AND t.turn_type='main' AND t.status='ok'))), 0) FROM sessions s WHERE s.status='active'"
            ).fetchone()[0]
        return int(pending) + int(not_ingested) + int(active)

    def waiting(self, reward_wait_s: float, batch_size: int) -> dict[str, Any]:
        """What training waits for (`clawbridge status`): turns of sessions still active (they
        become trainable when the session ends), turns of ended sessions without any reward yet and
        when the first of them will be dropped, sessions the judge has not finished, and how many
        more ready datums the next step needs."""
        with self.store.read() as c:
            active = c.execute(
                "SELECT COUNT(DISTINCT s.session_id), COUNT(t.turn_id) FROM sessions s LEFT JOIN turns t "
                "ON t.session_id = s.session_id AND t.turn_type='main' AND t.status='ok' WHERE s.status='active'"
            ).fetchone()
            unrewarded = c.execute(
                "SELECT COUNT(*), MIN(s.ended_at) FROM turns t JOIN sessions s ON s.session_id = t.session_id "
                "LEFT JOIN samples sa ON sa.turn_id = t.turn_id WHERE s.status='ended' AND t.turn_type='main' "
                "AND t.status='ok' AND (sa.turn_id IS NULL OR (sa.consumed_step IS NULL AND sa.dropped_reason IS NULL)) "
                "AND NOT EXISTS (SELECT 1 FROM rewards r WHERE r.session_id = s.session_id)"
            ).fetchone()
            judge = 0
            if self.wait_for_judge:
                judge = c.execute(
                    "SELECT COUNT(DISTINCT sa.session_id) FROM samples sa WHERE sa.consumed_step IS NULL "
                    "AND sa.dropped_reason IS NULL AND NOT EXISTS (SELECT 1 FROM reward_sessions rs "
                    "WHERE rs.session_id = sa.session_id)"
                ).fetchone()[0]
        ready = len(self.ready_samples(every_lane=True))
        return {
            "active_sessions": int(active[0]),
            "active_session_turns": int(active[1]),
            "unrewarded_turns": int(unrewarded[0]),
            "first_unrewarded_drop_at": None if unrewarded[1] is None else float(unrewarded[1]) + reward_wait_s,
            "sessions_waiting_for_judge": int(judge),
            "ready_datums": ready,
            "datums_until_next_step": max(0, batch_size - ready),
        }

    # ------------------------------------------------------------------ steps
    def recover_interrupted(self) -> int:
        """Mark steps left `running` by a killed process as failed; their samples stay unconsumed."""
        with self.store.write() as c:
            return c.execute(
                "UPDATE steps SET status='failed', error=?, finished_at=? WHERE status='running'"
                + ("" if self.lane is None else " AND lane=?"),
                (INTERRUPTED_ERROR, self.store.clock.now(), *(() if self.lane is None else (self.lane,))),
            ).rowcount

    def begin_step(self) -> int:
        """Insert a `running` step row; returns its step number (committed durably: reports name it)."""
        with self.store.write(durable=True) as c:
            step = take(c, "step")  # never a number given before, even if its row was deleted (a forget)
            c.execute("INSERT INTO steps(step, status, started_at, lane) VALUES(?, 'running', ?, ?)",
                      (step, self.store.clock.now(), self.lane or ""))
            return step

    def commit_step(
        self,
        step: int,
        policy_version: int,
        metrics: dict[str, Any],
        turn_ids: Sequence[str],
        checkpoint: str | None = None,
        identity: dict[str, Any] | None = None,
    ) -> None:
        """In ONE transaction: the step becomes ok with its metrics, version and checkpoint, its
        samples are consumed by it, and (with a checkpoint) its reserved policy version becomes
        committed (`clawbridge.store.versions`). Raises StoreError (nothing written) if a sample is
        not pending or the version is not reserved. Durable: the checkpoint it names is already
        flushed (`clawbridge.runtime.durable`), and after a power loss the store says no less."""
        with self.store.write(durable=True) as c:
            if checkpoint is not None:
                commit_in(c, policy_version, checkpoint, identity, self.store.clock.now())
            changed = 0
            for tid in turn_ids:
                changed += c.execute(
                    "UPDATE samples SET consumed_step=? WHERE turn_id=? AND consumed_step IS NULL "
                    "AND dropped_reason IS NULL",
                    (step, tid),
                ).rowcount
            if changed != len(set(turn_ids)):
                raise StoreError(
                    f"step {step}: {len(set(turn_ids)) - changed} sample(s) were no longer pending"
                )
            cur = c.execute(
                "UPDATE steps SET status='ok', policy_version=?, metrics_json=?, error=NULL, finished_at=?, "
                "checkpoint=? WHERE step=? AND status='running'",
                (policy_version, json.dumps(metrics), self.store.clock.now(), checkpoint, step),
            )
            if cur.rowcount != 1:
                raise StoreError(f"step {step} is not running")

    def fail_step(self, step: int, error: str, metrics: dict[str, Any] | None = None) -> None:
        """Record the step as failed with its error; its samples are not touched."""
        with self.store.write() as c:
            c.execute(
                "UPDATE steps SET status='failed', error=?, metrics_json=?, finished_at=? WHERE step=?",
                (error[:4000], json.dumps(metrics) if metrics else None, self.store.clock.now(), step),
            )

    def steps(self, limit: int = 20) -> list[StepRow]:
        """Newest first, with how many samples each consumed."""
        return self._select_steps("ORDER BY st.step DESC LIMIT ?", (limit,))

    def step_counts_by_lane(self) -> dict[str, dict[str, int]]:
        """Steps per lane and status (`{lane: {"ok": n, "failed": n, ...}}`), every lane in one read."""
        with self.store.read() as c:
            rows = c.execute("SELECT lane, status, COUNT(*) FROM steps GROUP BY lane, status").fetchall()
        out: dict[str, dict[str, int]] = {}
        for lane, status, n in rows:
            out.setdefault(str(lane), {})[str(status)] = int(n)
        return out

    def lane_steps(self, limit: int = 20) -> list[StepRow]:
        """This view's lane's steps, newest first (all steps when unbound)."""
        if self.lane is None:
            return self.steps(limit)
        return self._select_steps("WHERE st.lane=? ORDER BY st.step DESC LIMIT ?", (self.lane, limit))

    def last_error(self) -> StepRow | None:
        """The most recent failed step, if any."""
        rows = self._select_steps("WHERE st.status='failed' ORDER BY st.step DESC LIMIT 1", ())
        return rows[0] if rows else None

    def _select_steps(self, tail: str, args: tuple[Any, ...]) -> list[StepRow]:
        with self.store.read() as c:
            rows = c.execute(
                "SELECT st.*, (SELECT COUNT(*) FROM samples sa WHERE sa.consumed_step = st.step) AS n "
                f"FROM steps st {tail}",
                args,
            ).fetchall()
        return [
            StepRow(
                step=int(r["step"]),
                policy_version=r["policy_version"],
                status=str(r["status"]),
                metrics=json.loads(r["metrics_json"]) if r["metrics_json"] else {},
                error=r["error"],
                started_at=float(r["started_at"]),
                finished_at=r["finished_at"],
                samples=int(r["n"]),
                lane=str(r["lane"]),
            )
            for r in rows
        ]

    def training_stats(self, recent: int = 10) -> dict[str, Any]:
        """The trainer section of `clawbridge status`: sample counts, step counts, recent steps,
        the last error."""
        with self.store.read() as c:
            consumed = c.execute("SELECT COUNT(*) FROM samples WHERE consumed_step IS NOT NULL").fetchone()[0]
            pending = c.execute(
                "SELECT COUNT(*) FROM samples WHERE consumed_step IS NULL AND dropped_reason IS NULL"
            ).fetchone()[0]
            dropped = dict(
                c.execute(
                    "SELECT dropped_reason, COUNT(*) FROM samples WHERE dropped_reason IS NOT NULL "
                    "GROUP BY dropped_reason"
                ).fetchall()
            )
            steps = dict(c.execute("SELECT status, COUNT(*) FROM steps GROUP BY status").fetchall())
        last_error = self.last_error()
        return {
            "samples": {"pending": pending, "consumed": consumed, "dropped": dropped},
            "steps": {
                "ok": steps.get("ok", 0),
                "failed": steps.get("failed", 0),
                "running": steps.get("running", 0),
            },
            "recent_steps": [_step_dict(s) for s in self.steps(recent)],
            "last_error": None if last_error is None else _step_dict(last_error),
        }


def _step_dict(s: StepRow) -> dict[str, Any]:
    return {
        "step": s.step,
        "lane": s.lane,
        "status": s.status,
        "policy_version": s.policy_version,
        "samples": s.samples,
        "metrics": s.metrics,
        "error": s.error,
        "started_at": s.started_at,
        "finished_at": s.finished_at,
    }
