"""Does an answer talk about what was asked? A lexical floor for the gate's content check, the benchmark and
the rule-based judge.

A small model that learns a form (short, a layout, a name) can meet it and say nothing about the
question: "Tip: High Fries" to "How can I save money on groceries?" is under 30 words, and "No need
to start. Instead, a sample short answer is necessary." has Ana's layout. A person would not take
either for an answer. `on_topic` says whether an answer shares a content word with its question.

Rules:
- Content words are lowercased words of 3 letters or more that are not `TOPIC_STOPWORDS` (words that
  say what kind of question it is: "how", "good", "way", "start", "better"), cut to their first
  `TOPIC_PREFIX` letters, so word forms match ("purring" for "purr", "colors" for "color").
- It is lexical: it takes a wrong answer that names the topic, and misses a right one in other
  words ("Steep the leaves." to "How do I make tea?", "bedtime" for "sleep"). So it is a floor read
  beside a preference's rate (`bench/learn_from_talk.py`), the gate counts how many of a version's
  answers pass it and compares the count with the anchor's, never one answer alone
  (`clawbridge.promotion.content`), and the rule-based judge only PREFERS
  answers on topic among those that follow the notes (`judge_server.rule_based_follows`); it never
  rejects every answer for it.
- Every question the personas ask has a content word (tests/test_on_topic.py), so any question can
  be answered on topic.
"""

from __future__ import annotations

import re

_STOPWORD_TEXT = """
a an the and or but if so as at by for from in into of on to up out with about than then
i me my you your we our he she it its they them their this that these those there here
do does did doing done can could should would will shall may might must be is are was were been
have has had what why how when where which who whom whose not no yes very just also too
make makes made get gets good best better way ways thing things some any keep start fun tonight
day like likes more new last long longer stop fix change choose bring people home cup
"""
TOPIC_STOPWORDS: frozenset[str] = frozenset(_STOPWORD_TEXT.split())
"""Words that say what kind of question it is, not what it is about (module rules)."""
TOPIC_PREFIX = 4
"""Content words match on their first this many letters ("purring" for "purr", "colors" for "color")."""
_LETTERS = re.compile(r"[a-z]+")


def topic_words(text: str) -> set[str]:
    """The content words of `text`: lowercased words of 3 letters or more that are not
    `TOPIC_STOPWORDS`, each cut to its first `TOPIC_PREFIX` letters."""
    return {w[:TOPIC_PREFIX] for w in _LETTERS.findall(text.lower()) if len(w) >= 3 and w not in TOPIC_STOPWORDS}


def on_topic(question: str, answer: str) -> bool:
    """Does the answer share a content word with its question (module rules)? An answer that does
    not talks about something else ("The user's name is Maya and this is short answers only." to
    "What should I cook for dinner tonight?")."""
    return bool(topic_words(question) & topic_words(answer))
