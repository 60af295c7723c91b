"""The built-in capability probe: never worse by default, with no eval set written by the user.

Promotion's decisions with the probe, without a model (`FakeEvaluator`, the real `Promoter` and a
real SQLite store): the default mode is `probe`; a candidate that lost more than the slack of
facts is rejected in every mode; one within it is promoted; the serving version is evaluated once
before any candidate; status says "still good?" in words. The probe's real answers are in
`tests/test_probe_real.py` and `bench/learn_from_talk.py`.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from clawbridge.backend import ModelInfo
from clawbridge.config import Settings, load_settings
from clawbridge.devtools.realdemo import FACTS, HELD_OUT, TRAIN_PROMPTS
from clawbridge.promotion.announce import lanes_line, promotion_line, rehearsal_words
from clawbridge.promotion.capability import PROBE_SOURCE, capability_probe
from clawbridge.promotion.describe import promotion_lines, still_good_line
from clawbridge.promotion.likelihood import GUARDS
from clawbridge.promotion.promoter import Promoter
from clawbridge.promotion.report import promotion_status
from clawbridge.promotion.runner import FakeEvaluator
from clawbridge.serving.sampler import FakeSampler
from clawbridge.serving.versions import VersionRouter
from clawbridge.store import Store
from clawbridge.store.promotion import Decision, PromotionStore
from clawbridge.store.versions import VersionStore
from clawbridge.trainer.fake import FakeTrainingBackend

PROBE_ITEMS = len(capability_probe(48).items)


def test_the_probe_is_forty_regex_facts_disjoint_from_every_demo_and_bench_question() -> None:
    probe = capability_probe(48)
    assert len(probe.items) == 40 and probe.regex_only and probe.source == PROBE_SOURCE
    assert len({i.id for i in probe.items}) == 40
    asked = {str(i.messages[0]["content"]).lower() for i in probe.items}
    from clawbridge.devtools.personas import HELD_OUT_QUESTIONS, TALK_QUESTIONS

    others = {q.lower() for q in (*TRAIN_PROMPTS, *HELD_OUT, *(q for q, _ in FACTS), *TALK_QUESTIONS, *HELD_OUT_QUESTIONS)}
    assert not asked & others
    # each item's regex accepts its plain answer and refuses an unrelated one
    for item in probe.items:
        assert not re.search(item.expect, "I am not sure about that.", re.IGNORECASE), item.id
    assert capability_probe(48).digest == probe.digest != capability_probe(49).digest


def test_auto_means_the_probe_without_an_eval_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    s = load_settings(cfg)
    assert s.promotion_mode == "probe" and s.capability_probe
    assert "capability probe within 1 item(s)" in promotion_line(s, scores=True)
    monkeypatch.setenv("CLAWBRIDGE_EVAL_SET", "mine.jsonl")
    assert load_settings(cfg).promotion_mode == "eval"
    monkeypatch.setenv("CLAWBRIDGE_PROMOTION_MODE", "off")
    assert "even one that lost capability" in promotion_line(load_settings(cfg), scores=True)


def test_start_up_promises_the_guard_and_rehearsal_only_where_the_sampler_scores(tmp_path: Path) -> None:
    """A Fireworks deployment or SGLang cannot score given tokens, so the likelihood guard and
    rehearsal are off there (the promoter logs why): `up`'s lines say so instead of naming them."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    s = load_settings(cfg)
    assert s.capability_probe_nats > 0 and s.rehearsal_coef > 0
    scoring, blind = promotion_line(s, scores=True), promotion_line(s, scores=False)
    assert "nats/token" in scoring and "no likelihood guard" not in scoring
    assert "nats/token" not in blind and "no likelihood guard: this backend's sampler cannot score" in blind
    assert rehearsal_words(s, scores=True) == ", rehearsal of known facts 1"
    assert rehearsal_words(s, scores=False) == ", no rehearsal (this backend's sampler cannot score given tokens)"
    off = s.model_copy(update={"promotion_mode": "off"})
    assert rehearsal_words(off, scores=True) == "" and "nats/token" not in promotion_line(off, scores=True)
    assert rehearsal_words(s.model_copy(update={"rehearsal_coef": 0.0}), scores=True) == ""
    # users' adapters are not gated: the line says so, and what protects them where anything does
    assert lanes_line(s, scores=True) is None
    lanes = s.model_copy(update={"per_user_adapters": True})
    assert lanes_line(lanes, scores=True) == (
        "users' adapters: each serves its user once trained, not gated (promotion gates the shared policy); "
        "their steps add the shared policy's rehearsal of known facts 1; docs/users.md")
    assert "rehearsal" not in (lanes_line(lanes, scores=False) or "no line")


