"""The probe's likelihood guard (`clawbridge.promotion.likelihood`): a candidate must stay within
`capability_probe_nats` per token of the anchor's likelihood of its own correct probe answers.

The promoter's decisions with a `FakeEvaluator` and a real SQLite store; the reference answers and
their scores with the real local torch engine (the tiny model), where the anchor must score
exactly the reference's 0.5 (token exact: the logprobs it scores are those it would sample with).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from clawbridge.config import Settings
from clawbridge.promotion.announce import promotion_line
from clawbridge.promotion.capability import PROBE_SOURCE, capability_probe
from clawbridge.promotion.describe import still_good_line
from clawbridge.promotion.evalset import parse_eval_set
from clawbridge.promotion.likelihood import FACTS, GUARDS, LIKELIHOOD_SOURCE, nats_of, nats_tolerance
from clawbridge.promotion.promoter import Decision
from clawbridge.promotion.report import promotion_status
from clawbridge.promotion.runner import FakeEvaluator
from clawbridge.serving.sampler import FakeSampler
from tests.test_capability_probe import _decide, _promoter


class OneSampler:
    """A `VersionRouter` stand-in whose every version answers with one sampler (the real engine, or
    a fake)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    async def sampler_for(self, version: int, by: object = None, use: str = "evaluate") -> Any:
        return self.sampler


def test_the_tolerance_admits_exactly_the_bar_in_nats() -> None:
    assert nats_tolerance(0.0) == 0.0
    for bar in (0.05, 0.1, 0.3):
        floor = 0.5 - nats_tolerance(bar)  # the anchor scores 0.5 on its own answers
        assert nats_of(floor) == pytest.approx(-bar, abs=1e-6)
        assert nats_of(floor + 1e-3) > -bar > nats_of(floor - 1e-3)


def test_a_candidate_that_lost_likelihood_is_rejected_though_the_greedy_probe_holds(tmp_path: Path) -> None:
    # every version answers all 30 greedy probe facts the base does; only their likelihood moves.
    # FakeEvaluator scores k of n items as k / n: the anchor 30/30 = 1.0, so with a bar of 0.1 nats
    # the floor is 1.0 - nats_tolerance(0.1) = 0.901
    fake = FakeEvaluator({}, by_set={PROBE_SOURCE: {0: 30, 1: 30, 2: 30, 3: 30},
                                     LIKELIHOOD_SOURCE: {0: 30, 1: 28, 2: 26, 3: 29}},
                         references_of={0: 30})
    promoter, store = _promoter(tmp_path, Settings(capability_probe_nats=0.1, everyday_guard_nats=0), fake)
    first = _decide(promoter, 1)
    assert first.verdict == "promoted" and promoter.serving == 1
    assert "within the bar of -0.1 (capability_probe_nats)" in first.reason
    second = _decide(promoter, 2)  # 26/30 = 0.867 < 0.901: beyond the bar, whatever the greedy probe says
    assert second.verdict == "rejected" and promoter.serving == 1
    assert second.reason.startswith("likelihood of anchor v0's 30 correct probe answers")
    assert "beyond the bar of -0.1" in second.reason and PROBE_SOURCE not in second.reason
    assert _decide(promoter, 3).verdict == "promoted"
    # the reference answers were written once, by the anchor, for all three decisions
    assert [a for a in fake.asked if a[1] == "references"] == [(0, "references")]
    likely = promotion_status(promoter)["capability_probe"]["likelihood"]
    assert likely["anchor"] == 0 and likely["answers"] == 30 and likely["bar_nats"] == 0.1
    assert likely["serving_nats"] == pytest.approx(nats_of(29 / 30))
    line = still_good_line(promotion_status(promoter))
    assert line is not None and "likely to say them: " in line and "(bar -0.1)" in line
    assert "likelihood of the base's correct answers within 0.1 nats/token" in promotion_line(Settings(), scores=True)
    assert "likelihood" not in promotion_line(Settings(capability_probe_nats=0, everyday_guard_nats=0), scores=True)
    store.close()


def test_the_baseline_builds_every_guards_answers_so_the_first_decision_only_scores_the_candidate(
        tmp_path: Path) -> None:
    """The anchor's reference answers (greedy generation, three sets) were built at the first
    decision, after the first step: on SmolLM2 under load about 600 of that decision's 887 s, with
    the person served by the base meanwhile. The baseline builds them from start-up now."""
    guarded = {g.source: {0: 12, 1: 12} for g in GUARDS}
    fake = FakeEvaluator({}, by_set={PROBE_SOURCE: {0: 30, 1: 30}, **guarded}, references_of={0: 12})
    promoter, store = _promoter(tmp_path, Settings(), fake)
    asyncio.run(promoter._baseline(attempts=1))
    assert promoter.baseline_done
    assert fake.asked == [(0, PROBE_SOURCE)] + [a for g in GUARDS for a in ((0, "references"), (0, g.source))]
    fake.asked.clear()
    d = _decide(promoter, 1)
    assert d.verdict == "promoted" and all(g.source in d.reason or g.answers in d.reason for g in GUARDS), d.reason
    assert fake.asked == [(1, PROBE_SOURCE)] + [(1, g.source) for g in GUARDS]  # nothing of v0's again
    store.close()


