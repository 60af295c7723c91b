"""`topic.on_topic`: the benchmark's floor for "does the answer still talk about the question",
read beside a preference whose check reads only the form (docs/training.md). The answers are ones
SmolLM2 gave in runs of `bench/learn_from_talk.py` (2026-12-07)."""

from __future__ import annotations

import pytest

from clawbridge.chat.topic import on_topic, topic_words
from clawbridge.devtools.personas import HELD_OUT_QUESTIONS, PERSONAS, TALK_QUESTIONS

MET_BUT_ABOUT_SOMETHING_ELSE = [
    ("How can I save money on groceries?", "Tip: High Fries"),
    ("What should I cook for dinner tonight?", "The user's name is Maya and this is short answers only."),
    ("Why do we yawn?", "The answer to your question is based on the prompt and hints."),
    ("Why do leaves change color in the fall?", "No need to start. Instead, a sample short answer is necessary.\n\n"
     "What's This Popular Fan Favorite"),
    ("How do I fix a squeaky door?", "There is a specific function to the number 11 in Pascal's Triangle.\nIt loops."),
]
ABOUT_THE_QUESTION = [
    ("What is a healthy snack?", "A healthy snack contains plenty of nutrients."),
    ("How do I plan a picnic?", "Planning a picnic requires careful planning."),
    ("Why do cats purr?", "In the feline world, purring symbolizes joy."),
    ("Why do leaves change color in the fall?", "For Fall, leaves change color due to changes in a constant cycle."),
    ("How do I start learning to draw?", "To begin drawing, pick up a pencil."),
]


@pytest.mark.parametrize(("question", "answer"), MET_BUT_ABOUT_SOMETHING_ELSE)
def test_an_answer_that_meets_a_form_but_shares_no_word_with_its_question_is_off_topic(question: str,
                                                                                       answer: str) -> None:
    assert any(p.meets(answer) for p in PERSONAS.values())  # a preference's form check took it
    assert not on_topic(question, answer)


@pytest.mark.parametrize(("question", "answer"), ABOUT_THE_QUESTION)
def test_an_answer_that_names_what_was_asked_about_is_on_topic_in_any_word_form(question: str, answer: str) -> None:
    assert on_topic(question, answer)


def test_words_that_only_say_what_kind_of_question_it_is_never_make_an_answer_on_topic() -> None:
    question = "What is a good way to start running?"
    assert not on_topic(question, "What a good way to start, is it not?")
    assert on_topic(question, "Run slowly at first.") is False  # a lexical check: "run" is not "running"'s stem
    assert on_topic(question, "Running three times a week builds up.")


def test_every_question_the_personas_ask_has_a_word_an_answer_can_share() -> None:
    for q in TALK_QUESTIONS + HELD_OUT_QUESTIONS:
        assert topic_words(q), q
