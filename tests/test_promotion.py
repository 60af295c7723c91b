"""Promotion's parts without a model: eval set parsing, the statistics, the store's decisions,
the `[promotion]` settings, and the trainer loop's gate (with the fake backend)."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from clawbridge.config import load_settings
from clawbridge.promotion.evalset import EvalSetError, held_out, parse_eval_set
from clawbridge.promotion.report import promotion_status
from clawbridge.promotion.stats import CanaryEvidence, canary_test, pair_sizes, wilson
from clawbridge.store import Store, TurnRecord
from clawbridge.store.promotion import Decision, PromotionStore
from clawbridge.store.versions import VersionStore

MSG = [{"role": "user", "content": "hi"}]


def _lines(*objs: object) -> str:
    return "\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs)


def test_eval_set_reads_expect_and_rubric_lines() -> None:
    es = parse_eval_set(_lines({"messages": MSG, "expect": "hello"}, "",
                               {"messages": MSG, "rubric": "is polite", "id": "polite"}), "set.jsonl", 64)
    assert [(i.kind, i.id) for i in es.items] == [("expect", "line-1"), ("rubric", "polite")]
    assert es.needs_judge and not es.regex_only
    again = parse_eval_set(_lines({"messages": MSG, "expect": "hello"}), "x", 64)
    assert again.regex_only and not again.needs_judge
    assert again.digest != parse_eval_set(_lines({"messages": MSG, "expect": "hello"}), "x", 65).digest


@pytest.mark.parametrize(("line", "why"), [
    ("{not json", "line 2: not JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
    (json.dumps({"messages": [], "expect": "x"}), "line 2: \"messages\" must be a non-empty list"),
    (json.dumps({"messages": [{"content": "x"}], "expect": "x"}), "line 2: messages[0]: unknown role None"),
    # the proxy's own message rules (clawbridge.chat.messages), so a set the proxy would refuse is refused here
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}], "expect": "x"}),
     "line 2: messages[0]: content: content part type 'image_url' is not supported"),
    (json.dumps({"messages": [{"role": "tool"}], "expect": "x"}), "line 2: messages[0]: a tool message needs 'content'"),
    (json.dumps({"messages": MSG}), "line 2: give exactly one of"),
    (json.dumps({"messages": MSG, "expect": "x", "rubric": "y"}), "line 2: give exactly one of"),
    (json.dumps({"messages": MSG, "expect": "(unclosed"}), "line 2: \"expect\" is not a valid regular expression"),
    (json.dumps({"messages": MSG, "rubric": "  "}), "line 2: \"rubric\" must be a non-empty string"),
    (json.dumps({"messages": MSG, "expect": "x", "score": 1}), "line 2: unknown field(s) score"),
    (json.dumps({"messages": MSG, "expect": "x", "id": 3}), "line 2: \"id\" must be a string"),
])
def test_a_bad_eval_set_line_is_named(line: str, why: str) -> None:
    with pytest.raises(EvalSetError) as err:
        parse_eval_set(_lines({"messages": MSG, "expect": "ok"}, line), "evals.jsonl", 64)
    assert f"evals.jsonl {why}" in str(err.value)


def test_an_empty_eval_set_is_refused() -> None:
    with pytest.raises(EvalSetError, match="no items"):
        parse_eval_set("\n\n", "empty.jsonl", 64)


def test_held_out_share_is_stable_and_about_the_share() -> None:
    ids = [f"sess_{i}" for i in range(4000)]
    share = sum(held_out(i, 0.1) for i in ids) / len(ids)
    assert 0.08 < share < 0.12
    assert [held_out(i, 0.1) for i in ids[:50]] == [held_out(i, 0.1) for i in ids[:50]]
    assert not any(held_out(i, 0.0) for i in ids[:200])


def test_wilson_interval() -> None:
    assert wilson(0, 0) == (0.0, 1.0)
    low, high = wilson(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    low, high = wilson(10, 10)
    assert high == pytest.approx(1.0) and low == pytest.approx(0.7225, abs=1e-4)


def test_canary_stopping_rule() -> None:
    kw = {"share": 0.5, "tolerance": 0.05, "min_sessions": 20, "max_sessions": 100, "confidence": 0.95}
    assert canary_test([True] * 19, [False] * 30, **kw).outcome == "continue"  # too few candidate sessions
    better = canary_test([True] * 40, [False] * 40, **kw)
    assert better.outcome == "promote" and better.e_not_worse >= better.threshold == pytest.approx(20.0)
    worse = canary_test([False] * 40, [True] * 40, **kw)
    assert worse.outcome == "reject" and worse.e_worse >= 20 and "worse" in worse.why
    tie = [i % 2 == 0 for i in range(40)]
    undecided = canary_test(tie, tie, **kw)
    assert undecided.outcome == "continue" and "not yet decisive" in undecided.why
    capped = canary_test([i % 2 == 0 for i in range(100)], [i % 2 == 0 for i in range(100)], **kw)
    assert capped.outcome == "reject" and "canary_max_sessions (100)" in capped.why  # never worse by default
    # deterministic: the same sessions give the same figures; the order they came in matters
    again = canary_test(tie, tie, **kw)
    assert (again.e_not_worse, again.e_worse) == (undecided.e_not_worse, undecided.e_worse)
    # share 0.2: each candidate session is paired with four of the incumbent's
    assert pair_sizes(0.2) == (1, 4) and pair_sizes(0.5) == (1, 1) and pair_sizes(0.75) == (3, 1)
    assert canary_test([True] * 20, [True] * 79, **{**kw, "share": 0.2}).pairs == 19


@pytest.mark.parametrize("delta", [-0.05, -0.10])
def test_canary_error_rate_holds_at_every_look(delta: float) -> None:
    """Simulated with the defaults and a look after every session (the issue: the posterior rule
    promoted a candidate 0.10 worse in 12-14% of runs): a candidate worse by the tolerance or more
    is promoted in at most 1 - confidence of the runs. bench/canary_error.py prints the full table."""
    rng = random.Random(7)
    runs, promoted = 400, 0
    for _ in range(runs):
        ev = CanaryEvidence(0.2, 0.05)
        while (outcome := ev.outcome(20, 200, 0.95)) == "continue":
            candidate = rng.random() < 0.2
            ev.add(candidate, rng.random() < (0.5 + delta if candidate else 0.5))
        promoted += outcome == "promote"
    assert promoted / runs <= 0.05, promoted


def _turn(store: Store, session: str, version: int) -> str:
    now = store.clock.now()
    return store.record_turn(TurnRecord(session, "main", "ok", "m", [1, 2], [3, 4], [-0.1, -0.2], version, "stop",
                                        "{}", None, now, now), end_reason="end_session")


def test_a_decision_is_taken_once_and_marks_the_rejected_samples(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    ps, vs = PromotionStore(store), VersionStore(store)
    tid = _turn(store, "s1", 0)
    with store.write() as c:
        c.execute("INSERT INTO steps(step, policy_version, status, started_at) VALUES(1, 1, 'ok', 0)")
        c.execute("INSERT INTO samples(turn_id, session_id, policy_version, consumed_step, created_at) "
                  "VALUES(?, 's1', 0, 1, 0)", (tid,))
    vs.commit_base("ck0", None)
    ps.set_state("eval", 0)
    d = Decision(1, "rejected", "eval", "worse", 0, 0.25, 1.0, {"k": 1})
    assert ps.decide(d, "eval")
    assert not ps.decide(Decision(1, "promoted", "eval", "again", 0, 1.0, 1.0), "eval")  # never twice
    assert [x.verdict for x in ps.decisions()] == ["rejected"]
    state = ps.state()
    assert state is not None and state.serving_version == 0 and state.candidate_version is None
    assert ps.rejected_samples() == 1
    # the admin may promote it anyway (a new decision each time); it then serves
    assert ps.decide(Decision(1, "promoted", "admin", "promote by the admin", 0), "eval")
    assert ps.state().serving_version == 1  # type: ignore[union-attr]
    last = ps.last_decision(1)
    assert last is not None and last.source == "admin"
    store.close()


def test_the_serving_the_base_and_the_anchor_checkpoints_are_never_pruned(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    vs, ps = VersionStore(store), PromotionStore(store)
    vs.commit_base("ck0", None)
    for _ in range(6):
        v = vs.reserve("step")
        vs.commit(v, f"ck{v}", None)
    assert vs.prunable(keep=2) == ["ck1", "ck2", "ck3", "ck4"]  # the base is kept however old
    ps.set_state("eval", 2)
    assert vs.prunable(keep=2) == ["ck1", "ck3", "ck4"]  # and the serving version
    # the drift guard's anchor: the version serving at the first automatic decision
    assert ps.decide(Decision(3, "promoted", "eval", "ok", 2, 1.0, 1.0), "eval")
    assert ps.anchor_version() == 2
    ps.set_state("eval", 3)
    assert vs.prunable(keep=2) == ["ck1", "ck4"]  # v2 anchors, v3 serves
    store.close()


def test_rollback_to_the_base_works_after_many_steps(tmp_path: Path) -> None:
    """`clawbridge rollback 0` after more than keep_checkpoints steps: the base's checkpoint is
    still there (it used to be pruned after `keep` steps: "checkpoint was pruned")."""
    from clawbridge.backend import ModelInfo
    from clawbridge.serving.sampler import FakeSampler
    from clawbridge.trainer.checkpoints import CheckpointKeeper
    from clawbridge.trainer.fake import FakeTrainingBackend

    store = Store(tmp_path / "db.sqlite")
    backend = FakeTrainingBackend(FakeSampler(script=[7]), ModelInfo("tiny", "unused", 4096, 256))
    keeper = CheckpointKeeper(store, backend, keep=2)

    async def steps() -> int:
        await keeper.ensure_base()
        for step in range(1, 6):
            v = keeper.reserve_step(step)
            await keeper.publish(v)
            path = await keeper.save(v)
            VersionStore(store).commit(v, path, None)
            keeper.committed(v, path)
            await keeper.prune()
        return await keeper.rollback(0)

    rolled = asyncio.run(steps())
    row = VersionStore(store).get(rolled)
    assert row is not None and row.kind == "rollback" and row.source_version == 0
    assert backend.restores[-1] == ("fake://v00000000-base", rolled)
    assert "v00000003-step" not in backend.disk  # retention still prunes the old steps
    store.close()


def test_promotion_table_in_toml_and_env_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[promotion]\nmode = "eval"\neval_set = "e.jsonl"\ntolerance = 0.1\ncanary_share = 0.3\n')
    s = load_settings(cfg)
    assert (s.promotion_mode, s.eval_set, s.promotion_tolerance, s.canary_share) == ("eval", "e.jsonl", 0.1, 0.3)
    monkeypatch.setenv("CLAWBRIDGE_PROMOTION_MODE", "canary")
    monkeypatch.setenv("CLAWBRIDGE_EVAL_SET", "other.jsonl")
    s = load_settings(cfg)
    assert (s.promotion_mode, s.eval_set) == ("canary", "other.jsonl")
    monkeypatch.delenv("CLAWBRIDGE_PROMOTION_MODE")
    # the default, auto: an eval set of your own gates on it, none gates on the built-in probe
    cfg.write_text("")
    assert load_settings(cfg).promotion_mode == "eval"  # CLAWBRIDGE_EVAL_SET is still set
    monkeypatch.delenv("CLAWBRIDGE_EVAL_SET")
    assert load_settings(cfg).promotion_mode == "probe"
    cfg.write_text('[promotion]\nmode = "sometimes"\n')
    with pytest.raises(ValueError, match="promotion_mode"):
        load_settings(cfg)
    cfg.write_text('[promotion]\nbogus = 1\n')
    with pytest.raises(ValueError, match="no option 'bogus'"):
        load_settings(cfg)


def test_the_trainer_loop_asks_the_gate_and_drops_held_out_turns(tmp_path: Path) -> None:
    from clawbridge.backend import ModelInfo
    from clawbridge.serving.sampler import FakeSampler
    from clawbridge.trainer.fake import FakeTrainingBackend
    from clawbridge.trainer.gate import Decided, FakeGate
    from clawbridge.trainer.loop import TrainerConfig, TrainerLoop

    store = Store(tmp_path / "db.sqlite")
    backend = FakeTrainingBackend(FakeSampler(script=[7, 8]), ModelInfo("tiny", "unused", 4096, 256))
    loop = TrainerLoop(store, backend, TrainerConfig(batch_size=2, baseline="none", batch_wait_s=0))
    for s in ("a", "b", "c"):
        _turn(store, s, 0)
        store.add_reward(s, 1.0, "api", store.last_turn_id(s))
    loop.gate = FakeGate([Decided(hold="candidate v1 on trial")], held={"c"})
    assert asyncio.run(loop.run_once()) is None  # held: no step
    assert loop.holding == "candidate v1 on trial"
    report = asyncio.run(loop.run_once())
    assert report is not None and report.ok and sorted(report.turn_ids) == sorted(
        store.last_turn_id(s) for s in ("a", "b"))
    assert loop.tstore.training_stats()["samples"]["dropped"] == {"held_out": 1}
    store.close()


def test_a_tolerance_cannot_drift_below_the_anchor(tmp_path: Path) -> None:
    """With tolerance 1/12, each promotion may lose one item against the serving version; the drift
    guard keeps every promoted version within one item of where the gate started (the anchor), and
    an admin's promotion makes a new anchor."""
    from clawbridge.backend import ModelInfo
    from clawbridge.config import Settings
    from clawbridge.promotion.describe import promotion_lines
    from clawbridge.promotion.promoter import Promoter
    from clawbridge.promotion.runner import FakeEvaluator
    from clawbridge.serving.sampler import FakeSampler
    from clawbridge.serving.versions import VersionRouter
    from clawbridge.trainer.fake import FakeTrainingBackend

    evals = tmp_path / "facts.jsonl"
    evals.write_text(_lines(*({"id": f"f{i}", "messages": MSG, "expect": "x"} for i in range(12))))
    store = Store(tmp_path / "db.sqlite")
    settings = Settings(promotion_mode="eval", eval_set=str(evals), promotion_tolerance=1 / 12 + 1e-9,
                        capability_probe=False)  # the anchor on the user's set alone (the probe: test_capability_probe)
    backend = FakeTrainingBackend(FakeSampler(script=[7]), ModelInfo("tiny", "unused", 4096, 256))
    fake = FakeEvaluator({0: 9, 1: 8, 2: 7, 3: 8, 4: 9})
    promoter = Promoter(settings, store, VersionRouter(backend, VersionStore(store)), fake)
    promoter.serving = 0
    assert PromotionStore(store).anchor_version() is None

    async def decide(candidate: int) -> Decision:
        d = await promoter._evaluate(candidate)
        await promoter._apply(d)
        return d

    first = asyncio.run(decide(1))  # one item less than v0: within the tolerance
    assert first.verdict == "promoted" and promoter.serving == 1
    assert PromotionStore(store).anchor_version() == 0
    second = asyncio.run(decide(2))  # one less than v1 (would pass alone), two less than the anchor
    assert second.verdict == "rejected" and promoter.serving == 1
    assert "anchor v0's 0.750" in second.reason and second.figures is not None and "anchor" in second.figures
    assert asyncio.run(decide(3)).verdict == "promoted"  # v3 = v1's score: within one item of v0
    status = promotion_status(promoter)
    assert status["anchor_version"] == 0 and status["serving_version"] == 3
    assert "(tolerance 0.0833333 against the serving version and anchor v0): serving v3" in promotion_lines(status)[0]
    assert fake.calls == [0, 1, 2, 3]  # v0's and v1's figures came from the cache once known
    # the admin puts v2 to serve: it is the new anchor, so v4 is compared with v2 and v3 only
    assert PromotionStore(store).decide(Decision(2, "promoted", "admin", "promote by the admin", 3), "eval")
    promoter.serving = 2
    assert PromotionStore(store).anchor_version() == 2
    assert asyncio.run(decide(4)).verdict == "promoted"
    store.close()


