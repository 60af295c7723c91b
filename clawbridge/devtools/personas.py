"""Simulated people who teach their agent by talking to it (`bench/learn_from_talk.py`, the tests).

A persona is a person with one preference about how their agent answers, who says so in their own
words whenever an answer misses it and thanks it otherwise, as people do. They never set a reward:
what they say is all the signal, read by a judge that sees only what happened next (the judge never
learns the persona's rule; `clawbridge.devtools.judge_server.talk_answer`).

Rules:
- Each persona's check is a plain function of the answer text (`Persona.meets`), the same one the
  benchmark measures the held-out preference rate with.
- What a persona says varies (several phrasings, chosen by a seeded generator), so a judge that
  keyed on one template would not pass for one that reads words.
- Everyday questions (`TALK_QUESTIONS`, asked while talking) and held-out ones
  (`HELD_OUT_QUESTIONS`, measured only) are disjoint from each other, from the demos' questions and
  from the built-in capability probe (`tests/test_capability_probe.py`).
- Every persona has a name in their profile (the system prompt an OpenClaw agent carries), so a
  preference about names is learnable and no other persona's answers depend on it.
- A persona's check reads the form only (length, a name, a layout): an answer can meet it and say
  nothing about the question ("Tip: High Fries" is under 30 words). `clawbridge.chat.topic`
  is the benchmark's separate floor for that, read beside the preference rate, never instead of it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

TALK_QUESTIONS: tuple[str, ...] = (
    "How do I make a cup of tea?",
    "Why is the sky blue?",
    "What should I pack for a day at the beach?",
    "How can I sleep better?",
    "What is a good way to start running?",
    "How do I keep a houseplant alive?",
    "What should I cook for dinner tonight?",
    "How do I remember people's names?",
    "Why do cats purr?",
    "How can I save money on groceries?",
    "What is a fun thing to do on a rainy day?",
    "How do I write a thank-you note?",
    "Why do leaves change color in the fall?",
    "How do I get better at chess?",
    "What is a good gift for a friend who likes books?",
    "How do I clean a cast iron pan?",
    "How can I focus better when I work?",
    "What makes a good cup of coffee?",
    "How do I start learning to draw?",
    "Why do we yawn?",
    "How do I plan a picnic?",
    "What is a healthy snack?",
    "How do I fix a squeaky door?",
    "How can I be more patient?",
)
"""What the personas ask while they talk (each session asks one, cycling in a seeded order)."""

HELD_OUT_QUESTIONS: tuple[str, ...] = (
    "How do I bake bread at home?",
    "Why do birds fly south for the winter?",
    "What should I bring to a job interview?",
    "How can I stop procrastinating?",
    "How do I choose a good watermelon?",
    "What is a good way to learn a new language?",
    "How do I make my bike tires last longer?",
    "Why does the moon change shape?",
)
"""Never asked while talking: the held-out preference rate is measured on these."""

THANKS: tuple[str, ...] = (
    "Thanks, that helps.", "Great, thank you!", "Perfect, thanks.", "Nice, that's what I needed.",
    "Good answer, thanks!",
)

_WORD = re.compile(r"[A-Za-z0-9'’-]+")
_LIST_LINE = re.compile(r"^\s*([-*•]|\d+[.)])\s+\S", re.MULTILINE)
_MARKDOWN = re.compile(r"\*\*|__|^#{1,6}\s", re.MULTILINE)


def words(text: str) -> int:
    return len(_WORD.findall(text))


@dataclass(frozen=True)
class Persona:
    """One person and the preference they teach by talking."""

    key: str
    """Short name (`--persona`, table rows)."""
    user_name: str
    """Their name, in the agent's profile of them (the system prompt)."""
    wants: str
    """The preference in words, for tables and docs (never shown to the judge or the model)."""
    meets: Callable[[str], bool]
    """Does an answer meet the preference? (held-out rate, sessions until stable, the user's reply)"""
    complaints: tuple[str, ...]
    """What they say when an answer misses it (one chosen per miss)."""

    def system_prompt(self) -> str:
        """The agent's system prompt for this user, as an OpenClaw agent carries one (identity and
        the user's profile); it never states the preference."""
        return (f"You are Claw, a helpful personal assistant running in OpenClaw. "
                f"The user's name is {self.user_name}.")

    def reply(self, answer: str, rng: random.Random) -> tuple[str, bool]:
        """(what the person says next, whether the answer met the preference)."""
        if self.meets(answer):
            return rng.choice(THANKS), True
        return rng.choice(self.complaints), False


def _under_30_words(text: str) -> bool:
    return 0 < words(text) < 30


def _plain(text: str) -> bool:
    return bool(text.strip()) and not _LIST_LINE.search(text) and not _MARKDOWN.search(text)


def _lead_line(text: str) -> bool:
    """A one-line answer first, then details after a line break. The first line must answer: a
    statement of 3 to 20 words, not a list item, an introduction ("The answer is:", "Here's a
    possible solution:", "Sure!") or a question (her own, repeated), which a person asking for the
    answer first would not take for one (before 2026-12-07 those passed, and SmolLM2 learned to
    write them)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (len(lines) >= 2 and 3 <= words(lines[0]) <= 20 and lines[0][-1] in ".!"
            and not _LIST_LINE.match(lines[0]))


def _names(name: str) -> Callable[[str], bool]:
    pattern = re.compile(rf"\b{re.escape(name)}\b", re.IGNORECASE)
    return lambda text: pattern.search(text) is not None


PERSONAS: dict[str, Persona] = {p.key: p for p in (
    Persona("brief", "Maya", "answers under 30 words", _under_30_words, (
        "Too long. Keep it under 30 words, please.",
        "That's way too much text. Short answers only.",
        "Please be brief, just a sentence or two.",
        "Too wordy. Give me the short version next time.",
    )),
    Persona("name", "Sam", "calls the user by their name", _names("Sam"), (
        "You didn't use my name. Please call me Sam.",
        "Call me by my name, Sam, when you answer.",
        "Don't forget to address me as Sam.",
        "Please say my name, Sam, in your answers.",
    )),
    Persona("lead", "Ana", "a one-line answer first, then details", _lead_line, (
        "Don't bury the answer. Give me a one-line answer first, then the details.",
        "Start with the short answer in one line, then explain below it.",
        "No, put a one-sentence answer on the first line, details after.",
        "I want the answer first in one line, then the rest on new lines.",
    )),
    Persona("plain", "Leo", "plain sentences, no lists or bold", _plain, (
        "No lists or bold, please. Just plain sentences.",
        "Don't use bullet points or numbered lists. Write it as normal sentences.",
        "Please stop formatting; plain sentences only.",
        "No markdown, no lists. Just talk to me in sentences.",
    )),
)}
"""The personas the benchmark teaches by (`bench/learn_from_talk.py --persona`)."""


def question_order(seed: int) -> list[str]:
    """The order a persona asks `TALK_QUESTIONS` in (a seeded shuffle, cycled)."""
    order = list(TALK_QUESTIONS)
    random.Random(f"questions:{seed}").shuffle(order)
    return order


assert not set(TALK_QUESTIONS) & set(HELD_OUT_QUESTIONS)
