"""Read-only views of the store for watching training: the dashboard, `/metrics` and exports.

Operates on a `Store` through its `read()` seam (like `clawbridge.store.training`), never
writes, and never changes the Store's own methods.

Invariants:
- Every method is a read of committed rows; it can run beside the server (another process's
  `Store` on the same file sees what the server committed: WAL).
- A turn's REWARD here is the latest reward row on it per source (`api`, `cli`, `judge`, ...);
  a session-level reward (no turn id) counts for the session, not for any one turn. This is a
  view for people and exports; what the trainer optimises is `clawbridge.trainer.advantages`.
- Lists are bounded (`limit`), so a scrape or a page poll costs the same on a large store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from clawbridge.store.store import Store


@dataclass(frozen=True)
class RewardPoint:
    """One reward, placed where it landed: its session, its turn's policy version, its source."""

    session_id: str
    session_index: int
    """The session's position among sessions by creation time (0 = oldest)."""
    turn_id: str | None
    policy_version: int | None
    """The version that sampled the rewarded turn (the session's last turn for a session reward)."""
    source: str
    value: float
    created_at: float


@dataclass(frozen=True)
class SessionSummary:
    """A row of the sessions list: status, turns, reward, age."""

    session_id: str
    status: str
    source: str
    task_id: str | None
    end_reason: str | None
    turns: int
    reward: float | None
    """The mean of the session's rewards (every source), None when it has none."""
    rewards: int
    created_at: float
    updated_at: float
    last_policy_version: int | None


@dataclass(frozen=True)
class DroppedSample:
    turn_id: str
    session_id: str
    policy_version: int
    reason: str
    created_at: float


_SESSION_INDEX = (
    "idx AS (SELECT session_id, ROW_NUMBER() OVER (ORDER BY created_at, session_id) - 1 AS i "
    "FROM sessions)"
)
"""A CTE numbering sessions by creation (0 = oldest), computed once per query (a window function,
not a count per row: the dashboard polls this)."""


