"""Notes from talk in words: what `clawbridge status`, `clawbridge notes` and the dashboard say
about each note ("is it learning what I asked?"), from `NoteBook.status()` (`/rl/status`'
`notes`, `/rl/notes`).

One place for the wording, so the three read the same: a note's owner, how often the correction
was said, how often the user's sessions met it since, whether and when that became stable, and
whether the note still rides along with the calls or the weights carry it.
"""

from __future__ import annotations

from typing import Any

STABLE_RUN = 3
"""Accepted first answers in a row that make a note's effect stable (`NoteBook._since`)."""


def owner_words(user: str | None) -> str:
    """Whose note: a user's name, or the calls made without a user."""
    return user if user else "the shared key (calls without a user)"


def met_words(note: dict[str, Any]) -> str:
    """How often the user's sessions met the note since it was made (judged first answers), and how
    many of the user's answers since were picked best of n."""
    n, ok = int(note.get("sessions_since") or 0), int(note.get("accepted_since") or 0)
    text = f"{ok} of {n} sessions since ({ok / n:.0%})" if n else "no session judged since"
    checks = int(note.get("check_sessions") or 0)
    if checks:
        text += f"; {note.get('check_accepted', 0)} of {checks} served without the note"
    picked = picked_words(note)
    return f"{text}; {picked}" if picked else text


def picked_words(note: dict[str, Any]) -> str | None:
    """How many of the user's answers since the note were picked among several samples (best of
    n, `clawbridge.serving.best_of`), and in how many of those the judge found one that follows
    the note (when it checked them, `clawbridge.rewards.note_check`; how many it had sampled again,
    `notes_best_of_more`); None when none was."""
    answers, n = int(note.get("best_of_answers") or 0), int(note.get("best_of_n") or 0)
    if answers == 0:
        return None
    text = f"{answers} answer{'s' if answers != 1 else ''} served as the best of {n} at following it"
    judged = int(note.get("best_of_judged") or 0)
    if judged:
        again = int(note.get("best_of_resampled") or 0)
        more = f", {again} sampled again when it found none at first" if again else ""
        text += f" (the judge found one that does among {note.get('best_of_judged_found', 0)} of {judged}{more})"
    return text


def stable_words(note: dict[str, Any]) -> str:
    """When the effect became stable (`STABLE_RUN` accepted in a row), or that it is not yet."""
    after = note.get("stable_after_sessions")
    return f"stable after {after} sessions" if after else "not stable yet"


def state_words(note: dict[str, Any]) -> str:
    """Whether the note is carried by the calls, or retired (and why)."""
    if note.get("status") == "active":
        return "active: carried by the user's calls"
    reason = note.get("retired_reason") or ""
    if reason == "replaced":
        return "retired: replaced by a newer note (at most notes_max are active)"
    if reason.startswith("the weights carry it"):
        return f"retired: {reason}"
    return f"retired: {reason}" if reason else "retired"


def corrections_words(note: dict[str, Any]) -> str:
    n = int(note.get("corrections") or 0)
    if not note.get("turn_id") and n <= 1:
        return "added by hand"
    return "said once" if n == 1 else f"said {n} times"


def described(note: dict[str, Any]) -> dict[str, str]:
    """Every column of a note in words (the CLI table, the dashboard)."""
    return {"owner": owner_words(note.get("user")), "text": str(note.get("text", "")),
            "corrections": corrections_words(note), "met": met_words(note), "stable": stable_words(note),
            "state": state_words(note)}


def notes_lines(notes: list[dict[str, Any]] | None) -> list[str]:
    """The "learning from talk" section of `clawbridge status`: the notes grouped by their user
    (active first), one line each; nothing when notes are off or there is none."""
    if not notes:
        return []
    by_owner: dict[str, list[dict[str, Any]]] = {}
    for n in notes:
        by_owner.setdefault(owner_words(n.get("user")), []).append(n)
    lines = ["learning from talk (what the judge read in corrections; `clawbridge notes` lists and deletes):"]
    for owner in sorted(by_owner):
        group = sorted(by_owner[owner], key=lambda n: (n.get("status") != "active", -int(n.get("note_id") or 0)))
        active = sum(1 for n in group if n.get("status") == "active")
        lines.append(f"  {owner}: {active} active, {len(group) - active} retired")
        for n in group:
            d = described(n)
            lines.append(f"    \"{d['text']}\" ({d['corrections']}): met by {d['met']}; {d['stable']}; {d['state']}")
    return lines
