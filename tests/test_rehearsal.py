"""Rehearsal (`clawbridge.promotion.rehearsal`): the built-in pool, the rotation, the weight of a
rehearsed token, and the real `Promoter` and `TrainerLoop` on the fake backend, where the datums
each step was sent are read back from the backend."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from clawbridge.backend import ModelInfo
from clawbridge.config import NormalizationRule, Settings
from clawbridge.devtools.personas import HELD_OUT_QUESTIONS, TALK_QUESTIONS
from clawbridge.devtools.realdemo import FACTS, HELD_OUT, TRAIN_PROMPTS
from clawbridge.promotion.capability import capability_probe
from clawbridge.promotion.describe import promotion_lines
from clawbridge.promotion.evalset import EvalItem, EvalSet
from clawbridge.promotion.promoter import Promoter
from clawbridge.promotion.rehearsal import Rehearsal, mean_token_scale, rehearsal_pool
from clawbridge.promotion.report import promotion_status
from clawbridge.promotion.runner import FakeEvaluator
from clawbridge.serving.sampler import FakeSampler
from clawbridge.serving.versions import VersionRouter
from clawbridge.store import Store, TurnRecord
from clawbridge.store.versions import VersionStore
from clawbridge.trainer.advantages import token_scales
from clawbridge.trainer.fake import FakeTrainingBackend
from clawbridge.trainer.gate import FakeGate
from clawbridge.trainer.loop import TrainerConfig, TrainerLoop


def _answers(pattern: str) -> set[str]:
    """The answers a pattern's alternatives name ("\\b(6|six)\\b" -> {"6", "six"})."""
    return {a.strip() for a in re.sub(r"\\b|[()?]", "", pattern.lower()).split("|")}


def test_the_pool_is_facts_disjoint_from_the_probe_and_every_demo_and_bench_question() -> None:
    pool = rehearsal_pool(32)
    probe = capability_probe(32)
    assert len(pool.items) >= 48 and pool.regex_only and len({i.id for i in pool.items}) == len(pool.items)
    asked = {str(i.messages[0]["content"]).lower() for i in pool.items}
    others = {q.lower() for q in (*TRAIN_PROMPTS, *HELD_OUT, *(q for q, _ in FACTS), *TALK_QUESTIONS,
                                  *HELD_OUT_QUESTIONS, *(str(i.messages[0]["content"]) for i in probe.items))}
    assert not asked & others
    # no answer rehearsal trains is an answer the probe or the bench's fact check looks for
    pool_answers = set().union(*(_answers(i.expect) for i in pool.items))
    probe_answers = set().union(*(_answers(i.expect) for i in probe.items))
    fact_answers = {name for _, names in FACTS for name in names}
    assert not pool_answers & probe_answers, pool_answers & probe_answers
    assert not pool_answers & fact_answers, pool_answers & fact_answers
    for item in pool.items:
        assert not re.search(item.expect, "I am not sure about that.", re.IGNORECASE), item.id


def _items(n: int) -> tuple[EvalItem, ...]:
    return tuple(EvalItem("held_out", f"q{i}", prompt_ids=(1, 2), completion_ids=(10 + i, 99),
                          completion_logprobs=(-0.5, -0.25), verdict=1) for i in range(n))


def test_each_step_takes_the_next_window_and_every_answer_comes_back() -> None:
    r = Rehearsal(0, _items(5))
    assert [i.id for i in r.pick(0, 2)] == ["q0", "q1"]
    assert [i.id for i in r.pick(1, 2)] == ["q2", "q3"]
    assert [i.id for i in r.pick(2, 2)] == ["q4", "q0"]  # wraps around
    assert {i.id for s in range(5) for i in r.pick(s, 2)} == {f"q{i}" for i in range(5)}
    assert sorted(i.id for i in r.pick(7, 9)) == ["q0", "q1", "q2", "q3", "q4"]  # each once, no more
    assert r.pick(3, 0) == () and Rehearsal(0, ()).pick(3, 2) == ()
    d = r.datums(1, 1, 0.25)[0]
    assert d.tokens == (1, 2, 11, 99) and d.turn_id == "" and d.policy_version == 0
    assert d.advantages == (0.0, 0.25, 0.25) and d.sampler_logprobs == (0.0, -0.5, -0.25) and d.mask == (0.0, 1, 1)


