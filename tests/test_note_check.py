"""The judge's check of a noted call's candidates (`clawbridge.rewards.note_check`) and the
rule-based judge's answer to it (`clawbridge.devtools.judge_server.rule_based_follows`).

The checker against `ScriptedJudge`: what it sends, how it reads `FOLLOWS:`, that a judge that
fails, says nothing or is slow never fails the call, that the prompt is masked when the privacy
guard filters the judge, and that cancelling the call cancels the judge's request. The rule-based
judge's checks are compared with the personas' own rules (`clawbridge.devtools.personas`), which
it never reads, on answers written to pass or miss each. The path through the proxy is in
tests/test_best_of.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from clawbridge.devtools.judge_server import follows_note, instruction_hint, rule_based_answer
from clawbridge.devtools.personas import PERSONAS
from clawbridge.privacy.detect import FakePrivacyFilter
from clawbridge.privacy.guard import PrivacyGuard
from clawbridge.rewards.judge import NOTES_SECTION, ScriptedJudge
from clawbridge.rewards.note_check import ANSWERS_SECTION, NoteChecker, check_messages, parse_follows

ANSWERS = ["Sam, steep the leaves for three minutes.", "Steep the leaves.", "**Tea**\n- boil\n- steep"]


@pytest.mark.parametrize(("text", "n", "want"), [
    ("Two of them do.\nFOLLOWS: 1, 3", 3, [0, 2]),
    ("FOLLOWS: 2\nOn second thought:\nFOLLOWS: 3", 3, [2]),  # the last line counts
    ("**FOLLOWS:** 2", 3, [1]),
    ("FOLLOWS: 0, 2, 7, 2", 3, [1]),  # out of range ignored, repeats once
    ("None do.\nFOLLOWS: none", 3, []),
    ("Answer 1 is best.", 3, None),  # no FOLLOWS line: no judgement
    ("", 3, None),
])
def test_the_follows_line_is_read(text: str, n: int, want: list[int] | None) -> None:
    assert parse_follows(text, n) == want


def test_the_prompt_lists_the_notes_the_request_and_every_answer() -> None:
    messages = check_messages(["Call the user Sam.", "Keep it under 30 words."], "How do I make tea?", ANSWERS)
    assert [m["role"] for m in messages] == ["system", "user"]
    user = messages[1]["content"]
    assert f"## {NOTES_SECTION}\n[1] Call the user Sam.\n[2] Keep it under 30 words." in user
    assert "How do I make tea?" in user
    for i, answer in enumerate(ANSWERS, 1):
        assert f"### Answer {i}\n{answer}" in user
    assert user.index(f"## {ANSWERS_SECTION}") > user.index("How do I make tea?")


def _follows(checker: NoteChecker, answers: list[str] = ANSWERS) -> list[int] | None:
    return asyncio.run(checker.follows(["Call the user Sam."], "How do I make tea?", answers))


def test_the_checker_asks_once_at_temperature_zero_and_returns_what_the_judge_named() -> None:
    seen: list[dict[str, Any]] = []

    class Recording(ScriptedJudge):
        async def complete(self, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int,
                           seed: int | None = None) -> str:
            seen.append({"temperature": temperature, "max_tokens": max_tokens})
            return await super().complete(messages, temperature=temperature, max_tokens=max_tokens, seed=seed)

    judge = Recording(["Only the first uses the name.\nFOLLOWS: 1"])
    assert _follows(NoteChecker(judge, timeout_s=5, max_tokens=64)) == [0]
    assert seen == [{"temperature": 0.0, "max_tokens": 64}] and len(judge.calls) == 1


@pytest.mark.parametrize("answer", [RuntimeError("endpoint down"), "I like the second one.", "slow"])
def test_a_judge_that_fails_says_nothing_or_is_slow_gives_no_judgement(answer: object) -> None:
    class Slow(ScriptedJudge):
        async def complete(self, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int,
                           seed: int | None = None) -> str:
            if answer == "slow":
                await asyncio.sleep(30)
            return await super().complete(messages, temperature=temperature, max_tokens=max_tokens, seed=seed)

    checker = NoteChecker(Slow([answer]), timeout_s=0.2, max_tokens=64)
    assert _follows(checker) is None


def test_the_prompt_is_masked_when_the_guard_filters_the_judge() -> None:
    secret = "sam.r@example.com"
    guard = PrivacyGuard(FakePrivacyFilter({secret: "email"}), codec=None, train=False, judge=True)  # type: ignore[arg-type]
    judge = ScriptedJudge(["FOLLOWS: 1"])
    checker = NoteChecker(judge, timeout_s=5, max_tokens=64, privacy=guard)
    assert asyncio.run(checker.follows(["Call the user Sam."], f"Mail {secret} the recipe",
                                       [f"Sam, I mailed {secret}.", "Done."])) == [0]
    sent = "\n".join(m["content"] for m in judge.calls[0])
    assert secret not in sent and "Call the user Sam." in sent
    unfiltered = ScriptedJudge(["FOLLOWS: 1"])
    off = PrivacyGuard(FakePrivacyFilter({secret: "email"}), codec=None, train=True, judge=False)  # type: ignore[arg-type]
    asyncio.run(NoteChecker(unfiltered, timeout_s=5, max_tokens=64, privacy=off).follows(["x"], secret, ["a"]))
    assert secret in unfiltered.calls[0][1]["content"]


def test_cancelling_the_call_cancels_the_judges_request() -> None:
    state: dict[str, bool] = {}

    class Hanging(ScriptedJudge):
        async def complete(self, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int,
                           seed: int | None = None) -> str:
            state["started"] = True
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                state["cancelled"] = True
                raise
            return "FOLLOWS: 1"

    async def run() -> None:
        task = asyncio.ensure_future(NoteChecker(Hanging([]), timeout_s=30, max_tokens=64).follows(
            ["Call the user Sam."], "tea?", ANSWERS))
        for _ in range(200):
            if state.get("started"):
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert state == {"started": True, "cancelled": True}


# ------------------------------------------------------------------ the rule-based judge

PASSES = {
    "brief": "Paris is the capital of France.",
    "name": "Sure, Sam: Paris is the capital of France.",
    "lead": "Paris is the capital of France.\n\nIt has been the capital for centuries and is its largest city.",
    "plain": "Paris is the capital of France. It is also its largest city.",
}
MISSES = {
    "brief": " ".join(["Paris is the capital of France and it has been for a very long time."] * 3),
    "name": "Paris is the capital of France.",
    "lead": "Paris is the capital of France, and it has been for centuries, which is why most of the government "
            "sits there today and why so many people know it.",
    "plain": "**Paris** is the capital.\n- It is large.\n- It is old.",
}


@pytest.mark.parametrize("key", sorted(PERSONAS))
def test_the_rule_based_check_agrees_with_each_persona_on_its_own_notes(key: str) -> None:
    """Every correction a persona says, as the judge writes it for a note (an instruction), passes
    the answer that persona would accept and fails the one it would not."""
    persona = PERSONAS[key]
    assert persona.meets(PASSES[key]) and not persona.meets(MISSES[key])  # the examples are right
    for said in persona.complaints:
        note = instruction_hint(said)
        assert follows_note(PASSES[key], note), (note, PASSES[key])
        assert not follows_note(MISSES[key], note), (note, MISSES[key])


GAMED_LEADS = (
    "The answer is:\nBirds fly south for the winter to find food.",
    "Here's a possible solution:\n\nBake it at home with flour, water and yeast.",
    "Sure!\nBirds fly south for the winter to find food and warmth.",
    "What makes a good cup of coffee?\n\nOne and a half minutes of extraction.",
    "1. Choose a watermelon that feels heavy.\n2. Knock on it and listen.",
)
"""First lines that put no answer first (an introduction, a word, the question, a list item):
SmolLM2 learned to write these when they passed (seed 0, 32 sessions: 12 of 16 held-out answers, 1 under today's rule)."""


@pytest.mark.parametrize("answer", GAMED_LEADS)
def test_an_introduction_or_a_list_item_on_the_first_line_is_no_answer_first(answer: str) -> None:
    """Neither Ana nor the judge's check of her note takes these for a one-line answer first."""
    persona = PERSONAS["lead"]
    assert not persona.meets(answer)
    for said in persona.complaints:
        assert not follows_note(answer, instruction_hint(said)), (said, answer)


def test_a_note_the_rules_cannot_check_passes_every_answer() -> None:
    assert follows_note("Bonjour.", "Reply in French.") and follows_note("Hello.", "Reply in French.")


def test_the_rule_based_judge_answers_the_check_prompt_with_every_note() -> None:
    messages = check_messages(["Call the user Sam.", "Keep it under 30 words."], "How do I make tea?",
                              [ANSWERS[0], ANSWERS[1], "Sam, " + " ".join(["steep"] * 40), "## Sam\nSteep it."])
    text = rule_based_answer({"messages": messages})
    # 2: no name; 3: too long; a heading inside an answer is its own. Neither 1 nor 4 says "tea": when
    # no answer that follows is on topic by the lexical floor, all that follow are named.
    assert parse_follows(text, 4) == [0, 3], text
    none = rule_based_answer({"messages": check_messages(["Call the user Sam."], "tea?", ["Steep it."])})
    assert parse_follows(none, 1) == []


def test_among_answers_that_follow_the_notes_the_rule_based_judge_names_those_about_the_request() -> None:
    """SmolLM2 kept Maya's note and said nothing ("Tip: High Fries", seed 1, 32 sessions): the check
    prompt asks for answers that follow the notes AND answer the request."""
    request = "How can I save money on groceries?"
    answers = ["Tip: High Fries", "Plan your meals and buy groceries with a list.",
               " ".join(["Groceries cost less in bulk."] * 8), "The user's name is Maya and this is short answers only."]
    text = rule_based_answer({"messages": check_messages(["Keep it under 30 words."], request, answers)})
    assert parse_follows(text, 4) == [1], text  # 1 and 4 are short and off topic, 3 is about groceries but long
    assert "3 of 4 answers follow the notes, 1 of them about the request" in text
