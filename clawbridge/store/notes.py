"""Notes from talk: the store's side (`clawbridge.rewards.notes` says what they are for).

Operates on a `Store` through its `write()` / `read()` seam, like `clawbridge.store.users`.

Invariants:
- A note belongs to one user (`user_id`, '' for calls made without one) and is only ever read for
  that user's calls; every read and write here names the user it is for.
- At most `max_active` notes of a user are active: adding one more retires the oldest (reason
  `replaced`), so what a user's calls carry stays short.
- The same correction said again (the same text, case and spaces aside), or one the judge says
  asks for an active note again (`count_on`), does not make a second note: it counts on the first
  (`corrections`), which also keeps it from being the oldest to retire.
- Deleting a note removes its row (its text is gone, not hidden); forgetting a user removes hers
  with her turns (`turn_id`, `clawbridge.store.users`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from clawbridge.store.store import Store

ECHO_META = "notes_echoed"
"""A noted turn's `meta` flag: its answer echoed the note (`clawbridge.rewards.notes.echoes_note`),
so `TrainingStore.ingest_ended` drops it as `ECHO_DROP`: it is never trained."""
ECHO_DROP = "echoed_note"
"""`samples.dropped_reason` of a turn whose answer echoed its note."""

NoteStatus = Literal["active", "retired"]
MAX_NOTE_CHARS = 300
"""A note longer than this is cut (it rides along with every call of its user)."""
SQLITE_INT = range(-(2**63), 2**63)
"""The ids a row can have: any other id (`/rl/notes/18446744073709551616`) is no note, not an error."""


@dataclass(frozen=True)
class Note:
    """One note as stored."""

    note_id: int
    user_id: str
    text: str
    turn_id: str | None
    status: NoteStatus
    corrections: int
    created_at: float
    updated_at: float
    retired_at: float | None
    retired_reason: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"note_id": self.note_id, "user": self.user_id or None, "text": self.text, "turn_id": self.turn_id,
                "status": self.status, "corrections": self.corrections, "created_at": self.created_at,
                "updated_at": self.updated_at, "retired_at": self.retired_at, "retired_reason": self.retired_reason}


def normalized(text: str) -> str:
    """What makes two notes the same: lower case, single spaces, no end punctuation."""
    return re.sub(r"\s+", " ", text.strip().lower()).strip(" .!")


def clean(text: str) -> str:
    """The text as a note keeps it: one line, at most `MAX_NOTE_CHARS`."""
    one = re.sub(r"\s+", " ", text).strip()
    return one if len(one) <= MAX_NOTE_CHARS else one[: MAX_NOTE_CHARS - 1].rstrip() + "…"


def _row(r: Any) -> Note:
    return Note(int(r["note_id"]), str(r["user_id"]), str(r["text"]), r["turn_id"], r["status"],
                int(r["corrections"]), float(r["created_at"]), float(r["updated_at"]), r["retired_at"],
                r["retired_reason"])


class NoteStore:
    """Read and write the `notes` table of a `Store` (module invariants)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def add(self, user: str, text: str, turn_id: str | None, max_active: int) -> tuple[Note, bool]:
        """Add `text` as an active note of `user` (or count it on the active note with the same
        text); returns (the note, whether it is new). Retires the oldest beyond `max_active`."""
        text = clean(text)
        key = normalized(text)
        now = self.store.clock.now()
        with self.store.write() as c:
            for r in c.execute("SELECT * FROM notes WHERE user_id=? AND status='active'", (user,)).fetchall():
                if normalized(r["text"]) == key:
                    c.execute("UPDATE notes SET corrections = corrections + 1, updated_at=? WHERE note_id=?",
                              (now, r["note_id"]))
                    return _row(c.execute("SELECT * FROM notes WHERE note_id=?", (r["note_id"],)).fetchone()), False
            cur = c.execute("INSERT INTO notes(user_id, text, turn_id, status, created_at, updated_at) "
                            "VALUES(?,?,?,'active',?,?)", (user, text, turn_id, now, now))
            note_id = int(cur.lastrowid or 0)
            extra = c.execute("SELECT note_id FROM notes WHERE user_id=? AND status='active' "
                              "ORDER BY updated_at DESC, note_id DESC LIMIT -1 OFFSET ?",
                              (user, max(1, max_active))).fetchall()
            for r in extra:
                c.execute("UPDATE notes SET status='retired', retired_at=?, retired_reason='replaced' "
                          "WHERE note_id=?", (now, r["note_id"]))
            return _row(c.execute("SELECT * FROM notes WHERE note_id=?", (note_id,)).fetchone()), True

    def count_on(self, note_id: int, user: str) -> Note | None:
        """Count one more correction on `user`'s active note `note_id`; the note, or None when it
        is not an active note of `user` (deleted, retired, another user's)."""
        if note_id not in SQLITE_INT:
            return None
        now = self.store.clock.now()
        with self.store.write() as c:
            n = c.execute("UPDATE notes SET corrections = corrections + 1, updated_at=? "
                          "WHERE note_id=? AND user_id=? AND status='active'", (now, note_id, user)).rowcount
            if not n:
                return None
            return _row(c.execute("SELECT * FROM notes WHERE note_id=?", (note_id,)).fetchone())

    def active(self) -> dict[str, list[Note]]:
        """Every user's active notes, oldest first (what the proxy keeps in memory)."""
        out: dict[str, list[Note]] = {}
        with self.store.read() as c:
            for r in c.execute("SELECT * FROM notes WHERE status='active' ORDER BY created_at, note_id"):
                note = _row(r)
                out.setdefault(note.user_id, []).append(note)
        return out

    def listing(self, user: str | None = None, limit: int = 200) -> list[Note]:
        """Notes newest first: `user`'s, or everyone's (None)."""
        with self.store.read() as c:
            if user is None:
                rows = c.execute("SELECT * FROM notes ORDER BY note_id DESC LIMIT ?", (limit,)).fetchall()
            else:
                rows = c.execute("SELECT * FROM notes WHERE user_id=? ORDER BY note_id DESC LIMIT ?",
                                 (user, limit)).fetchall()
        return [_row(r) for r in rows]

    def get(self, note_id: int) -> Note | None:
        if note_id not in SQLITE_INT:
            return None
        with self.store.read() as c:
            r = c.execute("SELECT * FROM notes WHERE note_id=?", (note_id,)).fetchone()
        return None if r is None else _row(r)

    def delete(self, note_id: int, user: str | None = None) -> bool:
        """Delete note `note_id` (only if it is `user`'s, when a user is named); whether it existed."""
        if note_id not in SQLITE_INT:
            return False
        with self.store.write() as c:
            if user is None:
                n = c.execute("DELETE FROM notes WHERE note_id=?", (note_id,)).rowcount
            else:
                n = c.execute("DELETE FROM notes WHERE note_id=? AND user_id=?", (note_id, user)).rowcount
        return n > 0

    def delete_all(self, user: str) -> int:
        """Delete every note of `user`; how many."""
        with self.store.write() as c:
            return int(c.execute("DELETE FROM notes WHERE user_id=?", (user,)).rowcount)

    def retire(self, user: str, reason: str) -> int:
        """Retire `user`'s active notes (kept, listed, no longer put in calls); how many."""
        now = self.store.clock.now()
        with self.store.write() as c:
            return int(c.execute("UPDATE notes SET status='retired', retired_at=?, retired_reason=? "
                                 "WHERE user_id=? AND status='active'", (now, reason, user)).rowcount)