@pytest.mark.parametrize("rule", ["token_mean", "sequence_mean", "sum"])
def test_a_rehearsed_token_weighs_what_an_average_token_of_the_batch_weighs(rule: NormalizationRule) -> None:
    lengths = [3, 17, 8, 1]
    scales = token_scales(lengths, rule)
    mean = sum(s * n for s, n in zip(scales, lengths, strict=True)) / sum(lengths)
    assert mean_token_scale(rule, sum(lengths)) == pytest.approx(mean)
    assert mean_token_scale("token_mean", 0) == 0.0


def _turn(store: Store, session: str, i: int, reward: float = 1.0) -> None:
    """One ended, rewarded one-turn session (a ready sample) with a 2-token answer."""
    now = store.clock.now()
    tid = store.record_turn(TurnRecord(session, "main", "ok", "m", [1, 2], [3 + i, 4], [-0.1, -0.2], 0, "stop",
                                       "{}", None, now, now), end_reason="end_session")
    store.add_reward(session, reward, "api", tid)


def test_every_step_sends_the_next_rehearsed_answers_after_its_turns(tmp_path: Path) -> None:
    """A gate that hands the loop a rehearsal set: each step's batch is its one turn, then two
    rehearsed answers (the next two each step), each token at rehearsal_coef x 1/2 (token_mean
    over the turn's 2 tokens); the step's metrics count them apart from the turns."""
    store = Store(tmp_path / "db.sqlite")
    backend = FakeTrainingBackend(FakeSampler(script=[7]), ModelInfo("tiny", "unused", 4096, 256))
    loop = TrainerLoop(store, backend, TrainerConfig(batch_size=1, baseline="none", batch_wait_s=0,
                                                     rehearsal_coef=0.5, rehearsal_items=2))
    loop.gate = FakeGate(rehearsals=[Rehearsal(0, _items(3))] * 2)

    async def steps(n: int) -> None:
        for i in range(n):
            _turn(store, f"s{i}", i)
            report = await loop.run_once()
            assert report is not None and report.ok, report

    asyncio.run(steps(3))
    sent = [[d.tokens[2] for d in batch] for batch in backend.batches]
    steps_ = [s.step for s in loop.tstore.lane_steps(10)[::-1] if s.status == "ok"]
    # step n rehearses the window at n x 2; the third step's gate answer had no set: none
    expected = [[3 + i, *(10 + (steps_[i] * 2 + k) % 3 for k in range(2))] for i in range(2)] + [[5]]
    assert sent == expected
    rehearsed = backend.batches[0][1:]
    assert all(d.turn_id == "" and d.advantages[1:] == (0.25, 0.25) for d in rehearsed)
    metrics = [s.metrics for s in loop.tstore.lane_steps(10)[::-1] if s.status == "ok"]
    assert [(m["turns"], m["tokens"], m.get("rehearsal_datums"), m.get("rehearsal_tokens")) for m in metrics] == [
        (1.0, 2.0, 2.0, 4.0), (1.0, 2.0, 2.0, 4.0), (1.0, 2.0, None, None)]
    store.close()


def test_rehearsal_never_makes_a_step_on_a_batch_without_signal(tmp_path: Path) -> None:
    """A group rewarded alike has no signal and does not step, rehearsal or not."""
    store = Store(tmp_path / "db.sqlite")
    backend = FakeTrainingBackend(FakeSampler(script=[7]), ModelInfo("tiny", "unused", 4096, 256))
    loop = TrainerLoop(store, backend, TrainerConfig(batch_size=2, baseline="group_mean", batch_wait_s=0,
                                                     rehearsal_coef=1.0))
    gate = loop.gate = FakeGate(rehearsals=[Rehearsal(0, _items(3))] * 3)
    now = store.clock.now()
    for s in ("a", "b"):
        store.ensure_session(s, "header", task_id="task")
        tid = store.record_turn(TurnRecord(s, "main", "ok", "m", [1, 2], [3, 4], [-0.1, -0.2], 0, "stop", "{}",
                                           None, now, now), end_reason="end_session")
        store.add_reward(s, 1.0, "api", tid)
    asyncio.run(loop.run_once())
    assert backend.batches == []
    assert gate.rehearsal_calls == 0  # nor is the set asked for: an idle loop builds nothing
    store.close()