def test_held_out_items_are_scored_by_how_the_likelihood_moved_toward_the_verdict(tiny_model_dir: Path) -> None:
    """Held-out evaluation without an eval set: each recorded answer is scored under the version
    (`SequenceScorer`) against the logprobs it was sampled with. A version that made accepted
    answers likelier and rejected ones less likely scores above the policy that sampled them (0.5),
    a poisoned one below; a greedy replay (what held-out items were scored by before) passes no
    item for any of them, so it could not tell them apart."""
    from dataclasses import dataclass

    from clawbridge.chat.render import Renderer
    from clawbridge.promotion.evalset import EvalItem, EvalSet
    from clawbridge.promotion.runner import Evaluator
    from clawbridge.serving.sampler import FakeSampler

    @dataclass
    class Scoring(FakeSampler):
        shift: float = 0.0
        """Added to every recorded logprob of an accepted answer, taken from a rejected one's."""

        async def score(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
            sign = 1.0 if prompt_ids[0] == 1 else -1.0  # prompt [1, ...]: the user accepted the answer
            return [-1.0 + sign * self.shift for _ in completion_ids]

    class Router:
        def __init__(self, samplers: dict[int, FakeSampler]) -> None:
            self.samplers = samplers

        async def sampler_for(self, version: int, by: object = None, use: str = "evaluate") -> FakeSampler:
            return self.samplers[version]

    items = tuple(EvalItem("held_out", f"t{i}", prompt_ids=(1 if i % 2 == 0 else 2, 5, 6), completion_ids=(7, 8, 9),
                           completion_logprobs=(-1.0, -1.0, -1.0), verdict=1 if i % 2 == 0 else -1)
                  for i in range(6))
    es = EvalSet(items, "held-out sessions", "d")
    versions = {0: Scoring(script=[3], shift=0.0), 1: Scoring(script=[3], shift=0.3), 2: Scoring(script=[3], shift=-0.3)}
    ev = Evaluator(Router(versions), Renderer.from_pretrained(str(tiny_model_dir)))  # type: ignore[arg-type]
    base, toward, poisoned = (asyncio.run(ev.evaluate(v, es)) for v in (0, 1, 2))
    assert base.score == pytest.approx(0.5) and base.passed == 0
    assert toward.score > 0.75 and toward.passed == 6
    assert poisoned.score < 0.25 and poisoned.passed == 0
    # a sampler that cannot score replays greedily: the version that answers the recorded [7, 8, 9] keeps
    # what was accepted and repeats what was rejected
    replay = Evaluator(Router({3: FakeSampler(script=[7, 8, 9])}), Renderer.from_pretrained(str(tiny_model_dir)))  # type: ignore[arg-type]
    assert asyncio.run(replay.evaluate(3, es)).passed == 3
