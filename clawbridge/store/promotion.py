"""Promotion state and decisions: which committed version serves, which is on trial, and why.

Operates on a `Store` through its `write()` / `read()` seam, like `clawbridge.store.versions`.

Invariants:
- `promotion_state` has at most one row: the serving version (what plain requests get), the
  candidate (a committed version on trial, or NULL) and, in canary mode, since when and for what
  share of new sessions. A restarted server serves exactly `serving_version` (the last promoted).
- A decision and its effect are ONE transaction (`decide`): the decision row, the new serving /
  candidate in the state, and (for a rejection) the mark on the samples the rejected version was
  trained on. So a `kill -9` leaves either nothing of it (the candidate is evaluated again and
  decided once) or all of it.
- At most one automatic decision (source `eval` or `canary`) per version: a partial unique index,
  so deciding a version twice is refused by SQLite, not by luck. An admin's `promote` /
  `rollback` (source `admin`) may name a version again (it is a new decision each time).
- Samples that built a rejected version stay consumed (they are never trained twice) and carry
  `rejected_version`, so `status` can say how many turns went into rejected versions.
- A rollback by the admin HOLDS: `held_version` is set in the same transaction as its decision,
  and while it is set no training step runs (`Promoter.settle`), so the version rolled back to
  keeps serving until the admin resumes (`release_hold`) or promotes a version (which clears it).
  Every other write of the state row leaves the hold as it is.
- `promotion_evals` caches a version's figures per evaluation set digest: greedy answers of a
  version do not change, so the serving version is evaluated once per set, not once per candidate.
- A forgotten user's held-out items (her turn ids), the content check's items asked in her context
  (`<turn id>/...`) and the answers given to them leave every figure in the same transaction that
  deletes her turns (`scrub_items`, `UserStore.forget`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from clawbridge.store.store import Store

Verdict = Literal["promoted", "rejected"]
DecisionSource = Literal["eval", "canary", "admin"]


@dataclass(frozen=True)
class PromotionState:
    """The one row of `promotion_state`."""

    mode: str
    serving_version: int | None
    candidate_version: int | None
    candidate_since: float | None
    canary_share: float | None
    updated_at: float
    held_version: int | None = None
    """The version the admin rolled back to, while training waits for `clawbridge resume`."""
    held_since: float | None = None


@dataclass(frozen=True)
class Decision:
    """One decision about a version (a row of `promotion_decisions`)."""

    version: int
    verdict: Verdict
    source: DecisionSource
    reason: str
    incumbent_version: int | None = None
    score: float | None = None
    incumbent_score: float | None = None
    figures: dict[str, Any] | None = None
    decision_id: int = 0
    created_at: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The shape of `/rl/status`' `promotion.decisions` entries."""
        return {"version": self.version, "verdict": self.verdict, "score": self.score,
                "incumbent_version": self.incumbent_version, "incumbent_score": self.incumbent_score,
                "reason": self.reason, "source": self.source, "figures": self.figures,
                "created_at": self.created_at}