def _promoter(tmp_path: Path, settings: Settings, fake: FakeEvaluator) -> tuple[Promoter, Store]:
    store = Store(tmp_path / "db.sqlite")
    backend = FakeTrainingBackend(FakeSampler(script=[7]), ModelInfo("tiny", "unused", 4096, 256))
    promoter = Promoter(settings, store, VersionRouter(backend, VersionStore(store)), fake)
    promoter.serving = 0
    return promoter, store


def _decide(promoter: Promoter, candidate: int) -> Decision:
    async def run() -> Decision:
        d = await promoter._evaluate(candidate)
        await promoter._apply(d)
        return d

    return asyncio.run(run())


def test_probe_mode_rejects_a_candidate_that_lost_facts_and_keeps_one_within_the_slack(tmp_path: Path) -> None:
    fake = FakeEvaluator({0: 30, 1: 29, 2: 28, 3: 30})
    promoter, store = _promoter(tmp_path, Settings(), fake)
    assert promoter.mode == "probe" and promoter.tolerance == pytest.approx(1 / PROBE_ITEMS)
    first = _decide(promoter, 1)  # one fact fewer than v0: within the slack
    assert first.verdict == "promoted" and promoter.serving == 1
    second = _decide(promoter, 2)  # one fewer than v1, two fewer than the base (the anchor)
    assert second.verdict == "rejected" and promoter.serving == 1
    assert "anchor v0's 0.750" in second.reason and PROBE_SOURCE in second.reason
    assert _decide(promoter, 3).verdict == "promoted"
    status = promotion_status(promoter)
    assert status["mode"] == "probe" and status["eval_set"] == PROBE_SOURCE and status["anchor_version"] == 0
    probe = status["capability_probe"]
    assert probe["serving"]["passed"] == 30 and probe["anchor"]["passed"] == 30 and probe["items"] == PROBE_ITEMS
    lines = promotion_lines(status)
    assert lines[0].startswith(f"promotion: probe on {PROBE_SOURCE}")
    assert f"capability probe: serving v3 answers 30 of {PROBE_ITEMS} facts (anchor v0: 30; +0)" in lines[1]
    store.close()


def test_still_good_says_in_words_how_the_serving_version_does_against_the_base(tmp_path: Path) -> None:
    fake = FakeEvaluator({0: 30, 1: 29, 2: 28, 3: 31})
    promoter, store = _promoter(tmp_path, Settings(), fake)
    assert still_good_line(promotion_status(promoter)) == ("still good? not measured yet: the capability probe (40 facts) has "
                                                  "not run on the serving v0; it runs when a trained version is gated")
    assert _decide(promoter, 1).verdict == "promoted"
    assert still_good_line(promotion_status(promoter)) == ("still good? yes, within the slack: serving v1 answers 29 of 40 probe "
                                                  "facts, the base v0 30 (-1; a version may lose 1 fact(s))")
    assert _decide(promoter, 2).verdict == "rejected"  # two fewer than the base: it never serves
    assert _decide(promoter, 3).verdict == "promoted"
    status = promotion_status(promoter)
    assert still_good_line(status) == ("still good? yes: serving v3 answers 31 of 40 probe facts, the base v0 30 (+1; "
                                       "a version may lose 1 fact(s))")
    # a version past the slack serves only when someone chose it (promotion off, or `clawbridge promote`)
    status["capability_probe"]["serving"] = {**status["capability_probe"]["serving"], "version": 2, "passed": 28}
    assert still_good_line(status) == ("still good? no: serving v2 answers 28 of 40 probe facts, the base v0 30 (-2, "
                                       "past the 1-fact slack: `clawbridge rollback N` serves an earlier version again)")
    assert still_good_line(promotion_status(promoter) | {"capability_probe": None}) is None  # probe off: nothing to say
    store.close()


def test_the_probe_is_a_floor_under_the_users_own_eval_set(tmp_path: Path) -> None:
    evals = tmp_path / "mine.jsonl"
    evals.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}], "expect": "x"})
                               for i in range(4)))
    # v1 is as good as v0 on the user's set and lost 3 facts of the probe: rejected by the floor;
    # v2 is as good on both: promoted
    fake = FakeEvaluator({}, by_set={str(evals): {0: 3, 1: 3, 2: 3}, PROBE_SOURCE: {0: 30, 1: 27, 2: 30}})
    promoter, store = _promoter(tmp_path, Settings(promotion_mode="eval", eval_set=str(evals)), fake)
    d = _decide(promoter, 1)
    assert d.verdict == "rejected" and PROBE_SOURCE in d.reason and "27/40" in d.reason
    assert d.figures is not None and [c["passed"] for c in d.figures["checks"]] == [True, False]
    assert d.score == 0.75  # the user's own set is the decision's main score
    assert _decide(promoter, 2).verdict == "promoted"
    store.close()
    # the floor can be turned off: then only the user's set decides
    fake_off = FakeEvaluator({}, by_set={str(evals): {0: 3, 1: 3}, PROBE_SOURCE: {0: 30, 1: 0}})
    promoter, store = _promoter(tmp_path / "off", Settings(promotion_mode="eval", eval_set=str(evals),
                                                           capability_probe=False), fake_off)
    assert _decide(promoter, 1).verdict == "promoted"
    assert all(src == str(evals) for _, src in fake_off.asked)
    store.close()


