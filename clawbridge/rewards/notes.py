"""Notes from talk: learn at once what a user asked for, keep it for good in the weights.

When the judge reads a correction in what a user said next ("Too long. Keep it under 30 words",
"Please call me Sam"), its hint becomes a NOTE of that user. From then on each of the user's main
calls carries the user's active notes, appended to its last user message exactly as on-policy
distillation's teacher sees a hint (`clawbridge.rewards.opd.HINT_TEMPLATE`): the next answer can
already follow it, without waiting for a training step. Training meanwhile teaches the weights to
answer that way WITHOUT the note: a noted turn trains on the prompt the call would have had without
its notes (`train_prompt_token_ids`), so the loss pulls the plain prompt toward what the noted
context sampled (context distillation through the recorded, rewarded samples). Once the weights
carry it, the notes retire.

Rules:
- A note belongs to one user ('' for calls without a user: the shared client key) and is only put
  in that user's calls: main turns only, never side turns, never a `NAME@N` call, never a call that
  says `X-Clawbridge-Notes: off`.
- Token exact where it matters: `prompt_token_ids` are what the model saw (notes included) and the
  completion ids and logprobs are what it sampled; the request recorded is the client's own. Only
  the prompt a turn TRAINS on differs from what was seen, and only by the notes.
- Retiring: once the user's notes are `check_after_steps` training steps old (the lane trained on
  the noted turns) AND the first answers of the user's last `check_after_met` sessions served with
  them (since the newest note) were all accepted (the note works: until it does, the weights
  cannot carry it, and a session without it would only show the user a miss), a share
  `check_share` of the user's NEW sessions (a stable hash of the session id) are check sessions,
  served without notes; a noted miss pauses them until the note works again, and a check that
  missed (the weights do not carry it yet) pauses them until the lane has trained
  `check_after_steps` more steps and `check_after_met` noted sessions since were accepted: the
  same person is not shown the same miss again and again while the weights hardly trained. When the last
  `retire_after` check sessions' first answers were all accepted (judge verdict > 0), the weights
  carry the notes: they retire (kept and listed as retired, no longer put in calls). A correction
  in a check session becomes a note again.
- An answer that ECHOES its note (`echoes_note`: it writes "Hint:", a note of its own in square
  brackets, or repeats four or more words of the hint in a row) is recorded as such
  (`meta.notes_echoed`) and never trained (`samples.dropped_reason = 'echoed_note'`): trained onto
  the plain prompt it would teach the weights to say the hint unasked, and a user's check ("did it
  use my name?") may even reward it.
- The user sees and deletes every note (`clawbridge notes`, `/rl/notes`, the dashboard); a deleted
  note is gone from the store and from the next call.
- The proxy reads notes from memory (`NoteBook.for_call`), never from the store on a model call's
  path; the book is reloaded off the loop after every change (`refresh`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clawbridge.chat.messages import ChatMessage
from clawbridge.config import NotesPlace, Settings, default_of
from clawbridge.rewards.opd import HINT_TEMPLATE
from clawbridge.store import Store
from clawbridge.store.notes import Note, NoteStore, normalized

log = logging.getLogger("clawbridge.notes")

NOTES_HEADER = "x-clawbridge-notes"
"""`X-Clawbridge-Notes: off` serves a call without its user's notes (an evaluation, a check)."""
CHECK_META = "check"
"""A turn's `meta.notes`: 'check' (a check session, served without notes) or the note ids it carried."""
FIRST_ANSWER = ("t.seq = (SELECT MIN(seq) FROM turns x WHERE x.session_id = t.session_id "
                "AND x.turn_type = 'main')")
"""SQL: turn `t` is its session's first main turn (what a person met first; how sessions are counted)."""
ECHO_MARKER = re.compile(r"\bhint\s*:", re.IGNORECASE)
"""How the notes' templates introduce a hint; an answer that writes it is repeating the note."""
ECHO_WORDS = 4
"""Words of the hint in a row that an answer repeating them echoes (shorter hints: the marker only)."""
BRACKETED = re.compile(r"\[([^\[\]]*)\](?!\()")
"""A span in square brackets that is not a Markdown link: the note's own form (`[Hint: ...]`). An
answer that writes one of `ECHO_WORDS` or more words is writing a note of its own ("[Your answer was
too long. Here is the short one]"), which SmolLM2 did at a high learning rate (docs/training.md)."""