NO_GUARDS: dict[str, Any] = {"capability_probe_nats": 0.0, "everyday_guard_nats": 0.0}
"""The likelihood guards off: their reference answers (built by the baseline) would be asked of the
same fake evaluator as the rehearsal set these tests count."""


def test_the_promoter_builds_the_set_once_per_anchor_and_says_when_it_is_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(tmp_path / "db.sqlite")
    backend = FakeTrainingBackend(FakeSampler(script=[7]), ModelInfo("tiny", "unused", 4096, 256))
    router = VersionRouter(backend, VersionStore(store))
    on = Settings(promotion_mode="probe", rehearsal_coef=1.0, rehearsal_items=4, **NO_GUARDS)
    evaluator = FakeEvaluator({0: 30}, references_of={0: 20})
    promoter = Promoter(on, store, router, evaluator)

    async def twice(p: Promoter) -> tuple[Rehearsal | None, Rehearsal | None]:
        await p.recover()
        await p.settle()
        return await p.rehearsal(), await p.rehearsal()

    async def settle_only(p: Promoter) -> None:
        await p.recover()
        for _ in range(3):
            await p.settle()

    asyncio.run(settle_only(promoter))
    assert evaluator.asked == [(0, "the built-in capability probe")]  # settle never builds the set
    first, second = asyncio.run(twice(promoter))
    assert first is not None and first is second and first.anchor == 0 and len(first.items) == 20
    assert [i.id for i in first.items] == sorted(i.id for i in first.items)
    assert sum(1 for _, what in evaluator.asked if what == "references") == 1  # once per anchor
    status = promotion_status(promoter)["rehearsal"]
    assert status.pop("build_seconds") >= 0 and status == {"anchor": 0, "answers": 20, "per_step": 4, "coef": 1.0}
    assert ("  rehearsing 4 of anchor v0's 20 correct answers to built-in facts beside each step, so the preference "
            "costs less of what it knew (rehearsal_coef 1)") in promotion_lines(promotion_status(promoter))
    # a sampler that cannot score given tokens (Fireworks): off, said once; coef 0 or promotion off: never asked
    with caplog.at_level(logging.WARNING, logger="clawbridge.promotion.promoter"):
        unscored = Promoter(on, store, router, FakeEvaluator({0: 30}))
        assert asyncio.run(twice(unscored)) == (None, None)
    assert [r.getMessage() for r in caplog.records if "rehearsal" in r.getMessage()] == [
        "rehearsal: off against anchor v0: its sampler cannot score given tokens"]
    assert promotion_status(unscored)["rehearsal"] is None
    # an anchor that passes no more probe facts than the slack (a random tiny model) has nothing to keep
    with caplog.at_level(logging.WARNING, logger="clawbridge.promotion.promoter"):
        caplog.clear()
        knows_nothing = FakeEvaluator({0: 1}, references_of={0: 3})
        fresh = Store(tmp_path / "fresh.sqlite")  # the figures above are cached per version in the store
        fresh_router = VersionRouter(backend, VersionStore(fresh))
        assert asyncio.run(twice(Promoter(on, fresh, fresh_router, knows_nothing))) == (None, None)
        fresh.close()
    assert "references" not in {what for _, what in knows_nothing.asked}
    assert [r.getMessage() for r in caplog.records if "rehearsal" in r.getMessage()] == [
        "rehearsal: off against anchor v0: it answers 1 of 40 probe facts: nothing to keep"]
    assert not any("rehearsing" in line for line in promotion_lines(promotion_status(unscored)))
    assert Settings().rehearsal_coef == 1.0  # on by default: the value measured (docs/training.md, "Rehearsal")
    for settings in (Settings(promotion_mode="probe", rehearsal_coef=0.0, **NO_GUARDS), Settings(promotion_mode="off")):
        quiet = FakeEvaluator({0: 30}, references_of={0: 20})
        assert asyncio.run(twice(Promoter(settings, store, router, quiet))) == (None, None)
        assert ("references" not in {what for _, what in quiet.asked})
    store.close()