def test_a_canary_candidate_that_fails_the_probe_never_answers_anyone(tmp_path: Path) -> None:
    fake = FakeEvaluator({0: 30, 1: 20})
    promoter, store = _promoter(tmp_path, Settings(promotion_mode="canary"), fake)
    promoter.pinned = True

    async def run() -> Decision | None:
        return await promoter._canary(1)

    d = asyncio.run(run())
    assert d is not None and d.verdict == "rejected" and PROBE_SOURCE in d.reason
    assert promoter.router.candidate_version is None  # never put on canary
    store.close()


def test_the_serving_version_is_evaluated_once_before_any_candidate(tmp_path: Path) -> None:
    fake = FakeEvaluator({0: 31})
    promoter, store = _promoter(tmp_path, Settings(), fake)

    async def settle_twice() -> None:
        for _ in range(2):
            settled = await promoter.settle()
            assert settled.hold is None and settled.resume_from is None

    asyncio.run(settle_twice())
    assert [a for a in fake.asked if a[1] != "references"] == [(0, PROBE_SOURCE)]  # once: cached after
    # each guard asked once for the serving version's answers (this fake cannot give any: off)
    assert fake.asked.count((0, "references")) == len(GUARDS)
    probe: Any = promotion_status(promoter)["capability_probe"]
    assert probe["serving"] == {"version": 0, "passed": 31, "items": PROBE_ITEMS, "score": 31 / PROBE_ITEMS,
                                "failed": [i.id for i in capability_probe(48).items[31:]][:10]}
    assert PromotionStore(store).decisions() == []  # a baseline is not a decision
    store.close()


def test_a_model_that_knows_no_fact_has_nothing_to_lose(tmp_path: Path) -> None:
    """The tiny random model answers no probe item: every candidate passes (0 >= 0 - slack)."""
    promoter, store = _promoter(tmp_path, Settings(), FakeEvaluator({0: 0, 1: 0}))
    assert _decide(promoter, 1).verdict == "promoted"
    store.close()


def test_a_chain_of_versions_promoted_unevaluated_stays_unevaluated(tmp_path: Path) -> None:
    """When the anchor knows no probe fact, a candidate is promoted without evaluating it, and so
    is the next one: the serving version (promoted unevaluated) is not evaluated for it either. In
    the tiny judge demo that evaluation waited behind the agents' calls and training stopped."""
    fake = FakeEvaluator({0: 0, 1: 5, 2: 5})
    promoter, store = _promoter(tmp_path, Settings(), fake)
    asyncio.run(promoter._baseline(attempts=1))
    assert fake.asked == [(0, PROBE_SOURCE)]
    assert _decide(promoter, 1).verdict == "promoted" and _decide(promoter, 2).verdict == "promoted"
    assert fake.asked == [(0, PROBE_SOURCE)]  # v1 and v2 never evaluated
    assert "nothing to lose" in (PromotionStore(store).last_decision(2).reason)  # type: ignore[union-attr]
    store.close()


def test_probe_answers_stop_at_the_probes_own_max_tokens(tiny_model_dir: Path) -> None:
    """`capability_probe_max_tokens` cuts each greedy probe answer (it was only part of the digest,
    and answers ran to eval_max_tokens, 256, on every fact a version missed); a user's eval set
    keeps the length it was parsed with."""
    from clawbridge.chat.render import Renderer
    from clawbridge.promotion.runner import Evaluator

    class Router:
        async def sampler_for(self, version: int, by: object = None, use: str = "evaluate") -> FakeSampler:
            return FakeSampler(script=[7] * 100)  # never names a fact, never stops

    ev = Evaluator(Router(), Renderer.from_pretrained(str(tiny_model_dir)), max_tokens=256)  # type: ignore[arg-type]
    probe = asyncio.run(ev.evaluate(0, capability_probe(12)))
    assert probe.passed == 0 and probe.mean_answer_tokens == 12
    assert capability_probe(12).max_tokens == 12