@pytest.mark.parametrize("nats,references_of,probe_facts",
                         [(0.0, {0: 30}, 30), (0.1, None, 30), (0.1, {0: 0}, 30), (0.1, {0: 1}, 1)],
                         ids=["bar-off", "sampler-cannot-score", "no-correct-answer", "anchor-within-the-slack"])
def test_the_guard_is_off_where_it_cannot_be_measured(tmp_path: Path, nats: float, references_of: dict[int, int] | None,
                                                      probe_facts: int) -> None:
    fake = FakeEvaluator({}, by_set={PROBE_SOURCE: {0: probe_facts, 1: probe_facts},
                                     LIKELIHOOD_SOURCE: {0: 30, 1: 0}}, references_of=references_of)
    promoter, store = _promoter(tmp_path, Settings(capability_probe_nats=nats, everyday_guard_nats=0), fake)
    d = _decide(promoter, 1)  # the candidate would score 0 on the reference set: only the probe decides
    assert d.verdict == "promoted" and "likelihood" not in d.reason
    assert all(source != LIKELIHOOD_SOURCE for _, source in fake.asked)
    # an anchor with nothing to lose is not asked for 40 answers (a random tiny model's run long)
    assert ((0, "references") in fake.asked) == (nats > 0 and probe_facts > 1)
    assert promotion_status(promoter)["capability_probe"]["likelihood"] is None
    store.close()


def test_promoting_the_serving_version_makes_it_the_anchor_and_the_guard_measures_from_it(tmp_path: Path) -> None:
    """The way on that `clawbridge doctor --learning` names when the guard holds every candidate:
    the admin accepts the serving version as the new baseline, and candidates are measured against
    its own answers from then on."""
    fake = FakeEvaluator({}, by_set={PROBE_SOURCE: {0: 30, 1: 30, 2: 30, 3: 30},
                                     LIKELIHOOD_SOURCE: {0: 30, 1: 28, 2: 26, 3: 27}},
                         references_of={0: 30, 1: 30})
    promoter, store = _promoter(tmp_path, Settings(capability_probe_nats=0.1, everyday_guard_nats=0), fake)
    assert _decide(promoter, 1).verdict == "promoted"
    assert _decide(promoter, 2).verdict == "rejected"  # 26/30 against anchor v0: beyond the bar
    # `clawbridge promote 1` records an admin decision (as test_promotion's anchor test writes it)
    assert promoter.pstore.decide(Decision(1, "promoted", "admin", "promote by the admin (serving was v1)", 1), "probe")
    assert promoter.pstore.anchor_version() == 1
    d = _decide(promoter, 3)  # 27/30 against anchor v1's 28/30 on v1's own answers: within the bar
    assert d.verdict == "promoted" and "anchor v1's 30 correct probe answers" in d.reason, d.reason
    assert [a for a in fake.asked if a[1] == "references"] == [(0, "references"), (1, "references")]
    store.close()


