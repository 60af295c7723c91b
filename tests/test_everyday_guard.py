"""The everyday guard (`clawbridge.promotion.everyday`): a candidate must stay within
`everyday_guard_nats` per token of the anchor's likelihood of its own answers to everyday questions,
whatever the fact checks say.

The promoter's decisions with a `FakeEvaluator` and a real SQLite store; the reference answers with
the real local torch engine (the tiny model).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from clawbridge.cli.learning import check_gate
from clawbridge.config import Settings
from clawbridge.devtools.judge_server import topics
from clawbridge.devtools.personas import HELD_OUT_QUESTIONS, PERSONAS, TALK_QUESTIONS
from clawbridge.devtools.realdemo import FACTS as DEMO_FACTS
from clawbridge.devtools.realdemo import HELD_OUT, TRAIN_PROMPTS
from clawbridge.promotion.announce import promotion_line
from clawbridge.promotion.capability import PROBE_SOURCE, capability_probe
from clawbridge.promotion.describe import still_good_line
from clawbridge.promotion.everyday import (
    AGENT_NOTE,
    AGENT_PROFILE,
    EVERYDAY_QUESTIONS,
    everyday_set,
    in_context_set,
)
from clawbridge.promotion.likelihood import EVERYDAY, IN_CONTEXT, LIKELIHOOD_SOURCE, nats_of
from clawbridge.promotion.report import promotion_status
from clawbridge.promotion.runner import FakeEvaluator
from tests.test_capability_probe import _decide, _promoter
from tests.test_learning_checks import HEALTHY
from tests.test_likelihood_guard import OneSampler

EVERYDAY_REFS = EVERYDAY.source
IN_CONTEXT_REFS = IN_CONTEXT.source


def test_the_questions_are_disjoint_from_every_probe_demo_and_bench_question() -> None:
    es = everyday_set()
    assert len(es.items) == len(EVERYDAY_QUESTIONS) == 12 and {i.kind for i in es.items} == {"open"}
    asked = {q.lower() for q in EVERYDAY_QUESTIONS}
    assert len(asked) == 12
    probe = {str(i.messages[0]["content"]).lower() for i in capability_probe(48).items}
    others = {q.lower() for q in (*TRAIN_PROMPTS, *HELD_OUT, *(q for q, _ in DEMO_FACTS), *TALK_QUESTIONS,
                                  *HELD_OUT_QUESTIONS)}
    assert not asked & (probe | others)
    assert everyday_set().digest == es.digest != capability_probe(48).digest


def test_a_candidate_whose_everyday_answers_fell_apart_is_rejected_though_every_fact_check_holds(
        tmp_path: Path) -> None:
    # every version answers all 30 probe facts and keeps their likelihood; only the everyday
    # answers' likelihood moves. FakeEvaluator scores k of 12 reference answers as k / 12: the
    # anchor 12/12 = 1.0, so with a bar of 0.25 nats the floor is 1.0 - nats_tolerance(0.25) = 0.769
    fake = FakeEvaluator({}, by_set={PROBE_SOURCE: {0: 30, 1: 30, 2: 30, 3: 30},
                                     LIKELIHOOD_SOURCE: {0: 30, 1: 30, 2: 30, 3: 30},
                                     EVERYDAY_REFS: {0: 12, 1: 11, 2: 8, 3: 10},
                                     IN_CONTEXT_REFS: {0: 12, 1: 12, 2: 12, 3: 12}},
                         references_of={0: 30})
    promoter, store = _promoter(tmp_path, Settings(capability_probe_nats=0.1, everyday_guard_nats=0.25), fake)
    first = _decide(promoter, 1)  # 11/12 = 0.917: within
    assert first.verdict == "promoted" and promoter.serving == 1
    assert "anchor v0's 12 everyday answers" in first.reason and "within the bar of -0.25 (everyday_guard_nats)" \
        in first.reason
    second = _decide(promoter, 2)  # 8/12 = 0.667 < 0.769: beyond the bar, though the facts and their likelihood hold
    assert second.verdict == "rejected" and promoter.serving == 1
    assert second.reason.startswith("likelihood of anchor v0's 12 everyday answers"), second.reason
    assert "beyond the bar of -0.25 (everyday_guard_nats)" in second.reason
    assert PROBE_SOURCE not in second.reason and "correct probe answers" not in second.reason
    assert [c["source"] for c in second.figures["checks"]] == [PROBE_SOURCE, LIKELIHOOD_SOURCE, EVERYDAY_REFS,
                                                              IN_CONTEXT_REFS]
    assert _decide(promoter, 3).verdict == "promoted"  # 10/12 = 0.833: within
    # the anchor answered each set of questions once, for all three decisions (the probe's, the
    # everyday questions plain and in context)
    assert [a for a in fake.asked if a[1] == "references"] == [(0, "references")] * 3
    everyday = promotion_status(promoter)["capability_probe"]["everyday"]
    assert everyday["anchor"] == 0 and everyday["answers"] == 12 and everyday["bar_nats"] == 0.25
    assert everyday["serving_nats"] == pytest.approx(nats_of(10 / 12))
    line = still_good_line(promotion_status(promoter))
    assert line is not None and "everyday answers: " in line and "against anchor v0's 12 (bar -0.25)" in line
    # doctor names the guard that binds, and its setting
    gate = check_gate(replace(HEALTHY, decisions=[(2, "rejected", second.reason)]), {"promotion": promotion_status(promoter)})
    assert gate.verdict == "warn" and gate.change is not None
    assert "a larger everyday_guard_nats allows more drift" in gate.change and "capability_probe_nats" not in gate.change
    store.close()


def test_the_in_context_questions_are_the_everyday_ones_as_an_agent_serves_a_noted_call() -> None:
    user, system = in_context_set("user"), in_context_set("system")
    assert [i.kind for i in user.items] == ["open"] * 12
    for item, question in zip(user.items, EVERYDAY_QUESTIONS, strict=True):
        assert [m.role for m in item.chat] == ["system", "user"] and item.chat[0].content == AGENT_PROFILE
        # where notes go by default: the last user message, as `[Hint: ...]`
        assert item.chat[1].content == f"{question}\n\n[Hint: {AGENT_NOTE}]"
        assert [m["content"] for m in item.messages] == [m.content for m in item.chat]
    for item, question in zip(system.items, EVERYDAY_QUESTIONS, strict=True):
        assert item.chat[1].content == question and item.chat[0].content.startswith(AGENT_PROFILE)
        assert item.chat[0].content.endswith(AGENT_NOTE)
    assert len({user.digest, system.digest, everyday_set().digest}) == 3
    # the gate's own profile and note: no persona's system prompt or name, no persona's kind of
    # preference (the rule-based judge's kinds: length, names, formatting, what comes first)
    for persona in PERSONAS.values():
        assert persona.user_name not in AGENT_PROFILE and persona.system_prompt() != AGENT_PROFILE
    assert topics(AGENT_NOTE) == set()


def test_a_candidate_whose_answers_in_an_agents_context_fell_apart_is_rejected_though_its_plain_ones_hold(
        tmp_path: Path) -> None:
    # what the 13x runs showed: the plain everyday answers at the bar, the noted ones fallen apart
    fake = FakeEvaluator({}, by_set={PROBE_SOURCE: {0: 30, 1: 30, 2: 30},
                                     LIKELIHOOD_SOURCE: {0: 30, 1: 30, 2: 30},
                                     EVERYDAY_REFS: {0: 12, 1: 12, 2: 12},
                                     IN_CONTEXT_REFS: {0: 12, 1: 11, 2: 7}},
                         references_of={0: 30})
    promoter, store = _promoter(tmp_path, Settings(), fake)
    assert _decide(promoter, 1).verdict == "promoted"  # 11/12: within
    worse = _decide(promoter, 2)  # 7/12 = 0.583 < 0.769
    assert worse.verdict == "rejected" and promoter.serving == 1
    assert worse.reason.startswith("likelihood of anchor v0's 12 everyday answers in an agent's context"), worse.reason
    assert "beyond the bar of -0.25 (everyday_guard_nats)" in worse.reason
    status = promotion_status(promoter)["capability_probe"]
    assert status["in_context"]["serving_nats"] == pytest.approx(nats_of(11 / 12))
    assert status["everyday"]["serving_nats"] == pytest.approx(nats_of(1.0))
    line = still_good_line(promotion_status(promoter))
    assert line is not None and "in an agent's context: " in line
    gate = check_gate(replace(HEALTHY, decisions=[(2, "rejected", worse.reason)]), {"promotion": promotion_status(promoter)})
    assert gate.change is not None and "a larger everyday_guard_nats allows more drift" in gate.change
    store.close()


def test_up_says_what_the_everyday_guard_holds_and_where_it_cannot() -> None:
    on = promotion_line(Settings(), scores=True)
    assert ("its likelihood of the base's correct answers within 0.1 nats/token and of the base's everyday "
            "answers (plain and in an agent's context) within 0.25 nats/token") in on
    only = promotion_line(Settings(capability_probe_nats=0), scores=True)
    assert "its likelihood of the base's everyday answers (plain and in an agent's context) within 0.25" in only
    blind = promotion_line(Settings(), scores=False)
    assert "nats/token" not in blind and "no likelihood guard" in blind
    assert "likelihood" not in promotion_line(Settings(capability_probe_nats=0, everyday_guard_nats=0), scores=True)


@pytest.mark.parametrize("settings,references_of,probe_facts",
                         [(Settings(everyday_guard_nats=0), {0: 30}, 30), (Settings(), None, 30),
                          (Settings(), {0: 1}, 1), (Settings(capability_probe=False, promotion_mode="off"), {0: 30}, 30)],
                         ids=["bar-off", "sampler-cannot-score", "anchor-knows-no-fact", "no-probe"])
def test_the_everyday_guard_is_off_where_the_likelihood_guard_is(tmp_path: Path, settings: Settings,
                                                                 references_of: dict[int, int] | None,
                                                                 probe_facts: int) -> None:
    fake = FakeEvaluator({}, by_set={PROBE_SOURCE: {0: probe_facts, 1: probe_facts},
                                     LIKELIHOOD_SOURCE: {0: 30, 1: 30}, EVERYDAY_REFS: {0: 12, 1: 0}},
                         references_of=references_of)
    promoter, store = _promoter(tmp_path, settings, fake)
    if promoter.mode == "off":
        assert promoter.everyday is None and promoter.in_context is None
        assert promotion_status(promoter)["capability_probe"] is None
    else:
        d = _decide(promoter, 1)  # the candidate would score 0 on the everyday answers: they do not decide
        assert d.verdict == "promoted" and "everyday" not in d.reason
        probe = promotion_status(promoter)["capability_probe"]
        assert probe["everyday"] is None and probe["in_context"] is None
    assert all(source not in (EVERYDAY_REFS, IN_CONTEXT_REFS) for _, source in fake.asked)
    store.close()


def test_reference_answers_to_everyday_questions_are_the_anchors_whole_greedy_answers(tiny_model_dir: Path) -> None:
    """The real engine: an open question's reference is the anchor's greedy answer, whole (no
    pattern cuts it) up to the cut, token exact, with its own logprobs; the anchor scores 0.5 on
    the set, and the digest is the same when it is built again (greedy)."""
    pytest.importorskip("torch")
    pytest.importorskip("clawbridge_local")
    from clawbridge_local.engine import TorchEngine

    from clawbridge.chat.render import Renderer
    from clawbridge.promotion.evalset import EvalItem, EvalSetError
    from clawbridge.promotion.likelihood import reference_set
    from clawbridge.promotion.runner import Evaluator

    es = everyday_set()
    engine = TorchEngine.load(str(tiny_model_dir), device="cpu", max_running=4, max_queued=4, progress=False)
    try:
        ev = Evaluator(OneSampler(engine), Renderer.from_pretrained(str(tiny_model_dir)), max_tokens=8)  # type: ignore[arg-type]
        async def run() -> tuple[list[EvalItem] | None, list[EvalItem] | None]:  # one loop: the evaluator's slots bind to it
            return await ev.references(0, es, 6), await ev.references(0, es, 6)

        items, again = asyncio.run(run())
        assert items is not None and [i.id for i in items] == [i.id for i in es.items]
        stops = set(Renderer.from_pretrained(str(tiny_model_dir)).stop_token_ids)
        for ref in items:
            assert ref.kind == "held_out" and ref.verdict == 1 and len(ref.completion_logprobs) == len(ref.completion_ids)
            # whole: six tokens unless a stop token ended it sooner
            assert len(ref.completion_ids) == 6 or ref.completion_ids[-1] in stops
        refs = reference_set(EVERYDAY, 0, es, items)
        assert again is not None and reference_set(EVERYDAY, 0, es, again).digest == refs.digest
        fresh = Evaluator(OneSampler(engine), Renderer.from_pretrained(str(tiny_model_dir)), max_tokens=8)  # type: ignore[arg-type]
        anchor = asyncio.run(fresh.evaluate(0, refs))
        assert anchor.source == EVERYDAY_REFS and anchor.score == pytest.approx(0.5, abs=1e-4)
        # in an agent's context: the same questions, rendered with the profile and the note
        renderer = Renderer.from_pretrained(str(tiny_model_dir))
        noted = asyncio.run(Evaluator(OneSampler(engine), renderer, max_tokens=8).references(0, in_context_set(), 6))  # type: ignore[arg-type]
        assert noted is not None and [i.id for i in noted] == [f"in-context-{n}" for n in range(1, 13)]
        seen = renderer.decode(list(noted[0].prompt_ids))
        assert AGENT_PROFILE in seen and f"[Hint: {AGENT_NOTE}]" in seen and EVERYDAY_QUESTIONS[0] in seen
        with pytest.raises(EvalSetError, match="only through a reference answer"):
            asyncio.run(Evaluator(OneSampler(engine), Renderer.from_pretrained(str(tiny_model_dir))).evaluate(0, es))  # type: ignore[arg-type]
    finally:
        engine.shutdown()


def test_the_bar_is_set_by_env_or_toml_and_a_negative_one_is_refused(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from clawbridge.config import load_settings

    cfg = tmp_path / "c.toml"
    cfg.write_text("[promotion]\neveryday_guard_nats = 0.4\n")
    assert load_settings(cfg).everyday_guard_nats == 0.4
    monkeypatch.setenv("CLAWBRIDGE_EVERYDAY_GUARD_NATS", "0")
    assert load_settings(cfg).everyday_guard_nats == 0.0  # env wins over the file: off
    with pytest.raises(ValidationError, match="everyday_guard_nats"):
        Settings(everyday_guard_nats=-0.1)
