"""The real-model demo: SmolLM2-135M-Instruct learns "keep it short" from a user's replies, with LoRA.

The slow test runs `clawbridge.devtools.realdemo.run_real_demo` end to end (the real proxy, the real
`openai` SDK, the rule-based judge endpoint, LoRA training and publishing) and checks the held-out
preference rate rises by MARGIN while the capability check holds; the fast ones check the
pieces it is measured with.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from clawbridge.cli.demo_real import CAPABILITY_BOUND
from clawbridge.devtools.judge_server import rule_based_verdict
from clawbridge.devtools.realdemo import (
    COMPLAINT,
    FACTS,
    HELD_OUT,
    THANKS,
    TRAIN_ANSWERS,
    TRAIN_PROMPTS,
    WRONG,
    Answer,
    Evaluation,
    RealDemoConfig,
    _gate_settled,
    _settled,
    facts_eval_set,
    run_real_demo,
    user_reply,
)
from clawbridge.rewards.judge import judge_messages

MARGIN = 0.2
"""Held-out preference-rate rise the slow test asserts. Five runs of the shipped demo (seeds 0-4,
128 sessions, lr 1e-3, whole groups, the no-signal rule; docs/real-model.md) rose by +0.41 to
+0.67 and the capability check never fell; 0.2 leaves room for a different machine's timing."""


def test_the_users_replies_are_the_judges_signal() -> None:
    answer = {"role": "assistant", "content": "A word that rhymes with cat is hat. Other words are bat, mat..."}
    for reply, score in ((COMPLAINT, -1), (WRONG, -1), (THANKS, 1)):
        prompt = judge_messages(TRAIN_PROMPTS[0], answer, [{"role": "user", "content": reply}])[1]["content"]
        assert rule_based_verdict(prompt)[0] == score


def test_the_user_asks_for_short_and_right() -> None:
    q = "What is 5 plus 7?"
    assert TRAIN_ANSWERS[q] == {"12", "twelve"}
    assert user_reply(q, "5 plus 7 is 12.", short=True) == THANKS
    assert user_reply(q, "Twelve!", short=True) == THANKS
    assert user_reply(q, "It is 112.", short=True) == WRONG  # whole words only
    assert user_reply(q, "Cat.", short=True) == WRONG
    assert user_reply(q, "5 plus 7 is 12, because ...", short=False) == COMPLAINT  # long comes first
    open_question = "How are you today?"
    assert open_question in TRAIN_PROMPTS and open_question not in TRAIN_ANSWERS
    assert user_reply(open_question, "Fine.", short=True) == THANKS


def test_prompt_sets_are_disjoint_and_measures_count_what_they_say() -> None:
    facts = {q for q, _ in FACTS}
    assert not set(TRAIN_PROMPTS) & set(HELD_OUT) and not set(TRAIN_PROMPTS) & facts and not set(HELD_OUT) & facts
    held = [Answer(q, "x", 5, "stop") for q in HELD_OUT[:3]] + [Answer(q, "x", 32, "length") for q in HELD_OUT[3:4]]
    held.append(Answer(HELD_OUT[4], "x", 40, "stop"))  # stopped, but past the threshold: long
    fact_answers = [Answer(FACTS[0][0], "The capital of France is Paris.", 8, "stop"),
                    Answer(FACTS[1][0], "It is Kyoto.", 4, "stop")]
    ev = Evaluation(0, held, fact_answers, short_tokens=32)
    assert ev.preference_rate == pytest.approx(3 / 5)
    assert ev.capability == pytest.approx(1 / 2)


def test_the_facts_eval_set_passes_exactly_what_the_capability_check_counts(tmp_path: Path) -> None:
    """`--promotion eval` scores versions on FACTS: an item passes (promotion's runner: the regex
    found anywhere, case-insensitive) exactly when `Evaluation.capability` counts the answer."""
    import re

    from clawbridge.promotion.evalset import load_eval_set

    es = load_eval_set(facts_eval_set(tmp_path / "facts.jsonl"), max_tokens=32)
    assert es.regex_only and len(es.items) == len(FACTS)
    texts = ["The capital is PARIS.", "Leonardo da Vinci painted it.", "Da Vinci.", "I think it is Neptune.",
             "mars", "Tokyo!", "", "The answer is rome-ish", "portuguese (Brazilian)", "Shakespeare's"]
    for item, (q, _) in zip(es.items, FACTS, strict=True):
        assert item.messages == ({"role": "user", "content": q},)
        for text in texts:
            counted = Evaluation(0, [], [Answer(q, text, 3, "stop")], 32).capability == 1.0
            assert (re.search(item.expect, text, re.IGNORECASE) is not None) == counted, (q, text)


def test_the_gate_is_settled_once_every_step_version_is_decided() -> None:
    assert _gate_settled(None, 3) and _gate_settled({"mode": "off", "decisions": []}, 3)
    two = [{"version": 2, "source": "eval"}, {"version": 1, "source": "eval"}, {"version": 9, "source": "admin"}]
    assert not _gate_settled({"mode": "eval", "decisions": two[:1], "holding": None}, 2)
    assert not _gate_settled({"mode": "eval", "decisions": two, "holding": "evaluating candidate v3"}, 2)
    assert _gate_settled({"mode": "eval", "decisions": two, "holding": None}, 2)


def test_settled_waits_for_every_judgement_and_every_rewarded_turn() -> None:
    # 36 evaluation calls are never rewarded: they do not hold the demo up; 3 rewarded turns do
    trainer = {"config": {"batch_size": 8}, "in_step": False, "backlog": 36, "waiting": {"unrewarded_turns": 36}}
    assert _settled(trainer, {"judgements": {"done": 63, "failed": 1}}, 64)
    assert not _settled(trainer, {"judgements": {"done": 60, "running": 4}}, 64)
    assert not _settled({**trainer, "in_step": True}, {"judgements": {"done": 64}}, 64)
    assert not _settled({**trainer, "backlog": 39}, {"judgements": {"done": 64}}, 64)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_smollm2_learns_short_answers_with_lora_and_keeps_its_facts(smollm2_dir: Path, tmp_path: Path) -> None:
    cfg = RealDemoConfig()
    assert cfg.lora_rank > 0
    result = run_real_demo(cfg, tmp_path / "demo", say=print, model_dir=smollm2_dir)
    before, after = result.before, result.after
    assert before is not None and after is not None
    # every step published a version and the evaluation after training answered with the last one (a
    # step count bound would be wrong: batches without a signal are skipped; runs made 9 to 18 steps)
    assert result.steps > 0 and after.policy_version == before.policy_version + result.steps
    assert after.preference_rate >= before.preference_rate + MARGIN, (before.preference_rate, after.preference_rate)
    assert after.capability >= before.capability - CAPABILITY_BOUND, (before.capability, after.capability)
    assert result.plot is not None and result.plot.stat().st_size > 0


def test_demo_rejects_an_unknown_model() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "clawbridge.cli.main", "demo", "--model", "gpt-17"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--model must be tiny or smollm2" in out.stderr
