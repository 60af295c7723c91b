"""What `clawbridge doctor --learning` reads from the store: the figures behind "is it learning?".

Invariants:
- Read-only: the file is opened with `mode=ro` (never migrated, never written, no lock taken; SQLite
  may create its empty -wal/-shm files beside it, with the store's mode), so it may be read while
  a server runs on it, and reading it changes nothing a server decides.
- "Recent" is the newest `RECENT` rows of each kind (samples that left the queue, judgements,
  votes, rewards, task groups): what holds NOW, not what held once and was mended since.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

RECENT = 50
"""How many of the newest rows of each kind count as "recent"."""


@dataclass(frozen=True)
class LearningFacts:
    """The store's side of the learning diagnosis (`clawbridge.cli.learning`)."""

    now: float
    sessions_active: int
    sessions_ended: int
    main_turns: int
    active_turns: int
    """Main turns of sessions still active (they train only once their session ends)."""
    most_idle_active_s: float | None
    """How long the active session quiet the longest has been quiet (None: none active)."""
    rewards: int
    recent_rewards: list[float]
    """Values of the newest `RECENT` rewards, newest first."""
    groups: int
    """Task groups (sessions sharing a task id, at least two rewarded) among the newest `RECENT`."""
    equal_groups: int
    """Of `groups`, those whose every session was rewarded alike (zero advantage under a group baseline)."""
    unrewarded_turns: int
    """Main turns of ended sessions still waiting, whose session has no reward at all."""
    dropped: dict[str, int]
    """Every sample dropped, by reason."""
    left_queue: dict[str, int]
    """How the newest `RECENT` samples that left the queue left it: `trained` or their drop reason."""
    judgements: dict[str, int]
    """Of the newest `RECENT` judgements: by status (done, failed, running)."""
    verdicts: dict[int, int]
    """Of those done: by verdict (-1, 0 unclear, +1)."""
    votes: int
    vote_errors: int
    """Of the newest `RECENT` judge votes: how many failed (an error, or an answer without a verdict)."""
    last_vote_error: str | None
    steps_ok: int
    steps_failed: int
    recent_steps: list[tuple[int, str, str | None]] = field(default_factory=list)
    """The newest steps, newest first: (step, status, error)."""
    decisions: list[tuple[int, str, str]] = field(default_factory=list)
    """The newest automatic promotion decisions, newest first: (version, verdict, reason)."""


def _one(c: sqlite3.Connection, sql: str, *args: object) -> int:
    return int(c.execute(sql, args).fetchone()[0] or 0)


def learning_facts(db: Path, now: float) -> LearningFacts:
    """The figures of the store at `db` (module invariants); `now` is the wall-clock time."""
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30.0)
    try:
        c.execute("PRAGMA busy_timeout=30000")
        return _read(c, now)
    finally:
        c.close()


def _read(c: sqlite3.Connection, now: float) -> LearningFacts:
    sessions = dict(c.execute("SELECT status, COUNT(*) FROM sessions GROUP BY status").fetchall())
    idle = c.execute(
        "SELECT MIN(COALESCE((SELECT MAX(t.created_at) FROM turns t WHERE t.session_id = s.session_id), s.updated_at)) "
        "FROM sessions s WHERE s.status='active'").fetchone()[0]
    groups = c.execute(
        "SELECT s.task_id, s.session_id, SUM(r.value) FROM sessions s JOIN rewards r ON r.session_id = s.session_id "
        "WHERE s.task_id IS NOT NULL AND s.task_id IN (SELECT task_id FROM sessions WHERE task_id IS NOT NULL "
        "AND status='ended' ORDER BY ended_at DESC LIMIT ?) GROUP BY s.session_id", (RECENT,)).fetchall()
    per_task: dict[str, list[float]] = {}
    for task, _, total in groups:
        per_task.setdefault(str(task), []).append(float(total))
    grouped = [v for v in per_task.values() if len(v) > 1]
    left = c.execute(
        "SELECT CASE WHEN consumed_step IS NOT NULL THEN 'trained' ELSE dropped_reason END, COUNT(*) FROM "
        "(SELECT consumed_step, dropped_reason FROM samples WHERE consumed_step IS NOT NULL OR dropped_reason IS NOT "
        "NULL ORDER BY created_at DESC LIMIT ?) GROUP BY 1", (RECENT,)).fetchall()
    judged = c.execute("SELECT status, score FROM judgements ORDER BY started_at DESC LIMIT ?", (RECENT,)).fetchall()
    judgements: dict[str, int] = {}
    verdicts: dict[int, int] = {}
    for status, score in judged:
        judgements[str(status)] = judgements.get(str(status), 0) + 1
        if status == "done" and score is not None:
            verdicts[int(score)] = verdicts.get(int(score), 0) + 1
    votes = c.execute("SELECT score, error FROM judge_votes ORDER BY vote_id DESC LIMIT ?", (RECENT,)).fetchall()
    last_error = c.execute("SELECT error FROM judge_votes WHERE error IS NOT NULL ORDER BY vote_id DESC LIMIT 1"
                           ).fetchone()
    steps = dict(c.execute("SELECT status, COUNT(*) FROM steps GROUP BY status").fetchall())
    return LearningFacts(
        now=now,
        sessions_active=int(sessions.get("active", 0)),
        sessions_ended=int(sessions.get("ended", 0)),
        main_turns=_one(c, "SELECT COUNT(*) FROM turns WHERE turn_type='main'"),
        active_turns=_one(c, "SELECT COUNT(*) FROM turns t JOIN sessions s ON s.session_id = t.session_id "
                             "WHERE s.status='active' AND t.turn_type='main'"),
        most_idle_active_s=None if idle is None else max(0.0, now - float(idle)),
        rewards=_one(c, "SELECT COUNT(*) FROM rewards"),
        recent_rewards=[float(r[0]) for r in c.execute(
            "SELECT value FROM rewards ORDER BY reward_id DESC LIMIT ?", (RECENT,)).fetchall()],
        groups=len(grouped),
        equal_groups=sum(1 for v in grouped if max(v) == min(v)),
        unrewarded_turns=_one(
            c, "SELECT COUNT(*) FROM samples sa JOIN sessions s ON s.session_id = sa.session_id WHERE s.status='ended' "
               "AND sa.consumed_step IS NULL AND sa.dropped_reason IS NULL AND NOT EXISTS (SELECT 1 FROM rewards r "
               "WHERE r.session_id = s.session_id)"),
        dropped=dict(c.execute("SELECT dropped_reason, COUNT(*) FROM samples WHERE dropped_reason IS NOT NULL "
                               "GROUP BY dropped_reason").fetchall()),
        left_queue={str(k): int(n) for k, n in left},
        judgements=judgements,
        verdicts=verdicts,
        votes=len(votes),
        vote_errors=sum(1 for score, error in votes if score is None or error is not None),
        last_vote_error=None if last_error is None else str(last_error[0]),
        steps_ok=int(steps.get("ok", 0)),
        steps_failed=int(steps.get("failed", 0)),
        recent_steps=[(int(s), str(st), e) for s, st, e in c.execute(
            "SELECT step, status, error FROM steps WHERE status != 'running' ORDER BY step DESC LIMIT 10").fetchall()],
        decisions=[(int(v), str(verdict), str(reason)) for v, verdict, reason in c.execute(
            "SELECT version, verdict, reason FROM promotion_decisions WHERE source != 'admin' "
            "ORDER BY decision_id DESC LIMIT 10").fetchall()],
    )