class ObserveStore:
    """Read-only queries for the dashboard, metrics and exports on a `Store`'s connection."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def _all(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        with self.store.read() as c:
            return list(c.execute(sql, args).fetchall())

    # ------------------------------------------------------------------ rewards
    def reward_points(self, limit: int = 2000) -> list[RewardPoint]:
        """The newest `limit` rewards, oldest first, each with its session's index and version."""
        rows = self._all(
            f"WITH {_SESSION_INDEX} SELECT r.session_id, r.turn_id, r.source, r.value, r.created_at, idx.i, "
            "COALESCE((SELECT t.policy_version FROM turns t WHERE t.turn_id = r.turn_id), "
            " (SELECT t.policy_version FROM turns t WHERE t.session_id = r.session_id ORDER BY t.seq DESC LIMIT 1)) "
            "FROM rewards r JOIN idx ON idx.session_id = r.session_id ORDER BY r.reward_id DESC LIMIT ?",
            (limit,),
        )
        return [
            RewardPoint(str(r[0]), int(r[5]), r[1], r[6], str(r[2]), float(r[3]), float(r[4]))
            for r in reversed(rows)
        ]

    def version_starts(self) -> list[tuple[int, int]]:
        """(policy_version, index of the first session with a turn sampled by it), ascending."""
        rows = self._all(
            f"WITH {_SESSION_INDEX} SELECT t.policy_version, MIN(idx.i) FROM turns t "
            "JOIN idx ON idx.session_id = t.session_id GROUP BY t.policy_version ORDER BY t.policy_version"
        )
        return [(int(r[0]), int(r[1])) for r in rows]

    def reward_by_version(self) -> list[dict[str, Any]]:
        """Mean turn-level reward per (policy version, source), ascending by version."""
        rows = self._all(
            "SELECT t.policy_version, r.source, AVG(r.value), COUNT(*) FROM rewards r "
            "JOIN turns t ON t.turn_id = r.turn_id GROUP BY t.policy_version, r.source "
            "ORDER BY t.policy_version, r.source"
        )
        return [{"policy_version": int(r[0]), "source": str(r[1]), "mean": float(r[2]), "count": int(r[3])}
                for r in rows]

    # ------------------------------------------------------------------ sessions
    def session_summaries(self, limit: int = 50, offset: int = 0, status: str | None = None) -> list[SessionSummary]:
        """Newest first."""
        where, args = ("WHERE s.status=?", [status]) if status else ("", [])
        rows = self._all(
            "SELECT s.session_id, s.status, s.source, s.task_id, s.end_reason, s.created_at, s.updated_at, "
            "(SELECT COUNT(*) FROM turns t WHERE t.session_id = s.session_id), "
            "(SELECT AVG(value) FROM rewards r WHERE r.session_id = s.session_id), "
            "(SELECT COUNT(*) FROM rewards r WHERE r.session_id = s.session_id), "
            "(SELECT MAX(policy_version) FROM turns t WHERE t.session_id = s.session_id) "
            f"FROM sessions s {where} ORDER BY s.created_at DESC, s.session_id LIMIT ? OFFSET ?",
            (*args, limit, offset),
        )
        return [
            SessionSummary(str(r[0]), str(r[1]), str(r[2]), r[3], r[4], int(r[7]),
                           None if r[8] is None else float(r[8]), int(r[9]), float(r[5]), float(r[6]), r[10])
            for r in rows
        ]

    def session_count(self) -> int:
        return int(self._all("SELECT COUNT(*) FROM sessions")[0][0])

    # ------------------------------------------------------------------ training
    def dropped_samples(self, limit: int = 50) -> list[DroppedSample]:
        """The newest dropped samples with their reasons."""
        rows = self._all(
            "SELECT turn_id, session_id, policy_version, dropped_reason, created_at FROM samples "
            "WHERE dropped_reason IS NOT NULL ORDER BY created_at DESC, turn_id LIMIT ?",
            (limit,),
        )
        return [DroppedSample(str(r[0]), str(r[1]), int(r[2]), str(r[3]), float(r[4])) for r in rows]

    def sample_counts(self) -> dict[str, Any]:
        """pending (unconsumed, not dropped), trained (consumed) and dropped by reason."""
        pending = self._all("SELECT COUNT(*) FROM samples WHERE consumed_step IS NULL AND dropped_reason IS NULL")
        trained = self._all("SELECT COUNT(*) FROM samples WHERE consumed_step IS NOT NULL")
        dropped = self._all(
            "SELECT dropped_reason, COUNT(*) FROM samples WHERE dropped_reason IS NOT NULL GROUP BY dropped_reason"
        )
        return {"pending": int(pending[0][0]), "trained": int(trained[0][0]),
                "dropped": {str(r[0]): int(r[1]) for r in dropped}}

    def waiting_counts(self) -> dict[str, int]:
        """What keeps samples from training: pending samples without a reward, active sessions
        (their turns become samples when they end), and sessions still waiting for the judge."""
        unrewarded = self._all(
            "SELECT COUNT(*) FROM samples sa WHERE sa.consumed_step IS NULL AND sa.dropped_reason IS NULL "
            "AND NOT EXISTS (SELECT 1 FROM rewards r WHERE r.session_id = sa.session_id)"
        )
        active = self._all("SELECT COUNT(*) FROM sessions WHERE status='active'")
        unjudged = self._all(
            "SELECT COUNT(DISTINCT sa.session_id) FROM samples sa WHERE sa.consumed_step IS NULL "
            "AND sa.dropped_reason IS NULL AND NOT EXISTS "
            "(SELECT 1 FROM reward_sessions rs WHERE rs.session_id = sa.session_id)"
        )
        return {"pending_without_reward": int(unrewarded[0][0]), "active_sessions": int(active[0][0]),
                "sessions_not_judged": int(unjudged[0][0])}

    def sample_states(self, session_id: str) -> dict[str, tuple[int | None, str | None]]:
        """turn id -> (the step that consumed its sample, why it was dropped) for the session."""
        rows = self._all("SELECT turn_id, consumed_step, dropped_reason FROM samples WHERE session_id=?", (session_id,))
        return {str(r[0]): (r[1], r[2]) for r in rows}

    def steps(self, limit: int = 200) -> list[dict[str, Any]]:
        """The newest `limit` steps, oldest first, with metrics and consumed sample counts."""
        return list(reversed(self._steps_where("ORDER BY st.step DESC LIMIT ?", (limit,))))

    def steps_after(self, step: int, limit: int = 500) -> list[dict[str, Any]]:
        """Steps numbered above `step`, oldest first (at most `limit`)."""
        return self._steps_where("WHERE st.step > ? ORDER BY st.step LIMIT ?", (step, limit))

    def _steps_where(self, tail: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        rows = self._all(
            "SELECT st.step, st.policy_version, st.status, st.metrics_json, st.error, st.started_at, "
            "st.finished_at, (SELECT COUNT(*) FROM samples sa WHERE sa.consumed_step = st.step) "
            f"FROM steps st {tail}",
            args,
        )
        return [
            {"step": int(r[0]), "policy_version": r[1], "status": str(r[2]),
             "metrics": json.loads(r[3]) if r[3] else {}, "error": r[4], "started_at": float(r[5]),
             "finished_at": r[6], "samples": int(r[7])}
            for r in rows
        ]

    def versions(self) -> list[dict[str, Any]]:
        """Policy versions seen in the store: published by a step, or serving recorded turns."""
        published = {
            int(r[0]): (int(r[1]), float(r[2]))
            for r in self._all(
                "SELECT policy_version, step, finished_at FROM steps WHERE status='ok' AND policy_version IS NOT NULL"
            )
        }
        served = {
            int(r[0]): (int(r[1]), float(r[2]), float(r[3]))
            for r in self._all(
                "SELECT policy_version, COUNT(*), MIN(created_at), MAX(created_at) FROM turns GROUP BY policy_version"
            )
        }
        out = []
        for v in sorted(set(published) | set(served)):
            step, published_at = published.get(v, (None, None))
            turns, first, last = served.get(v, (0, None, None))
            out.append({"policy_version": v, "step": step, "published_at": published_at, "turns": turns,
                        "first_turn_at": first, "last_turn_at": last})
        return out

    # ------------------------------------------------------------------ metrics
    def totals(self, reward_buckets: tuple[float, ...], seconds_buckets: tuple[float, ...]) -> dict[str, Any]:
        """Everything `/metrics` derives from the store. Histograms are counted in SQL against the
        given (ascending, finite) bucket bounds, so a scrape never loads every row."""
        q = self._all
        reward_le = ", ".join(f"SUM(value <= {float(b)!r})" for b in reward_buckets)
        seconds: dict[str, tuple[list[int], int, float]] = {}
        for key in ("train_seconds", "publish_seconds", "seconds"):
            le = ", ".join(f"SUM(v <= {float(b)!r})" for b in seconds_buckets)
            row = q(f"SELECT {le}, COUNT(v), COALESCE(SUM(v), 0) FROM (SELECT json_extract(metrics_json, '$.{key}') "
                    "AS v FROM steps WHERE status='ok' AND metrics_json IS NOT NULL) WHERE v IS NOT NULL")[0]
            n = len(seconds_buckets)
            seconds[key] = ([int(x or 0) for x in row[:n]], int(row[n]), float(row[n + 1]))
        return {
            "sessions": {str(r[0]): int(r[1]) for r in q("SELECT status, COUNT(*) FROM sessions GROUP BY status")},
            "turns": [(str(r[0]), str(r[1]), int(r[2]))
                      for r in q("SELECT turn_type, status, COUNT(*) FROM turns GROUP BY turn_type, status")],
            "tokens": tuple(int(x) for x in q(
                "SELECT COALESCE(SUM(prompt_tokens),0), COALESCE(SUM(completion_tokens),0) FROM turns")[0]),
            "rewards": {
                str(r[0]): ([int(x or 0) for x in r[3:]], int(r[1]), float(r[2]))
                for r in q(f"SELECT source, COUNT(*), COALESCE(SUM(value),0), {reward_le} FROM rewards GROUP BY source")
            },
            "steps": {str(r[0]): int(r[1]) for r in q("SELECT status, COUNT(*) FROM steps GROUP BY status")},
            "step_seconds": seconds,
            "policy_version": q("SELECT MAX(policy_version) FROM steps WHERE status='ok'")[0][0],
            "samples": self.sample_counts(),
            "judge_votes": {("ok" if r[0] else "failed"): int(r[1]) for r in q(
                "SELECT score IS NOT NULL, COUNT(*) FROM judge_votes GROUP BY score IS NOT NULL")},
            "judgements": {str(r[0]): int(r[1]) for r in q("SELECT status, COUNT(*) FROM judgements GROUP BY status")},
        }