class PromotionStore:
    """Read and write the promotion tables of a `Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # ------------------------------------------------------------------ state
    def state(self) -> PromotionState | None:
        with self.store.read() as c:
            r = c.execute("SELECT * FROM promotion_state WHERE id=1").fetchone()
        if r is None:
            return None
        return PromotionState(str(r["mode"]), r["serving_version"], r["candidate_version"], r["candidate_since"],
                              r["canary_share"], float(r["updated_at"]), r["held_version"], r["held_since"])

    def set_state(self, mode: str, serving: int | None, candidate: int | None = None,
                  candidate_since: float | None = None, canary_share: float | None = None) -> None:
        """Write the state row (insert or replace)."""
        with self.store.write() as c:
            _write_state(c, mode, serving, candidate, candidate_since, canary_share, self.store.clock.now())

    # ------------------------------------------------------------------ decisions
    def decide(self, d: Decision, mode: str, hold: bool | None = None) -> bool:
        """Record `d` and apply it in ONE transaction (module invariants): promoted -> `d.version`
        serves; either way the candidate is cleared; rejected -> the samples of the steps that
        produced `d.version` are marked; `hold` True (an admin's rollback) holds `d.version`,
        False (an admin's promote) clears a hold, None leaves it. False (nothing written) when an
        automatic decision about `d.version` exists already."""
        now = self.store.clock.now()
        with self.store.write() as c:
            if d.source != "admin" and c.execute(
                    "SELECT 1 FROM promotion_decisions WHERE version=? AND source != 'admin'", (d.version,)).fetchone():
                return False
            c.execute(
                "INSERT INTO promotion_decisions(version, verdict, source, incumbent_version, score, incumbent_score, "
                "reason, figures_json, created_at) VALUES(?,?,?,?,?,?,?,?,?)",
                (d.version, d.verdict, d.source, d.incumbent_version, d.score, d.incumbent_score, d.reason,
                 json.dumps(d.figures) if d.figures is not None else None, now),
            )
            row = c.execute("SELECT serving_version FROM promotion_state WHERE id=1").fetchone()
            serving = row[0] if row is not None else d.incumbent_version
            if d.verdict == "promoted":
                serving = d.version
            else:
                c.execute(
                    "UPDATE samples SET rejected_version=? WHERE consumed_step IN "
                    "(SELECT step FROM steps WHERE policy_version=? AND status='ok')", (d.version, d.version))
            _write_state(c, mode, serving, None, None, None, now)
            if hold is not None:
                c.execute("UPDATE promotion_state SET held_version=?, held_since=? WHERE id=1",
                          (d.version, now) if hold else (None, None))
        return True

    def release_hold(self) -> int | None:
        """Clear the admin's hold (`clawbridge resume`); the version that was held, or None."""
        with self.store.write() as c:
            r = c.execute("SELECT held_version FROM promotion_state WHERE id=1").fetchone()
            c.execute("UPDATE promotion_state SET held_version=NULL, held_since=NULL WHERE id=1")
        return None if r is None or r[0] is None else int(r[0])

    def decision_for(self, version: int) -> Decision | None:
        """The automatic decision about `version`, if one was taken."""
        rows = self._select("WHERE version=? AND source != 'admin' LIMIT 1", (version,))
        return rows[0] if rows else None

    def last_decision(self, version: int) -> Decision | None:
        """The newest decision about `version`, automatic or the admin's."""
        rows = self._select("WHERE version=? ORDER BY decision_id DESC LIMIT 1", (version,))
        return rows[0] if rows else None

    def decisions(self, limit: int = 20) -> list[Decision]:
        """Newest first."""
        return self._select("ORDER BY decision_id DESC LIMIT ?", (limit,))

    def verdicts(self, limit: int) -> list[tuple[Verdict, DecisionSource]]:
        """(verdict, source) of the newest `limit` decisions, newest first (no figures read)."""
        with self.store.read() as c:
            rows = c.execute("SELECT verdict, source FROM promotion_decisions ORDER BY decision_id DESC LIMIT ?",
                             (limit,)).fetchall()
        return [(r[0], r[1]) for r in rows]

    def anchor_version(self) -> int | None:
        """The version the eval gate's drift guard compares candidates with: the one the admin last
        put to serve, else the one serving when the first automatic decision was taken (None before
        any decision: the serving version is the anchor then)."""
        with self.store.read() as c:
            r = c.execute("SELECT version FROM promotion_decisions WHERE source='admin' "
                          "ORDER BY decision_id DESC LIMIT 1").fetchone()
            if r is None:
                r = c.execute("SELECT incumbent_version FROM promotion_decisions WHERE source != 'admin' "
                              "ORDER BY decision_id LIMIT 1").fetchone()
        return int(r[0]) if r is not None and r[0] is not None else None

    def rejected_samples(self) -> int:
        """Consumed samples whose step produced a version that was then rejected."""
        with self.store.read() as c:
            return int(c.execute("SELECT COUNT(*) FROM samples WHERE rejected_version IS NOT NULL").fetchone()[0])

    def _select(self, tail: str, args: tuple[Any, ...]) -> list[Decision]:
        with self.store.read() as c:
            rows = c.execute(f"SELECT * FROM promotion_decisions {tail}", args).fetchall()
        return [
            Decision(version=int(r["version"]), verdict=r["verdict"], source=r["source"], reason=str(r["reason"]),
                     incumbent_version=r["incumbent_version"], score=r["score"], incumbent_score=r["incumbent_score"],
                     figures=json.loads(r["figures_json"]) if r["figures_json"] else None,
                     decision_id=int(r["decision_id"]), created_at=float(r["created_at"]))
            for r in rows
        ]

    # ------------------------------------------------------------------ canary
    def canary_outcomes(self, candidate: int, incumbent: int, since: float) -> dict[int, list[bool]]:
        """{version: successes} for `candidate` and `incumbent`: per ended session created at or
        after `since` whose main turns were all answered by that one version and that has a reward,
        whether that reward is > 0 (its explicit rewards' mean, any source but the judge, else the
        mean of the judge's verdicts), in the order the sessions became countable (the later of
        its end and its first reward; then the session id), which a later reward does not change:
        the order the canary's sequential test reads them in (`clawbridge.promotion.stats`)."""
        with self.store.read() as c:
            rows = c.execute(
                "SELECT MIN(t.policy_version) AS v, s.session_id AS sid, s.ended_at AS ended, "
                "(SELECT MIN(r.created_at) FROM rewards r WHERE r.session_id = s.session_id) AS first, "
                "(SELECT AVG(r.value) FROM rewards r WHERE r.session_id = s.session_id AND r.source != 'judge') AS ex, "
                "(SELECT AVG(r.value) FROM rewards r WHERE r.session_id = s.session_id AND r.source = 'judge') AS jd "
                "FROM sessions s JOIN turns t ON t.session_id = s.session_id AND t.turn_type = 'main' "
                "AND t.status = 'ok' WHERE s.status = 'ended' AND s.created_at >= ? GROUP BY s.session_id "
                "HAVING MIN(t.policy_version) = MAX(t.policy_version) AND MIN(t.policy_version) IN (?, ?)",
                (since, candidate, incumbent),
            ).fetchall()
        out: dict[int, list[bool]] = {candidate: [], incumbent: []}
        counted = [r for r in rows if r["ex"] is not None or r["jd"] is not None]
        counted.sort(key=lambda r: (max(float(r["ended"] or 0.0), float(r["first"] or 0.0)), str(r["sid"])))
        for r in counted:
            value = r["ex"] if r["ex"] is not None else r["jd"]
            out[int(r["v"])].append(float(value) > 0)
        return out

    # ------------------------------------------------------------------ evaluation cache
    def cached_eval(self, version: int, digest: str) -> dict[str, Any] | None:
        with self.store.read() as c:
            r = c.execute("SELECT figures_json FROM promotion_evals WHERE version=? AND eval_digest=?",
                          (version, digest)).fetchone()
        return None if r is None else dict(json.loads(r[0]))

    def save_eval(self, version: int, digest: str, figures: dict[str, Any]) -> None:
        with self.store.write() as c:
            c.execute(
                "INSERT INTO promotion_evals(version, eval_digest, figures_json, created_at) VALUES(?,?,?,?) "
                "ON CONFLICT(version, eval_digest) DO UPDATE SET figures_json=excluded.figures_json",
                (version, digest, json.dumps(figures), self.store.clock.now()),
            )

    def evals(self, limit: int = 50) -> list[tuple[int, str, dict[str, Any]]]:
        """(version, digest, figures) of the newest evaluations, newest version first."""
        with self.store.read() as c:
            rows = c.execute("SELECT version, eval_digest, figures_json FROM promotion_evals "
                             "ORDER BY created_at DESC LIMIT ?", (limit,)).fetchall()
        return [(int(r[0]), str(r[1]), dict(json.loads(r[2]))) for r in rows]


def scrub_items(c: Any, item_ids: set[str]) -> int:
    """Inside an open transaction: remove the evaluation items `item_ids` (a forgotten user's turn
    ids, as held-out items) and the greedy answers given to them from every stored figure, cached
    (`promotion_evals`) or behind a decision (`promotion_decisions`); returns the rows changed.
    A figure keeps its counts and rates (numbers, not her text)."""
    if not item_ids:
        return 0
    changed = 0
    for table, key in (("promotion_evals", "rowid"), ("promotion_decisions", "decision_id")):
        rows = c.execute(f"SELECT {key}, figures_json FROM {table} WHERE figures_json IS NOT NULL").fetchall()
        for rid, raw in rows:
            figures = json.loads(raw)
            if _scrub(figures, item_ids):
                c.execute(f"UPDATE {table} SET figures_json=? WHERE {key}=?", (json.dumps(figures), rid))
                changed += 1
    return changed


def _hers(item_id: Any, turn_ids: set[str]) -> bool:
    """Whether an evaluation item comes from one of `turn_ids`: a held-out item is named by its turn
    id, a content check item by the turn its context came from (`<turn id>/everyday-N`)."""
    return isinstance(item_id, str) and (item_id in turn_ids or item_id.split("/", 1)[0] in turn_ids)


def _scrub(node: Any, item_ids: set[str]) -> bool:
    """Drop `item_ids` from every `failed` list under `node` and the `failed_answers` that go with
    them (`clawbridge.promotion.runner.VersionEval`: answer i is item `failed[i]`'s); in place."""
    found = False
    if isinstance(node, dict):
        failed = node.get("failed")
        if isinstance(failed, list) and any(_hers(i, item_ids) for i in failed):
            answers = node.get("failed_answers")
            if isinstance(answers, list):
                node["failed_answers"] = [a for i, a in zip(failed, answers, strict=False) if not _hers(i, item_ids)]
            node["failed"] = [i for i in failed if not _hers(i, item_ids)]
            found = True
        for value in node.values():
            found = _scrub(value, item_ids) or found
    elif isinstance(node, list):
        for value in node:
            found = _scrub(value, item_ids) or found
    return found


def _write_state(c: Any, mode: str, serving: int | None, candidate: int | None, since: float | None,
                 share: float | None, now: float) -> None:
    c.execute(
        "INSERT INTO promotion_state(id, mode, serving_version, candidate_version, candidate_since, canary_share, "
        "updated_at) VALUES(1,?,?,?,?,?,?) ON CONFLICT(id) DO UPDATE SET mode=excluded.mode, "
        "serving_version=excluded.serving_version, candidate_version=excluded.candidate_version, "
        "candidate_since=excluded.candidate_since, canary_share=excluded.canary_share, updated_at=excluded.updated_at",
        (mode, serving, candidate, since, share, now),
    )