@dataclass(frozen=True)
class NotesConfig:
    """The `[rewards]` notes options (`from_settings`)."""

    enabled: bool = default_of("notes")
    max_active: int = default_of("notes_max")
    check_share: float = default_of("notes_check_share")
    check_after_steps: int = default_of("notes_check_after_steps")
    check_after_met: int = default_of("notes_check_after_met")
    retire_after: int = default_of("notes_retire_after")
    place: NotesPlace = default_of("notes_place")
    best_of: int = default_of("notes_best_of")
    """Answers sampled per noted call, the one the notes explain best served (`clawbridge.serving.best_of`)."""
    best_of_more: int = default_of("notes_best_of_more")
    """Answers sampled once more when the judge says none of the first `best_of` follows the notes."""

    @classmethod
    def from_settings(cls, s: Settings) -> NotesConfig:
        return cls(s.notes, s.notes_max, s.notes_check_share, s.notes_check_after_steps, s.notes_check_after_met,
                   s.notes_retire_after, s.notes_place, s.notes_best_of, s.notes_best_of_more)


def note_hint(notes: Sequence[Note]) -> str:
    """The text a call carries for `notes` (one hint, oldest note first)."""
    return " ".join(n.text for n in notes)


SYSTEM_NOTE_TEMPLATE = "\n\nThe user told you how they want your answers: {hint}"
"""How `notes_place = "system"` adds a user's notes to the system message."""


def noted_messages(messages: Sequence[ChatMessage], hint: str, place: NotesPlace = "user") -> list[ChatMessage]:
    """What a noted call renders: `messages` with `hint` added where `place` says. `system`: a line
    (`SYSTEM_NOTE_TEMPLATE`) at the end of the first system (or developer) message, or a system
    message of its own first when there is none. `user`: appended to the last user message as
    `HINT_TEMPLATE`, as on-policy distillation's teacher sees a hint (a user message is added when
    there is none)."""
    out = list(messages)
    if place == "system":
        line = SYSTEM_NOTE_TEMPLATE.format(hint=hint.strip())
        for i, m in enumerate(out):
            if m.role in ("system", "developer"):
                out[i] = m.model_copy(update={"content": f"{m.content or ''}{line}"})
                return out
        return [ChatMessage(role="system", content=line.lstrip()), *out]
    suffix = HINT_TEMPLATE.format(hint=hint.strip())
    for i in range(len(out) - 1, -1, -1):
        if out[i].role == "user":
            out[i] = out[i].model_copy(update={"content": f"{out[i].content or ''}{suffix}"})
            return out
    out.append(ChatMessage(role="user", content=suffix.lstrip()))
    return out


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


QUOTED = re.compile(r"\"[^\"]*\"|“[^”]*”|(?<!\w)'[^']+'(?!\w)")
"""Words a note quotes ("sign off with 'Cheers from your assistant'"): what the user asks to be
said, so an answer that says them follows the note rather than echoing it."""


def echoes_note(answer: str, hint: str) -> bool:
    """Whether `answer` repeats the note it was served with (module rules): it writes the hint
    marker ("[Hint: ...", "Hint:"), a bracketed note of its own (`BRACKETED`, `ECHO_WORDS` or
    more words), or `ECHO_WORDS` or more of the hint's words in a row outside what the hint quotes."""
    if ECHO_MARKER.search(answer):
        return True
    if any(len(_words(m.group(1))) >= ECHO_WORDS for m in BRACKETED.finditer(answer)):
        return True
    said = f" {' '.join(_words(answer))} "
    for part in QUOTED.split(hint):
        asked = _words(part)
        if any(f" {' '.join(asked[i:i + ECHO_WORDS])} " in said for i in range(len(asked) - ECHO_WORDS + 1)):
            return True
    return False


