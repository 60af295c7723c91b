"""The rewards view of the store: next states, judge votes and verdicts, hints, rewrites, teacher logprobs.

Operates on a `Store` through its `write()` / `read()` seam (like `store.training`), on the
tables of schema v2.

Invariants:
- A turn is judged at most once to completion: `judgements.status='done'` is final and
  `turns_to_judge` never returns such a turn again, whatever restarts happen.
- A judgement left `running` by a killed process is reset by `recover_interrupted` (status
  `interrupted`); the turn is judged again with `attempt + 1`. Votes are kept per attempt, so the
  audit trail shows the interrupted run too; verdicts use only the final attempt's votes.
- `finish_judgement` writes a turn's votes, its verdict, its hint and its rewrite in ONE
  transaction: a crash leaves either all of them or none (then the turn is still `running` and
  gets re-judged).
- A rewrite's demonstration ids and logprobs are written together, once, with as many logprobs as
  ids (`save_rewrite_tokens`); the trainer reads only scored rewrites.
- `finish_session` marks a session done and, in the same transaction, copies every done verdict
  into `rewards` with source `judge` (one row per turn, never twice). That row is what makes a
  session with no explicit reward READY for the trainer; the trainer itself reads verdicts from
  `judgements` and explicit rewards from `rewards` (source != 'judge') and combines them per
  `clawbridge.trainer.advantages` rule 1b.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clawbridge.store.codec import decode_floats, decode_ids, encode_floats, encode_ids
from clawbridge.store.store import Store
from clawbridge.store.turns import StoredTurn, decode_turn

JUDGE_SOURCE = "judge"
"""`rewards.source` of verdicts copied by `finish_session`."""


@dataclass(frozen=True)
class VoteRow:
    """One judge sample as stored."""

    idx: int
    score: int | None
    """-1, 0 or 1; None when the vote failed (transport error or no parseable score)."""
    hint: str | None
    text: str | None
    error: str | None = None


@dataclass(frozen=True)
class TurnSignal:
    """What the trainer reads per turn besides explicit rewards."""

    judge_score: float | None
    """The majority verdict of a done judgement (None: not judged)."""
    mean_vote: float | None
    """The mean vote of that judgement, failed votes as 0 (for the "at least one" rule)."""
    teacher_logprobs: list[float] | None
    """Per completion token: the teacher's logprob with the hint in the prompt (None: no OPD)."""
    reference_logprobs: list[float] | None = None
    """Per completion token, for a turn served with notes: the base model's logprob on the prompt
    the turn trains on (no notes, no hint). OPD measures the teacher against it instead of the
    sampled logprobs, which were taken with the note in the context (`clawbridge.rewards.opd`)."""
    rewrite_ids: list[int] | None = None
    """The judge's rewrite of the answer as completion ids on the turn's trained prompt (None: no
    scored rewrite; `clawbridge.rewards.rewrites`)."""
    rewrite_logprobs: list[float] | None = None
    """The base model's logprob of each of `rewrite_ids` on that prompt."""