def test_an_anchor_whose_checkpoint_was_pruned_turns_the_guard_off_once_and_says_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The reference answers need the anchor to answer; with its checkpoint gone (retention, a
    lost store) the guard is off against it, logged once, and the greedy probe still decides."""
    from clawbridge.serving.versions import VersionNotFound

    class Pruned(FakeEvaluator):
        async def references(self, version: int, eval_set: object, max_tokens: int) -> None:
            self.asked.append((version, "references"))
            raise VersionNotFound(f"the checkpoint of policy version {version} was pruned by retention", [1])

    fake = Pruned({}, by_set={PROBE_SOURCE: {0: 30, 1: 30, 2: 27}})
    promoter, store = _promoter(tmp_path, Settings(capability_probe_nats=0.1, everyday_guard_nats=0), fake)
    with caplog.at_level("WARNING", logger="clawbridge.promotion.promoter"):
        assert _decide(promoter, 1).verdict == "promoted"
        d = _decide(promoter, 2)  # three facts down: the greedy probe rejects it, the guard is silent
    assert d.verdict == "rejected" and PROBE_SOURCE in d.reason, d.reason
    assert "likelihood" not in d.reason
    assert [a for a in fake.asked if a[1] == "references"] == [(0, "references")]  # asked once, not per candidate
    off = [r.getMessage() for r in caplog.records if "likelihood guard" in r.getMessage()]
    assert off == ["promotion: the likelihood guard on correct probe answers is off against anchor v0: v0 cannot answer (the checkpoint of "
                   "policy version 0 was pruned by retention)"]
    assert promotion_status(promoter)["capability_probe"]["likelihood"] is None
    store.close()


def test_reference_answers_are_the_anchors_own_correct_greedy_answers_token_exact(tiny_model_dir: Path) -> None:
    """The real engine: only items the anchor passes become references, cut where they match,
    with the logprobs sampling at temperature 1 would report; the anchor scores 0.5 on them."""
    pytest.importorskip("torch")
    pytest.importorskip("clawbridge_local")
    from clawbridge_local.engine import TorchEngine

    from clawbridge.chat.render import Renderer
    from clawbridge.promotion.likelihood import reference_set
    from clawbridge.promotion.runner import Evaluator

    lines = ['{"id": "any", "messages": [{"role": "user", "content": "Say something."}], "expect": "\\\\S"}',
             '{"id": "never", "messages": [{"role": "user", "content": "Name it."}], "expect": "zq#never#qz"}']
    es = parse_eval_set("\n".join(lines), "two items", 8)
    engine = TorchEngine.load(str(tiny_model_dir), device="cpu", max_running=4, max_queued=4, progress=False)
    try:
        ev = Evaluator(OneSampler(engine), Renderer.from_pretrained(str(tiny_model_dir)), max_tokens=8)  # type: ignore[arg-type]
        items = asyncio.run(ev.references(0, es, 8))
        assert items is not None and [i.id for i in items] == ["any"]
        ref = items[0]
        assert ref.kind == "held_out" and ref.verdict == 1 and 1 <= len(ref.completion_ids) <= 8
        assert len(ref.completion_logprobs) == len(ref.completion_ids)
        assert all(lp <= 0.0 for lp in ref.completion_logprobs)
        refs = reference_set(FACTS, 0, capability_probe(32), items)
        again = asyncio.run(ev.references(0, es, 8))
        assert again is not None and reference_set(FACTS, 0, capability_probe(32), again).digest == refs.digest  # greedy
        anchor = asyncio.run(ev.evaluate(0, refs))
        assert anchor.source == LIKELIHOOD_SOURCE and anchor.score == pytest.approx(0.5, abs=1e-4)
    finally:
        engine.shutdown()


def test_an_empty_answer_that_matches_is_no_reference(tiny_model_dir: Path) -> None:
    """An expect pattern that matches the empty string, and a version that answers nothing: it
    passes, but there is no token to score, so it is no reference answer (and `score` is not asked)."""
    from dataclasses import dataclass

    from clawbridge.chat.render import Renderer
    from clawbridge.promotion.runner import Evaluator

    @dataclass
    class Scoring(FakeSampler):
        scored: int = 0

        async def score(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
            self.scored += 1
            return [-0.5 for _ in completion_ids]

    silent = Scoring(script=[])
    es = parse_eval_set('{"id": "any", "messages": [{"role": "user", "content": "Hi."}], "expect": "^"}', "one", 8)
    ev = Evaluator(OneSampler(silent), Renderer.from_pretrained(str(tiny_model_dir)), max_tokens=8)  # type: ignore[arg-type]
    assert asyncio.run(ev.references(0, es, 8)) == [] and silent.scored == 0
    assert asyncio.run(ev.evaluate(0, es)).passed == 1  # the item itself passes


def test_a_version_loaded_beside_the_published_one_can_still_score_given_tokens() -> None:
    """`LoadedVersions` keeps each loaded sampler in a wrapper; that wrapper hid `score`, so every
    version but the published one was scored by a greedy replay in held-out evaluation and gave
    the likelihood guard no reference at all (the anchor is never the published version once a
    candidate is). A sampler that cannot score stays one that cannot."""
    from dataclasses import dataclass

    from clawbridge.serving.sampler import SequenceScorer
    from clawbridge.serving.versions import LoadedVersions

    @dataclass
    class Scoring(FakeSampler):
        async def score(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
            return [-0.25 * self.version for _ in completion_ids]

    async def go() -> None:
        async def load(version: int, checkpoint: str) -> FakeSampler:
            return Scoring(script=[3], version=version) if checkpoint == "scores" else FakeSampler([3], version=version)

        cache = LoadedVersions(2, load)
        kept = await cache.get(2, "scores")
        assert isinstance(kept, SequenceScorer)
        assert await kept.score([1, 2], [3, 4]) == [-0.5, -0.5]
        assert not isinstance(await cache.get(3, "replays"), SequenceScorer)

    asyncio.run(go())