def is_check_session(session_id: str, share: float) -> bool:
    """Whether a session of a user with trained notes is a check session (stable hash)."""
    if share <= 0:
        return False
    digest = hashlib.blake2b(f"notes-check:{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < share


class NoteBook:
    """The notes of one server: the store's table, and the active notes in memory for the proxy."""

    def __init__(self, store: Store, config: NotesConfig | None = None) -> None:
        self.store = store
        self.notes = NoteStore(store)
        self.config = config or NotesConfig()
        self._active: dict[str, list[Note]] = {}
        self._checking: set[str] = set()
        """Users whose notes are trained enough for check sessions."""
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the proxy's side (memory only)
    def for_call(self, user: str | None, session_id: str, turn_type: str) -> tuple[list[Note], bool]:
        """(the notes this call carries, whether it is a check session served without them)."""
        if not self.config.enabled or turn_type != "main":
            return [], False
        key = user or ""
        notes = self._active.get(key, [])
        if not notes:
            return [], False
        if key in self._checking and is_check_session(session_id, self.config.check_share):
            return [], True
        return notes, False

    # ------------------------------------------------------------------ changes (worker threads)
    def refresh(self) -> None:
        """Reload the active notes and which users are due for check sessions (off the loop)."""
        active = self.notes.active()
        checking = {user for user, notes in active.items() if self._due_for_checks(user, notes)}
        with self._lock:
            self._active, self._checking = active, checking

    def active_of(self, user: str) -> list[Note]:
        """`user`'s active notes, oldest first (from memory; what the judge is shown)."""
        with self._lock:
            return list(self._active.get(user, []))

    def add_from_hint(self, user: str, hint: str, turn_id: str, same_as: Note | None = None) -> Note | None:
        """A correction's hint becomes a note of `user`, or counts on one: `same_as` (one of the
        user's active notes the judge was shown) when the judge said the correction asks for it
        again and it is still an active note of `user`, else an active note with the same text.
        None when notes are off or there is nothing to note."""
        if not self.config.enabled:
            return None
        if same_as is not None and normalized(same_as.text) != normalized(hint):  # the same text: `add` counts it
            counted = self.notes.count_on(same_as.note_id, user)
            if counted is not None:
                log.info("correction %d of note %d for %s", counted.corrections, counted.note_id,
                         user or "the shared key")
                self.refresh()
                return counted
        if not hint.strip():
            return None
        note, new = self.notes.add(user, hint, turn_id, self.config.max_active)
        if new:
            log.info("note %d for %s from a correction: %r", note.note_id, user or "the shared key", note.text)
        self.refresh()
        return note

    def delete(self, note_id: int, user: str | None = None) -> bool:
        gone = self.notes.delete(note_id, user)
        self.refresh()
        return gone

    def observe_check(self, user: str) -> bool:
        """After a check session of `user` was judged: retire their notes when the last
        `retire_after` check sessions since their newest note were all accepted. Whether it did."""
        active = self.notes.active().get(user, [])
        n = self.config.retire_after
        if not active or n <= 0:
            return False
        since = max(x.created_at for x in active)
        verdicts = self._first_answers(user, since, noted=False, n=n)
        if len(verdicts) < n or not all(v > 0 for v in verdicts):
            return False
        count = self.notes.retire(user, f"the weights carry it: the last {n} sessions served without notes "
                                        "were accepted")
        log.info("retired %d note(s) of %s: %d check sessions in a row were accepted without them", count,
                 user or "the shared key", n)
        self.refresh()
        return count > 0

    # ------------------------------------------------------------------ queries
    def _due_for_checks(self, user: str, notes: list[Note]) -> bool:
        """Whether `user`'s sessions may be check sessions now (module rules: trained enough, and
        the note works, both counted from their newest note or, later, their last missed check)."""
        newest = max(x.created_at for x in notes)
        missed = self._last_missed_check(user, newest)
        trained_since = min(x.created_at for x in notes) if missed is None else missed
        if self._steps_since(user, trained_since) < self.config.check_after_steps:
            return False
        n = self.config.check_after_met
        if n <= 0:
            return True
        met = self._first_answers(user, newest if missed is None else max(newest, missed), noted=True, n=n)
        return len(met) >= n and all(v > 0 for v in met)

    def _last_missed_check(self, user: str, since: float) -> float | None:
        """When the first answer of `user`'s newest check session after `since` that the judge did
        not accept was served, or None."""
        with self.store.read() as c:
            row = c.execute(
                "SELECT MAX(t.created_at) FROM turns t JOIN sessions s ON s.session_id = t.session_id "
                "JOIN judgements j ON j.turn_id = t.turn_id "
                "WHERE COALESCE(s.user_id, '') = ? AND t.turn_type = 'main' AND t.created_at > ? "
                "AND json_extract(t.meta_json, '$.notes') = ? AND j.status = 'done' AND j.score IS NOT NULL "
                f"AND j.score <= 0 AND {FIRST_ANSWER}", (user, since, CHECK_META)).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def _steps_since(self, user: str, since: float) -> int:
        with self.store.read() as c:
            return int(c.execute(
                "SELECT COUNT(*) FROM policy_versions WHERE lane=? AND kind='step' AND status='committed' "
                "AND committed_at > ?", (user, since)).fetchone()[0])

    def _first_answers(self, user: str, since: float, noted: bool, n: int) -> list[float]:
        """Judge scores of the first answers of `user`'s newest `n` sessions after `since` that were
        served with notes (`noted`) or as check sessions without them, newest first."""
        kind = "json_extract(t.meta_json, '$.notes') <> ?" if noted else "json_extract(t.meta_json, '$.notes') = ?"
        with self.store.read() as c:
            rows = c.execute(
                "SELECT j.score FROM turns t JOIN sessions s ON s.session_id = t.session_id "
                "JOIN judgements j ON j.turn_id = t.turn_id "
                f"WHERE COALESCE(s.user_id, '') = ? AND t.turn_type = 'main' AND t.created_at > ? AND {kind} "
                f"AND j.status = 'done' AND j.score IS NOT NULL AND {FIRST_ANSWER} "
                "ORDER BY t.created_at DESC LIMIT ?", (user, since, CHECK_META, n)).fetchall()
        return [float(r[0]) for r in rows]

    def status(self, user: str | None = None) -> list[dict[str, Any]]:
        """Every note (of `user`, or everyone's) with how the user's sessions met it since: for
        `/rl/status`, `clawbridge status` and the dashboard ("is it learning what I asked?")."""
        out = []
        for note in self.notes.listing(user):
            out.append({**note.as_dict(), **self._since(note)})
        return out

    def _since(self, note: Note) -> dict[str, Any]:
        """Judged first answers of the note's user since it was made: how many, how many accepted,
        and when three in a row were first accepted (the effect became stable); and how many of the
        user's answers since were served best of n (`best_of_answers`, the largest n `best_of_n`), of
        those how many the judge checked (`best_of_judged`) and found one that follows the notes
        among (`best_of_judged_found`, `clawbridge.rewards.note_check`), and how many were sampled
        again because it found none in the first round (`best_of_resampled`)."""
        with self.store.read() as c:
            rows = c.execute(
                "SELECT t.session_id, j.score, t.created_at, json_extract(t.meta_json, '$.notes') AS noted "
                "FROM turns t JOIN sessions s ON s.session_id = t.session_id "
                "JOIN judgements j ON j.turn_id = t.turn_id "
                "WHERE COALESCE(s.user_id, '') = ? AND t.turn_type = 'main' AND t.created_at >= ? "
                f"AND j.status = 'done' AND j.score IS NOT NULL AND {FIRST_ANSWER} ORDER BY t.created_at",
                (note.user_id, note.created_at)).fetchall()
            picked = c.execute(
                "SELECT COUNT(*) AS answers, "
                "MAX(json_extract(t.meta_json, '$.best_of.n') - COALESCE(json_extract(t.meta_json, '$.best_of.resampled'), 0)) AS n, "
                "SUM(COALESCE(json_extract(t.meta_json, '$.best_of.resampled'), 0) > 0) AS resampled, "
                "SUM(json_type(t.meta_json, '$.best_of.follows') = 'array') AS judged, "
                "SUM(COALESCE(json_array_length(t.meta_json, '$.best_of.follows'), 0) > 0) AS judged_found "
                "FROM turns t JOIN sessions s ON s.session_id = t.session_id "
                "WHERE COALESCE(s.user_id, '') = ? AND t.turn_type = 'main' AND t.created_at >= ? "
                "AND json_extract(t.meta_json, '$.best_of.n') IS NOT NULL",
                (note.user_id, note.created_at)).fetchone()
        scores = [float(r["score"]) for r in rows]
        run, stable_after = 0, None
        for i, s in enumerate(scores):
            run = run + 1 if s > 0 else 0
            if run == 3 and stable_after is None:
                stable_after = i + 1
        plain = [float(r["score"]) for r in rows if r["noted"] == CHECK_META]
        return {"sessions_since": len(scores), "accepted_since": sum(1 for s in scores if s > 0),
                "stable_after_sessions": stable_after, "check_sessions": len(plain),
                "check_accepted": sum(1 for s in plain if s > 0),
                "best_of_answers": int(picked["answers"] or 0), "best_of_n": int(picked["n"] or 0),
                "best_of_judged": int(picked["judged"] or 0), "best_of_judged_found": int(picked["judged_found"] or 0),
                "best_of_resampled": int(picked["resampled"] or 0)}