class RewardStore:
    """Next states, judgements and teacher scores on a `Store`'s connection."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # ------------------------------------------------------------------ work discovery
    def pending_sessions(self, limit: int = 16) -> list[str]:
        """Ended sessions with an ok main turn that the judge has not finished, oldest end first."""
        with self.store.read() as c:
            rows = c.execute(
                "SELECT s.session_id FROM sessions s WHERE s.status='ended' "
                "AND NOT EXISTS (SELECT 1 FROM reward_sessions rs WHERE rs.session_id = s.session_id) "
                "AND EXISTS (SELECT 1 FROM turns t WHERE t.session_id = s.session_id "
                "AND t.turn_type='main' AND t.status='ok') ORDER BY s.ended_at, s.session_id LIMIT ?",
                (limit,),
            ).fetchall()
        return [str(r[0]) for r in rows]

    def transcript(self, session_id: str) -> list[StoredTurn]:
        """The session's ok turns (main and side) in order."""
        with self.store.read() as c:
            rows = c.execute(
                "SELECT * FROM turns WHERE session_id=? AND status='ok' ORDER BY seq", (session_id,)
            ).fetchall()
        return [decode_turn(r) for r in rows]

    # ------------------------------------------------------------------ next states
    def save_next_states(self, session_id: str, states: Mapping[str, tuple[str, list[dict[str, Any]], str]]) -> None:
        """Record `turn_id -> (kind, messages, from_turn_id)` (idempotent: re-extraction replaces)."""
        now = self.store.clock.now()
        with self.store.write() as c:
            c.executemany(
                "INSERT OR REPLACE INTO next_states(turn_id, session_id, kind, state_json, from_turn_id, created_at) "
                "VALUES(?,?,?,?,?,?)",
                [(tid, session_id, kind, json.dumps(msgs), src, now) for tid, (kind, msgs, src) in states.items()],
            )

    def next_states(self, session_id: str) -> dict[str, tuple[str, list[dict[str, Any]]]]:
        """`turn_id -> (kind, messages)` for the session's turns that have a next state."""
        with self.store.read() as c:
            rows = c.execute(
                "SELECT turn_id, kind, state_json FROM next_states WHERE session_id=?", (session_id,)
            ).fetchall()
        return {str(r[0]): (str(r[1]), json.loads(r[2])) for r in rows}

    # ------------------------------------------------------------------ judgements
    def recover_interrupted(self) -> int:
        """Judgements left `running` by a killed process become `interrupted` (judged again)."""
        with self.store.write() as c:
            return c.execute(
                "UPDATE judgements SET status='interrupted', error='interrupted: the process ended while judging', "
                "finished_at=? WHERE status='running'",
                (self.store.clock.now(),),
            ).rowcount

    def judgement_states(self, turn_ids: Iterable[str]) -> dict[str, tuple[str, int]]:
        """`turn_id -> (status, attempt)` for turns that have a judgement row."""
        out: dict[str, tuple[str, int]] = {}
        with self.store.read() as c:
            for tid in turn_ids:
                r = c.execute(
                    "SELECT status, attempt FROM judgements WHERE turn_id=?", (tid,)
                ).fetchone()
                if r is not None:
                    out[tid] = (str(r[0]), int(r[1]))
        return out

    def begin_judgement(self, turn_id: str, session_id: str, judge_model: str) -> int:
        """Mark the turn `running` (a new attempt); returns the attempt number. Refuses a done turn."""
        now = self.store.clock.now()
        with self.store.write() as c:
            r = c.execute("SELECT status, attempt FROM judgements WHERE turn_id=?", (turn_id,)).fetchone()
            if r is not None and r[0] == "done":
                raise ValueError(f"turn {turn_id!r} is already judged")
            attempt = 1 if r is None else int(r[1]) + 1
            c.execute(
                "INSERT INTO judgements(turn_id, session_id, status, attempt, judge_model, started_at) "
                "VALUES(?,?,'running',?,?,?) ON CONFLICT(turn_id) DO UPDATE SET status='running', "
                "attempt=excluded.attempt, judge_model=excluded.judge_model, error=NULL, score=NULL, "
                "mean_vote=NULL, started_at=excluded.started_at, finished_at=NULL",
                (turn_id, session_id, attempt, judge_model, now),
            )
            return attempt

    def turn_notes_context(self, session_id: str, turn_id: str) -> tuple[str, Any]:
        """(the session's user, '' without one; the turn's `meta.notes`) for the notes book."""
        with self.store.read() as c:
            r = c.execute("SELECT COALESCE(s.user_id, '') AS user_id, json_extract(t.meta_json, '$.notes') AS noted "
                          "FROM sessions s LEFT JOIN turns t ON t.turn_id = ? WHERE s.session_id = ?",
                          (turn_id, session_id)).fetchone()
        return ("", None) if r is None else (str(r["user_id"]), r["noted"])

    def finish_judgement(
        self, turn_id: str, attempt: int, votes: Sequence[VoteRow], score: float, mean_vote: float,
        hint: str | None, rewrite: str | None = None,
    ) -> None:
        """In ONE transaction: the attempt's votes, the verdict (status done), the hint and the rewrite."""
        now = self.store.clock.now()
        with self.store.write() as c:
            self._insert_votes(c, turn_id, attempt, votes, now)
            cur = c.execute(
                "UPDATE judgements SET status='done', score=?, mean_vote=?, error=NULL, finished_at=? "
                "WHERE turn_id=? AND attempt=? AND status='running'",
                (score, mean_vote, now, turn_id, attempt),
            )
            if cur.rowcount != 1:
                raise ValueError(f"judgement of {turn_id!r} attempt {attempt} is not running")
            if hint:
                c.execute(
                    "INSERT OR REPLACE INTO hints(turn_id, hint, created_at) VALUES(?,?,?)", (turn_id, hint, now)
                )
            if rewrite:
                c.execute("INSERT OR REPLACE INTO rewrites(turn_id, text, created_at) VALUES(?,?,?)",
                          (turn_id, rewrite, now))

    def fail_judgement(self, turn_id: str, attempt: int, votes: Sequence[VoteRow], error: str) -> None:
        """Every vote failed: keep them and the error; the turn may be judged again."""
        now = self.store.clock.now()
        with self.store.write() as c:
            self._insert_votes(c, turn_id, attempt, votes, now)
            c.execute(
                "UPDATE judgements SET status='failed', error=?, finished_at=? WHERE turn_id=? AND attempt=?",
                (error[:2000], now, turn_id, attempt),
            )

    @staticmethod
    def _insert_votes(c: Any, turn_id: str, attempt: int, votes: Sequence[VoteRow], now: float) -> None:
        c.executemany(
            "INSERT INTO judge_votes(turn_id, attempt, idx, score, hint, text, error, created_at) "
            "VALUES(?,?,?,?,?,?,?,?)",
            [(turn_id, attempt, v.idx, v.score, v.hint, v.text, v.error, now) for v in votes],
        )

    def votes(self, turn_id: str) -> list[tuple[int, VoteRow]]:
        """Every stored vote of the turn as (attempt, vote), in order."""
        with self.store.read() as c:
            rows = c.execute(
                "SELECT attempt, idx, score, hint, text, error FROM judge_votes WHERE turn_id=? ORDER BY vote_id",
                (turn_id,),
            ).fetchall()
        return [(int(r[0]), VoteRow(int(r[1]), r[2], r[3], r[4], r[5])) for r in rows]

    def hints(self, session_id: str) -> dict[str, str]:
        """`turn_id -> hint` for the session's turns."""
        with self.store.read() as c:
            rows = c.execute(
                "SELECT h.turn_id, h.hint FROM hints h JOIN turns t ON t.turn_id = h.turn_id WHERE t.session_id=?",
                (session_id,),
            ).fetchall()
        return {str(r[0]): str(r[1]) for r in rows}

    # ------------------------------------------------------------------ rewrites (demonstrations)
    def unscored_rewrites(self, session_id: str) -> dict[str, str]:
        """`turn_id -> rewrite text` for the session's rewrites not yet turned into ids."""
        with self.store.read() as c:
            rows = c.execute(
                "SELECT r.turn_id, r.text FROM rewrites r JOIN turns t ON t.turn_id = r.turn_id "
                "WHERE t.session_id=? AND r.completion_token_ids IS NULL", (session_id,),
            ).fetchall()
        return {str(r[0]): str(r[1]) for r in rows}

    def save_rewrite_tokens(self, turn_id: str, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """A rewrite's demonstration ids and the base model's logprobs of them (module invariants)."""
        if not ids or len(ids) != len(logprobs):
            raise ValueError(f"a rewrite needs ids and one logprob each: {len(ids)} ids, {len(logprobs)} logprobs")
        with self.store.write() as c:
            cur = c.execute("UPDATE rewrites SET completion_token_ids=?, logprobs=?, scored_at=? "
                            "WHERE turn_id=? AND completion_token_ids IS NULL",
                            (encode_ids(ids), encode_floats(logprobs), self.store.clock.now(), turn_id))
            if cur.rowcount != 1:
                raise ValueError(f"turn {turn_id!r} has no unscored rewrite")

    # ------------------------------------------------------------------ teacher (OPD)
    def save_teacher_logprobs(self, turn_id: str, logprobs: Sequence[float], prompt_len: int,
                              reference: Sequence[float] | None = None) -> None:
        """The teacher's logprobs of a hinted turn's completion and, for a turn served with notes,
        the plain-prompt reference (`TurnSignal.reference_logprobs`); both of the completion's length."""
        if reference is not None and len(reference) != len(logprobs):
            raise ValueError(f"reference has {len(reference)} logprobs, the teacher {len(logprobs)}")
        with self.store.write() as c:
            c.execute(
                "INSERT OR REPLACE INTO teacher_logprobs(turn_id, logprobs, prompt_len, created_at, "
                "reference_logprobs) VALUES(?,?,?,?,?)",
                (turn_id, encode_floats(logprobs), prompt_len, self.store.clock.now(),
                 None if reference is None else encode_floats(reference)),
            )

    def has_teacher(self, turn_ids: Iterable[str]) -> set[str]:
        with self.store.read() as c:
            return {
                tid for tid in turn_ids
                if c.execute("SELECT 1 FROM teacher_logprobs WHERE turn_id=?", (tid,)).fetchone()
            }

    # ------------------------------------------------------------------ sessions
    def finish_session(self, session_id: str) -> int:
        """Mark the session done and copy its verdicts into `rewards` (source judge); returns how
        many verdicts it has. Idempotent."""
        now = self.store.clock.now()
        with self.store.write() as c:
            rows = c.execute(
                "SELECT turn_id, score FROM judgements WHERE session_id=? AND status='done'", (session_id,)
            ).fetchall()
            for tid, score in rows:
                if c.execute(
                    "SELECT 1 FROM rewards WHERE turn_id=? AND source=?", (tid, JUDGE_SOURCE)
                ).fetchone() is None:
                    c.execute(
                        "INSERT INTO rewards(session_id, turn_id, value, source, created_at) VALUES(?,?,?,?,?)",
                        (session_id, tid, float(score), JUDGE_SOURCE, now),
                    )
            c.execute(
                "INSERT OR IGNORE INTO reward_sessions(session_id, status, turns_judged, finished_at) "
                "VALUES(?, 'done', ?, ?)",
                (session_id, len(rows), now),
            )
            return len(rows)

    def session_done(self, session_id: str) -> bool:
        with self.store.read() as c:
            return c.execute(
                "SELECT 1 FROM reward_sessions WHERE session_id=?", (session_id,)
            ).fetchone() is not None

    # ------------------------------------------------------------------ trainer side
    def turn_signals(self, turn_ids: Iterable[str]) -> dict[str, TurnSignal]:
        """Judge verdict and teacher logprobs per turn (turns with neither are left out)."""
        out: dict[str, TurnSignal] = {}
        with self.store.read() as c:
            for tid in turn_ids:
                j = c.execute(
                    "SELECT score, mean_vote FROM judgements WHERE turn_id=? AND status='done'", (tid,)
                ).fetchone()
                t = c.execute("SELECT logprobs, reference_logprobs FROM teacher_logprobs WHERE turn_id=?",
                              (tid,)).fetchone()
                w = c.execute("SELECT completion_token_ids, logprobs FROM rewrites "
                              "WHERE turn_id=? AND completion_token_ids IS NOT NULL", (tid,)).fetchone()
                if j is None and t is None:
                    continue
                out[tid] = TurnSignal(
                    judge_score=None if j is None else float(j[0]),
                    mean_vote=None if j is None or j[1] is None else float(j[1]),
                    teacher_logprobs=None if t is None else decode_floats(t[0]),
                    reference_logprobs=None if t is None or t[1] is None else decode_floats(t[1]),
                    rewrite_ids=None if w is None else decode_ids(w[0]),
                    rewrite_logprobs=None if w is None else decode_floats(w[1]),
                )
        return out

    def stats(self) -> dict[str, Any]:
        """Counts for `/rl/status`."""
        with self.store.read() as c:
            by_status = dict(c.execute("SELECT status, COUNT(*) FROM judgements GROUP BY status").fetchall())
            scores = dict(
                c.execute("SELECT score, COUNT(*) FROM judgements WHERE status='done' GROUP BY score").fetchall()
            )
            done = c.execute("SELECT COUNT(*) FROM reward_sessions").fetchone()[0]
            teacher = c.execute("SELECT COUNT(*) FROM teacher_logprobs").fetchone()[0]
            hints = c.execute("SELECT COUNT(*) FROM hints").fetchone()[0]
            rewrites = c.execute("SELECT COUNT(*), COUNT(completion_token_ids) FROM rewrites").fetchone()
        return {
            "judgements": by_status,
            "scores": {str(k): v for k, v in scores.items()},
            "sessions_done": done,
            "hints": hints,
            "teacher_scored": teacher,
            "rewrites": int(rewrites[0]),
            "rewrites_scored": int(rewrites[1]),
        }
