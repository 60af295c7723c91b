"""The judge checks which of a noted call's candidate answers follow the user's notes.

Best of n (`clawbridge.serving.best_of`) picks among answers by how much the note made their tokens
likelier. That finds an early end (brevity) but rarely singles out one word (a name: in 92% of
SmolLM2's groups of four an answer with it is there, and the likelihood picks it in 61%,
docs/training.md). A judge that reads the note can say which answers follow it, as a person would.

Rules:
- One judge call per noted call, at temperature 0, bounded by `timeout_s`: the person is waiting.
  The judge sees the user's notes (numbered), their request, and the candidates (numbered from 1),
  and ends with a line `FOLLOWS: <numbers>` (those that follow every note and still answer the
  request) or `FOLLOWS: none`. A note is a form (short, a layout, a name): a small model can keep
  it and say nothing ("Tip: High Fries" to a question about groceries; docs/training.md), and an
  answer like that served because it kept the form would be worse than the note's absence.
- The LAST such line counts; numbers outside 1..n are ignored. No such line, a transport error or
  the timeout: no judgement (None), and the pick is the likelihood's alone. A judgement never fails
  the call. Cancelling the call (client gone, user forgotten) cancels the judge's request.
- The judge only narrows: among the answers it says follow (none: all of them), the pick rules of
  `clawbridge.serving.best_of` choose (no echo, then the highest note score).
- With a privacy guard that filters the judge, the prompt is masked before it is sent
  (`clawbridge.privacy`), as every judge prompt is.

`ScriptedJudge` (`clawbridge.rewards.judge`) and the rule-based `clawbridge.devtools.judge_server`
answer this prompt in tests (tests/test_note_check.py, tests/test_best_of.py).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from clawbridge.rewards.judge import NOTES_SECTION, JudgeModel, cut_text, notes_listing

if TYPE_CHECKING:
    from clawbridge.privacy.guard import PrivacyGuard
    from clawbridge.serving.best_of import Follows

log = logging.getLogger("clawbridge.rewards")

ANSWERS_SECTION = "Candidate answers"
"""The check prompt's section of numbered answers (`### Answer i`); how a judge knows the task."""
REQUEST_SECTION = "The user's request"
SYSTEM_PROMPT = """You check an AI assistant's candidate answers against what its user asked for. \
You see the user's standing instructions (numbered), their request, and several candidate answers \
(numbered). Say which answers follow EVERY instruction and still answer the request: an answer \
that keeps the instructions but talks about something else does not count. Do not judge whether the \
content is right. Answer with a one-sentence reason, then a last line `FOLLOWS: <answer numbers, \
comma-separated>`, or `FOLLOWS: none` when no answer follows them all."""
_FOLLOWS_RE = re.compile(r"^\s*\**follows\**\s*[:=]\s*(.*?)\s*$", re.IGNORECASE | re.MULTILINE)


def check_messages(notes: Sequence[str], request: str, answers: Sequence[str]) -> list[dict[str, Any]]:
    """The check prompt (module rules) as chat messages."""
    shown = "\n\n".join(f"### Answer {i}\n{cut_text(a.strip() or '(no text)')}" for i, a in enumerate(answers, 1))
    user = (f"## {NOTES_SECTION}\n{notes_listing(notes)}\n\n## {REQUEST_SECTION}\n{cut_text(request.strip() or '(no text)')}\n\n"
            f"## {ANSWERS_SECTION}\n{shown}")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def parse_follows(text: str, n: int) -> list[int] | None:
    """The 0-based indices a judge's answer says follow (module rules); None when it said nothing."""
    said = _FOLLOWS_RE.findall(text or "")
    if not said:
        return None
    last = said[-1].strip().strip("*`").strip()
    if last.lower() in ("none", "no", "-", "n/a", "(none)", ""):
        return []
    picked = sorted({int(x) - 1 for x in re.findall(r"\d+", last) if 1 <= int(x) <= n})
    return picked


class NoteChecker:
    """Asks the judge which candidates follow a user's notes (module rules)."""

    def __init__(self, judge: JudgeModel, *, timeout_s: float, max_tokens: int,
                 privacy: PrivacyGuard | None = None) -> None:
        self.judge, self.timeout_s, self.max_tokens = judge, timeout_s, max_tokens
        self.privacy = privacy if privacy is not None and privacy.judge else None
        """Masks the prompt before it is sent; None: off."""

    async def follows(self, notes: Sequence[str], request: str, answers: Sequence[str]) -> list[int] | None:
        """The 0-based indices of `answers` that follow every note, or None (no judgement)."""
        messages = check_messages(notes, request, answers)
        if self.privacy is not None:
            messages = self.privacy.mask_messages(messages)
        try:
            text = await asyncio.wait_for(
                self.judge.complete(messages, temperature=0.0, max_tokens=self.max_tokens), self.timeout_s)
        except TimeoutError:
            log.warning("best of n: the judge did not check the answers within %.0f s; picked by likelihood",
                        self.timeout_s)
            return None
        except Exception as exc:
            log.warning("best of n: the judge could not check the answers (%s); picked by likelihood", exc)
            return None
        found = parse_follows(text, len(answers))
        if found is None:
            log.warning("best of n: the judge's check named no answer line (FOLLOWS:); picked by likelihood")
        return found

    def for_call(self, notes: Sequence[str], request: str,
                 decode: Callable[[list[int]], str]) -> Follows:
        """The checker one noted call hands `clawbridge.serving.best_of.best_of` (`Follows`): the
        candidates' ids decoded by `decode`, checked against `notes` for `request`."""
        async def follows(candidates: list[list[int]]) -> list[int] | None:
            return await self.follows(notes, request, [decode(ids) for ids in candidates])
        return follows
