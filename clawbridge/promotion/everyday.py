"""The everyday guard: is a candidate still likely to say what the anchor says to everyday questions?

Why: every other check of the gate is short facts (the capability probe, its likelihood guard,
rehearsal), and facts are what rehearsal trains, so a candidate can keep them all while its
everyday answers fall apart. Measured on SmolLM2 taught by talk at a 13x learning rate
(docs/training.md, "Tried: Tinker's rate again"): the gate promoted 23 and 24 of 32 versions, the
facts rose, and the answers became word salad and self-made notes. How likely such a version still
finds the anchor's own greedy answers to everyday questions separates it from one that learned its
users' preferences (bench/everyday_guard.py on the SmolLM2 runs of docs/training.md: 0.12 and 0.17
nats per token of drift after 30-35 steps at the default rate, 0.28-0.38 within 4-19 steps and
0.6-0.8 with word salad at the 13x rate).

So, with `everyday_guard_nats` > 0, the probe on, and a sampler that scores given tokens, every
candidate also faces a second reference set (`clawbridge.promotion.likelihood`, guard `EVERYDAY`):
the anchor's greedy answers to `EVERYDAY_QUESTIONS` (token exact, `EVERYDAY_MAX_TOKENS` at most),
with the anchor's logprobs of them. A candidate must stay within `everyday_guard_nats` per token of
them, on average over all answers.

Invariants:
- The questions are disjoint from the personas' (`clawbridge.devtools.personas`), from the demos'
  and from the capability probe's (`tests/test_everyday_guard.py`): the gate is never tuned on what
  a benchmark measures.
- The bar is looser than the probe's (0.25 against 0.1 nats per token): what a person teaches by
  talking is how everyday answers read, so they move where facts should not; a preference moves a
  few tokens of an answer (a name, where it stops, a list marker), word salad moves all of them.
- Off exactly where the likelihood guard is off (no probe, no scorer, an anchor that knows no
  probe fact, or its bar 0); its reference set is built once per anchor, like the guard's.

The same questions are also asked IN THE AGENT'S CONTEXT (`in_context_set`, guard `IN_CONTEXT`,
the same bar): under a profile-like system prompt (`AGENT_PROFILE`) with a note in the call
(`AGENT_NOTE`, put where `notes_place` puts a user's notes, by `notes.noted_messages`). Why: at
the 13x rate (docs/training.md, "Tried: the 13x rate again, with the everyday guard") the plain
answers stayed at the bar while the answers people were served, with their profile and a note,
fell apart (a third echoed the note; others wrote notes of their own). The gate read only what
stayed sane. The profile and note are the gate's own: no persona's system prompt, no
persona's preference (`tests/test_everyday_guard.py`).
"""

from __future__ import annotations

from clawbridge.chat.messages import parse_messages
from clawbridge.config import NotesPlace
from clawbridge.promotion.evalset import EvalItem, EvalSet, digest_of
from clawbridge.rewards.notes import noted_messages

EVERYDAY_QUESTIONS: tuple[str, ...] = (
    "How do I fold a fitted sheet?",
    "What is a good way to spend a Sunday morning?",
    "How do I tie a tie?",
    "Why do onions make people cry?",
    "How should I get ready for a long flight?",
    "What is a simple salad I can make?",
    "How do I wash a wool sweater?",
    "Why do dogs wag their tails?",
    "How can I make my mornings less rushed?",
    "What is a good board game for a family?",
    "How do I keep bread fresh?",
    "Why do we get hiccups?",
)
"""What the anchor answers once per anchor; candidates are scored on those answers."""

EVERYDAY_MAX_TOKENS = 48
"""The longest reference answer: enough for the answer's opening and its first details."""

EVERYDAY_SOURCE = "everyday answers"
"""How decisions and status name the questions (`EvalSet.source`)."""


def everyday_set() -> EvalSet:
    """The questions as `open` items (no right answer: only the anchor's answers are scored)."""
    items = []
    for n, question in enumerate(EVERYDAY_QUESTIONS, start=1):
        messages = ({"role": "user", "content": question},)
        items.append(EvalItem("open", f"everyday-{n}", messages, tuple(parse_messages(list(messages)))))
    return EvalSet(tuple(items), EVERYDAY_SOURCE,
                   digest_of(["everyday", EVERYDAY_MAX_TOKENS, *EVERYDAY_QUESTIONS]), EVERYDAY_MAX_TOKENS)


AGENT_PROFILE = ("You are a personal assistant. You help Robin, a teacher who lives in Lisbon, "
                 "with everyday questions.")
"""The system prompt of the in-context questions: what an agent's profile of its user looks like."""

AGENT_NOTE = "Mention one thing people often get wrong."
"""The note of the in-context questions: a user's note, about no persona's preference."""

IN_CONTEXT_SOURCE = "everyday answers in context"
"""How decisions and status name the in-context questions (`EvalSet.source`)."""


def in_context_set(place: NotesPlace = "user") -> EvalSet:
    """`EVERYDAY_QUESTIONS` as a noted call of an agent serves them (module doc): the profile as
    the system message and `AGENT_NOTE` where `place` puts a user's notes."""
    items = []
    for n, question in enumerate(EVERYDAY_QUESTIONS, start=1):
        plain = [{"role": "system", "content": AGENT_PROFILE}, {"role": "user", "content": question}]
        chat = tuple(noted_messages(parse_messages(plain), AGENT_NOTE, place))
        messages = tuple({"role": m.role, "content": m.content} for m in chat)
        items.append(EvalItem("open", f"in-context-{n}", messages, chat))
    return EvalSet(tuple(items), IN_CONTEXT_SOURCE,
                   digest_of(["in_context", EVERYDAY_MAX_TOKENS, AGENT_PROFILE, AGENT_NOTE, place,
                              *EVERYDAY_QUESTIONS]), EVERYDAY_MAX_TOKENS)
