"""Smaller steps after rejected versions (`clawbridge.promotion.backoff`): the rule on decision
histories, and the real `Promoter` and `TrainerLoop` on the fake backend, where the learning-rate
scale each step was sent with is read back from the backend."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path

import pytest

from clawbridge.backend import ModelInfo
from clawbridge.config import Settings
from clawbridge.promotion.backoff import WINDOW, StepScale, step_scale
from clawbridge.promotion.describe import promotion_lines
from clawbridge.promotion.promoter import Promoter
from clawbridge.promotion.report import promotion_status
from clawbridge.promotion.runner import FakeEvaluator
from clawbridge.serving.sampler import FakeSampler
from clawbridge.serving.versions import VersionRouter
from clawbridge.store import Store, TurnRecord
from clawbridge.store.promotion import Decision, DecisionSource, PromotionStore, Verdict
from clawbridge.store.versions import VersionStore
from clawbridge.trainer.fake import FakeTrainingBackend
from clawbridge.trainer.loop import TrainerConfig, TrainerLoop


def history(verdicts: str) -> list[tuple[Verdict, DecisionSource]]:
    """(verdict, source) pairs from a string read oldest first: P promoted, R rejected, A the
    admin's; newest first, as `PromotionStore.verdicts` gives them."""
    kinds: dict[str, tuple[Verdict, DecisionSource]] = {
        "P": ("promoted", "eval"), "R": ("rejected", "eval"), "A": ("promoted", "admin")}
    return [kinds[c] for c in reversed(verdicts)]


@pytest.mark.parametrize(("verdicts", "scale", "streak"), [
    ("", 1.0, 0),
    ("PPP", 1.0, 0),
    ("R", 0.5, 1),
    ("RR", 0.25, 2),
    ("RRRRRR", 0.125, 6),  # the floor
    ("RRRRRRP", 0.25, 0),  # a promotion doubles it, from the floor
    ("RRP", 0.5, 0),
    ("RRPP", 1.0, 0),
    ("RRPPP", 1.0, 0),  # never above the configured rate
    ("RRPR", 0.25, 1),
    ("RRRA", 1.0, 0),  # the admin chose what serves: a fresh start
    ("RRRAR", 0.5, 1),
])
def test_the_scale_halves_per_rejection_and_doubles_per_promotion(verdicts: str, scale: float, streak: int) -> None:
    assert step_scale(history(verdicts), 0.5, 0.125) == StepScale(scale, streak)


def test_factor_one_is_off_and_the_window_bounds_what_is_read() -> None:
    assert step_scale(history("RRRR"), 1.0, 0.125) == StepScale()
    # rejections older than the window are not read: the scale is what the newest WINDOW decisions make it
    assert step_scale(history("R" * 5 + "P" * WINDOW), 0.5, 0.125) == StepScale()
    assert step_scale(history("R" * (WINDOW + 5)), 0.5, 0.125) == StepScale(0.125, WINDOW)
    assert StepScale(0.25, 2).words() == "0.25 x the learning rate (2 candidate(s) rejected in a row)"
    assert StepScale().words() == "the full learning rate"


def _turn(store: Store, session: str, i: int) -> None:
    """One ended, rewarded one-turn session (a ready sample)."""
    now = store.clock.now()
    tid = store.record_turn(TurnRecord(session, "main", "ok", "m", [1, 2], [3 + i, 4], [-0.1, -0.2], 0, "stop",
                                       "{}", None, now, now), end_reason="end_session")
    store.add_reward(session, 1.0, "api", tid)


@pytest.mark.parametrize("backoff", [0.5, 1.0])
def test_the_trainer_steps_shorter_after_each_rejection_and_longer_after_each_promotion(
    tmp_path: Path, backoff: float
) -> None:
    """The real promoter decides each candidate on an eval set (the fake evaluator scores it); the
    real trainer loop steps on the fake backend. v1 and v3 lose items, so they are rejected (each
    rejection rolls the trainer back to v0, a new version v2 / v4 carrying it); v5 on are as good as
    v0 and promoted. The scales sent: 1, 0.5 after one rejection, 0.25 after two, then 0.5 and 1
    as v5 and v6 are promoted. With step_backoff 1 every step is at the configured rate. A new
    promoter on the same store (a restart) reads the same scale."""
    evals = tmp_path / "facts.jsonl"
    evals.write_text("\n".join(json.dumps({"id": f"f{i}", "messages": [{"role": "user", "content": "q"}],
                                           "expect": "x"}) for i in range(12)))
    settings = Settings(promotion_mode="eval", eval_set=str(evals), promotion_tolerance=0.0, capability_probe=False,
                        step_backoff=backoff)
    store = Store(tmp_path / "db.sqlite")
    backend = FakeTrainingBackend(FakeSampler(script=[7]), ModelInfo("tiny", "unused", 4096, 256))
    passed: defaultdict[int, int] = defaultdict(lambda: 10, {1: 6, 3: 6})
    router = VersionRouter(backend, VersionStore(store))
    loop = TrainerLoop(store, backend, TrainerConfig(batch_size=1, baseline="none", batch_wait_s=0))
    promoter = Promoter(settings, store, router, FakeEvaluator(passed))
    loop.gate = promoter

    async def steps(n: int) -> None:
        await promoter.recover()
        for i in range(n):
            _turn(store, f"s{i}", i)
            report = await loop.run_once()
            assert report is not None and report.ok, report
        await promoter.settle()  # decide the last one

    asyncio.run(steps(5))
    verdicts = [(d.version, d.verdict) for d in reversed(PromotionStore(store).decisions())]
    assert verdicts == [(1, "rejected"), (3, "rejected"), (5, "promoted"), (6, "promoted"), (7, "promoted")]
    sent = [loss.lr_scale for loss in backend.losses]
    recorded = [s.metrics["lr_scale"] for s in loop.tstore.lane_steps(10)[::-1] if s.status == "ok"]
    expected = [1.0, 0.5, 0.25, 0.5, 1.0] if backoff < 1 else [1.0] * 5
    assert sent == recorded == expected
    if backoff < 1:  # mid-run, after the two rejections, status says why the steps are shorter
        PromotionStore(store).decide(Decision(8, "rejected", "eval", "worse", 7), "eval")
        lines = "\n".join(promotion_lines(promotion_status(promoter)))
        assert "next step at 0.5 x the learning rate (1 candidate(s) rejected in a row)" in lines
        with store.write() as c:
            c.execute("DELETE FROM promotion_decisions WHERE version = 8")
    else:
        assert "next step at" not in "\n".join(promotion_lines(promotion_status(promoter)))
    restarted = Promoter(settings, store, router, FakeEvaluator(passed))
    assert asyncio.run(restarted.settle()).step == StepScale()  # the full rate again after two promotions
    PromotionStore(store).decide(Decision(8, "rejected", "eval", "worse", 7), "eval")
    assert asyncio.run(restarted.settle()).step == StepScale(0.5 if backoff < 1 else 1.0, 1 if backoff < 1 else 0)
    store.close()
