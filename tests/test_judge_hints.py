"""The rule-based judge's hints as instructions (`clawbridge.devtools.judge_server.instruction_hint`).

The judge prompt asks a judge to write what the user wanted "as a short instruction hint"; a
capable hosted judge writes "Call the user Sam." where the user said "You didn't use my name.
Please call me Sam." These tests pin the rules that make the bundled keyword judge do the same
from the user's words alone, and the judge's answer over HTTP carrying it.
"""

from __future__ import annotations

import re

import httpx
import pytest

from clawbridge.devtools.judge_server import JudgeServer, instruction_hint, rule_based, topics
from clawbridge.devtools.personas import PERSONAS
from clawbridge.rewards.judge import judge_messages, parse_vote
from tests.rewards_support import assistant, user

FIRST_PERSON = re.compile(r"\b(I|me|my|mine|I'm|I'd)\b")


@pytest.mark.parametrize("said", [c for p in PERSONAS.values() for c in p.complaints])
def test_an_instruction_names_the_user_keeps_what_they_asked_and_drops_the_bare_complaint(said: str) -> None:
    hint = instruction_hint(said)
    assert not FIRST_PERSON.search(hint), hint
    assert not re.match(r"(?i)(too|that's|you didn't|no,|please)\b", hint), hint
    assert topics(hint) == topics(said) or topics(hint) & topics(said), (said, hint)  # same kind of thing asked
    for kept in re.findall(r"\b(Sam|30|one-line|one-sentence|lists?|bold|brief|short)\b", said):
        assert kept in hint, (said, hint)


@pytest.mark.parametrize(("said", "hint"), [
    ("Too long. Keep it under 30 words, please.", "Keep it under 30 words."),
    ("You didn't use my name. Please call me Sam.", "Call the user Sam."),
    ("I want the answer first in one line, then the rest on new lines.",
     "The user wants the answer first in one line, then the rest on new lines."),
    ("No, use French.", "Use French."),
    ("Too long.", "Too long."),  # only a complaint: kept as said, nothing better to write
    ("wrong", "Wrong."),
])
def test_instruction_examples(said: str, hint: str) -> None:
    assert instruction_hint(said) == hint


def test_the_judge_endpoint_writes_the_hint_the_way_it_was_started_with() -> None:
    prompt = judge_messages("How do I make tea?", assistant("Boil water. " * 30),
                            [user("Too long. Keep it under 30 words, please.")])
    hints = {}
    for style in ("words", "instruction"):
        with JudgeServer(rule_based(style)) as judge:  # type: ignore[arg-type]
            r = httpx.post(f"{judge.base_url}/chat/completions", json={"model": "rule-based", "messages": prompt},
                           timeout=10)
        hints[style] = parse_vote(r.json()["choices"][0]["message"]["content"])
    assert hints == {"words": (-1, "Too long. Keep it under 30 words, please."),
                     "instruction": (-1, "Keep it under 30 words.")}