class _Fails(FakeEvaluator):
    """Its first `fails` `references` calls raise, as a busy or restarting engine's might."""

    def __init__(self, *args: object, fails: int = 1, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.fails = fails

    async def references(self, version: int, eval_set: EvalSet, max_tokens: int) -> list[EvalItem] | None:
        if sum(what == "references" for _, what in self.asked) < self.fails:
            self.asked.append((version, "references"))
            raise RuntimeError("engine restarting")
        return await super().references(version, eval_set, max_tokens)


def test_a_failed_build_never_fails_the_step_and_the_next_step_builds_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rehearsal is an extra: a build that raises gives this step none (logged), not a failed step,
    and is not remembered as off: the next step's ask builds it."""
    store = Store(tmp_path / "db.sqlite")
    backend = FakeTrainingBackend(FakeSampler(script=[7]), ModelInfo("tiny", "unused", 4096, 256))
    router = VersionRouter(backend, VersionStore(store))
    evaluator = _Fails({0: 30}, references_of={0: 5})
    promoter = Promoter(Settings(promotion_mode="probe", rehearsal_coef=1.0, **NO_GUARDS), store, router, evaluator)

    async def ask_twice() -> tuple[Rehearsal | None, Rehearsal | None]:
        await promoter.recover()
        await promoter.settle()
        return await promoter.rehearsal(), await promoter.rehearsal()

    with caplog.at_level(logging.WARNING, logger="clawbridge.promotion.promoter"):
        first, second = asyncio.run(ask_twice())
    assert first is None and second is not None and len(second.items) == 5
    assert [r.getMessage() for r in caplog.records if "rehearsal" in r.getMessage()] == [
        "rehearsal: not built against anchor v0 (RuntimeError: engine restarting); this step trains without it, "
        "the next one tries again"]
    store.close()


def test_an_engine_that_fails_every_build_turns_rehearsal_off_for_that_anchor_after_three(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Retries are bounded: three failed builds against one anchor, then off for it (said once),
    and no fourth build is tried; a set that is built says how long its build took."""
    store = Store(tmp_path / "db.sqlite")
    backend = FakeTrainingBackend(FakeSampler(script=[7]), ModelInfo("tiny", "unused", 4096, 256))
    router = VersionRouter(backend, VersionStore(store))
    evaluator = _Fails({0: 30}, references_of={0: 5}, fails=10)
    promoter = Promoter(Settings(promotion_mode="probe", rehearsal_coef=1.0, **NO_GUARDS), store, router, evaluator)

    async def ask(n: int) -> list[Rehearsal | None]:
        await promoter.recover()
        await promoter.settle()
        return [await promoter.rehearsal() for _ in range(n)]

    with caplog.at_level(logging.WARNING, logger="clawbridge.promotion"):
        assert asyncio.run(ask(5)) == [None] * 5
    assert sum(what == "references" for _, what in evaluator.asked) == 3
    said = [r.getMessage() for r in caplog.records if "rehearsal" in r.getMessage()]
    assert said[2:] == ["rehearsal: off against anchor v0: 3 builds failed, the last with RuntimeError: engine "
                        "restarting (a restart or a new anchor tries again)"] and len(said) == 3
    assert promotion_status(promoter)["rehearsal"] is None
    built = Promoter(Settings(promotion_mode="probe", rehearsal_coef=1.0, **NO_GUARDS), store, router,
                     FakeEvaluator({0: 30}, references_of={0: 5}))
    with caplog.at_level(logging.INFO, logger="clawbridge.promotion"):
        caplog.clear()
        assert asyncio.run(built.rehearsal()) is not None
    status = promotion_status(built)["rehearsal"]
    assert status["answers"] == 5 and status["build_seconds"] >= 0
    assert any(re.search(r"5 of v0's correct answers, built in \d+\.\d s, 8 beside each step", r.getMessage())
               for r in caplog.records)
    store.close()
