"""The checks of `clawbridge doctor --learning` that the real-server tests (test_doctor_learning.py)
do not reach in a few seconds: a judge that always answers unclear, failed steps, a gate that
rejects every version, a rollback that holds, stale drops. The checks are pure functions of the
store's figures (`LearningFacts`) and `/rl/status`, so each state is written here as figures."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from clawbridge.cli.learning import blocked, diagnose, report_lines
from clawbridge.config import Settings
from clawbridge.promotion.backoff import StepScale
from clawbridge.store.learning import LearningFacts

HEALTHY = LearningFacts(
    now=1000.0, sessions_active=0, sessions_ended=10, main_turns=20, active_turns=0, most_idle_active_s=None,
    rewards=20, recent_rewards=[1.0, -1.0, 1.0, 0.0], groups=0, equal_groups=0, unrewarded_turns=0, dropped={},
    left_queue={"trained": 20}, judgements={"done": 10}, verdicts={1: 6, -1: 4}, votes=10, vote_errors=0,
    last_vote_error=None, steps_ok=5, steps_failed=0, recent_steps=[(5, "ok", None), (4, "ok", None)],
    decisions=[(5, "promoted", "within the slack")])
STATUS: dict[str, Any] = {"trainer": {"config": {"baseline": "group_mean"}}, "judge": {"judge_model": "m@u"},
                          "promotion": {"mode": "probe", "held_version": None}}


def words(facts: LearningFacts, status: dict[str, Any] | None = STATUS) -> tuple[bool, str]:
    checks = diagnose(status, facts, Settings())
    return blocked(checks), " ".join(" ".join(report_lines(checks)).split())


def test_healthy_figures_say_so() -> None:
    stuck, text = words(HEALTHY)
    assert not stuck and text.startswith("learning looks healthy ")
    assert "OK the judge answers, and clearly: 10 of the last 10 turn(s) judged: 6 accepted, 4 corrected, 0 " \
           "unclear; 0 failed" in text
    assert "OK the gate keeps what was trained: the last 1 version(s) were promoted" in text


def test_a_judge_that_always_answers_unclear_blocks() -> None:
    stuck, text = words(replace(HEALTHY, verdicts={0: 10}))
    assert stuck and "BLOCKS the judge answers, and clearly: every verdict was unclear: 10 of the last 10" in text
    assert "an odd number of judge_votes" in text
    stuck, text = words(replace(HEALTHY, verdicts={0: 6, 1: 4}))
    assert not stuck and "WARN the judge answers, and clearly" in text


def test_a_failing_last_step_blocks_and_an_earlier_one_warns() -> None:
    failed = [(6, "failed", "CUDA out of memory"), (5, "ok", None)]
    stuck, text = words(replace(HEALTHY, recent_steps=failed, steps_failed=1))
    assert stuck and "BLOCKS training steps succeed: the last step (6) failed: CUDA out of memory; 1 of the last 2" in text
    stuck, text = words(replace(HEALTHY, recent_steps=list(reversed(failed)), steps_failed=1))
    assert not stuck and "WARN training steps succeed: 1 of the last 2 steps failed" in text


def test_a_gate_that_rejects_every_version_and_a_rollback_hold_block() -> None:
    rejected = [(v, "rejected", "lost 3 facts") for v in (9, 8, 7)]
    stuck, text = words(replace(HEALTHY, decisions=rejected))
    assert stuck and "BLOCKS the gate keeps what was trained: the gate rejected the last 3 versions (v9, v8, v7); " \
                     "the last reason: lost 3 facts" in text
    held = {**STATUS, "promotion": {"mode": "probe", "held_version": 3}}
    stuck, text = words(HEALTHY, held)
    assert stuck and "a rollback to v3 holds training" in text and "`clawbridge resume`" in text


def test_a_gate_held_by_the_likelihood_guard_says_how_to_move_on() -> None:
    """Once the serving version stands at the guard's bar, every step trains on from it and goes
    past: measured on SmolLM2, 14 rejections in a row. The advice names the way out."""
    reason = ("likelihood of anchor v0's 27 correct probe answers -0.105 nats per token, beyond the bar of -0.1 "
              "(capability_probe_nats)")
    rejected = [(v, "rejected", reason) for v in (45, 43, 41)]
    status = {**STATUS, "promotion": {"mode": "probe", "serving_version": 18}}
    stuck, text = words(replace(HEALTHY, decisions=rejected), status)
    assert stuck and "the gate rejected the last 3 versions (v45, v43, v41)" in text
    assert "`clawbridge promote 18` accepts the serving version as the new baseline" in text
    assert "a larger capability_probe_nats allows more drift" in text and "already steps" not in text
    shorter = StepScale(0.125, 3)
    status["promotion"]["step_scale"] = asdict(shorter) | {"words": shorter.words()}
    _, text = words(replace(HEALTHY, decisions=rejected), status)
    assert ("goes past the bar (the trainer already steps at 0.125 x the learning rate (3 candidate(s) rejected in "
            "a row); a smaller step_backoff_floor goes shorter)") in text
    _, other = words(replace(HEALTHY, decisions=[(v, "rejected", "lost 3 facts") for v in (9, 8, 7)]), status)
    assert "likelihood guard" not in other and "keep kl_coef > 0" in other


def test_stale_drops_warn_and_all_dropped_blocks() -> None:
    stuck, text = words(replace(HEALTHY, left_queue={"trained": 10, "stale": 10}))
    assert not stuck and "WARN samples are trained, not dropped: of the last 20 turn(s) that left the training " \
                         "queue: 10 trained, 10 stale" in text and "stale: the trainer fell behind" in text
    stuck, _ = words(replace(HEALTHY, left_queue={"stale": 10}))
    assert stuck


def test_training_off_and_no_server_block() -> None:
    stuck, text = words(HEALTHY, {**STATUS, "trainer": None})
    assert stuck and "BLOCKS training steps succeed: training is off on this server" in text
    stuck, text = words(HEALTHY, None)
    assert stuck and "BLOCKS the server runs: no clawbridge server answers for this state dir" in text
