"""Evaluate one committed policy version on an `EvalSet`, greedy, through the `VersionRouter`.

Invariants:
- The version answers through `VersionRouter.sampler_for(version)`: the same sampler `NAME@N`
  gets, so what is evaluated is exactly what would serve. Answers are greedy (temperature 0), so
  a version's figures on a set are fixed and may be cached (`clawbridge.store.promotion`).
- Evaluation never records a turn: nothing it samples is trained on or shown as a session.
- An `expect` item's greedy answer stops as soon as it matches: it would pass whatever followed,
  so the figures are those of the whole answer, at the cost of its first tokens.
- At most `concurrency` items are sampled at once, so evaluating never takes every engine slot
  from the agent; an overloaded sampler is retried after its Retry-After, a bounded number of times.
- `VersionEval.score` is the mean item score in [0, 1] (expect items: 1 pass, 0 fail; topic items:
  1 when the answer talks about the question, by `clawbridge.chat.topic.on_topic`; rubric items:
  (verdict + 1) / 2; held-out items: `held_out_score`), the figure promotion compares.
- A held-out item is scored by likelihood where the version's sampler can score given tokens
  (`SequenceScorer`: the local torch engine, Tinker's `compute_logprobs`): margin = verdict x (the
  version's mean per-token logprob of the recorded answer - the mean of the logprobs it was sampled with), score =
  sigmoid(HELD_OUT_SCALE x margin), passed when margin > HELD_OUT_PASS. So a version trained toward
  the users' verdicts (more likely to say what they accepted, less what they rejected) scores above
  0.5, the policy that sampled them 0.5, one trained against them below; it moves with every step,
  where a greedy replay of a temperature-1 answer almost never matched it. A sampler that cannot
  score (Fireworks, SGLang) replays greedily: passed when the greedy answer is the recorded
  one (verdict > 0) or is not (verdict < 0).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from clawbridge.access import OPERATOR
from clawbridge.chat.topic import on_topic
from clawbridge.promotion.evalset import EvalItem, EvalSet, EvalSetError
from clawbridge.promotion.stats import wilson
from clawbridge.rewards.judge import VoteConfig, judge_turn
from clawbridge.serving.sampler import Sampler, SamplerOverloaded, SamplingParams, SequenceScorer

if TYPE_CHECKING:
    from clawbridge.chat.chatformat import ChatFormat
    from clawbridge.rewards.judge import JudgeModel
    from clawbridge.serving.versions import VersionRouter

OVERLOAD_RETRIES = 20
EVAL_CONCURRENCY = 8
"""Items sampled at once: the engine batches them (40 probe items are 5 rounds), and the agent's
calls still find room (they wait, never refused)."""

HELD_OUT_SCALE = 4.0
"""Per nat of mean per-token margin: a quarter nat per token toward the verdict scores 0.73."""
HELD_OUT_PASS = 0.01
"""A held-out item passes when it moved toward its verdict by more than this many nats per token."""


def held_out_score(verdict: int, logprobs: Sequence[float], sampled: Sequence[float]) -> tuple[float, float]:
    """(margin, score) of a held-out item (module invariants): `logprobs` the version's of the
    recorded answer, `sampled` those it was recorded with. Reusable by any scorer of versions."""
    if not logprobs:
        return 0.0, 0.5
    mine = sum(logprobs) / len(logprobs)
    ref = sum(sampled) / len(sampled) if len(sampled) == len(logprobs) else mine
    margin = (1.0 if verdict > 0 else -1.0) * (mine - ref)
    return margin, 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, HELD_OUT_SCALE * margin))))

RUBRIC_PROMPT = """You grade one answer of an AI assistant against a rubric. You see the conversation's \
last user message, the assistant's answer and the rubric. Answer with a one-sentence reason, then a final \
line `SCORE: +1` (the answer meets the rubric), `SCORE: 0` (partly, or you cannot tell) or `SCORE: -1` \
(it does not)."""


@dataclass(frozen=True)
class ItemResult:
    id: str
    kind: str
    passed: bool
    score: float
    """In [0, 1]."""
    answer: str
    tokens: int
    judge_score: int | None = None
    """rubric: the judge's verdict in {-1, 0, 1}."""


@dataclass(frozen=True)
class VersionEval:
    """A version's figures on one evaluation set (what `clawbridge eval` prints per version)."""

    version: int
    source: str
    digest: str
    items: int
    passed: int
    pass_rate: float
    ci_low: float
    ci_high: float
    """95% Wilson interval of the pass rate."""
    score: float
    mean_judge_score: float | None
    """Mean rubric verdict in [-1, 1] (None: the set has no rubric items)."""
    mean_answer_tokens: float
    seconds: float
    failed: list[str]
    """Ids of the items that did not pass (the first 20)."""
    failed_answers: list[str]
    """The greedy answers of the first 5 of them (200 characters each), to see why."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VersionEval:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


class VersionScorer(Protocol):
    """What promotion needs of an evaluator (`Evaluator`; `FakeEvaluator` beside it for tests)."""

    judge: JudgeModel | None
    """Scores rubric items (None: a set with rubric lines cannot be scored)."""

    async def evaluate(self, version: int, eval_set: EvalSet) -> VersionEval:
        """`version`'s figures on `eval_set` (greedy, so fixed per version and set)."""
        ...


class FakeEvaluator:
    """A `VersionScorer` without a model: version v passes the first `passed[v]` items (of a set
    named in `by_set`, the first `by_set[source][v]`)."""

    def __init__(self, passed: dict[int, int], by_set: dict[str, dict[int, int]] | None = None,
                 references_of: dict[int, int] | None = None) -> None:
        self.passed = passed
        self.by_set = by_set or {}
        self.references_of = references_of
        """`references(v, ...)`: the first `references_of[v]` items as reference answers (None:
        the sampler cannot score given tokens, like Fireworks')."""
        self.judge: JudgeModel | None = None
        self.calls: list[int] = []
        """The versions evaluated, in order (a cached figure is not asked for again)."""
        self.asked: list[tuple[int, str]] = []
        """(version, set source) of each evaluation, in order."""

    async def evaluate(self, version: int, eval_set: EvalSet) -> VersionEval:
        self.calls.append(version)
        self.asked.append((version, eval_set.source))
        n, k = len(eval_set.items), self.by_set.get(eval_set.source, self.passed)[version]
        low, high = wilson(k, n)
        failed = [it.id for it in eval_set.items[k:]]
        return VersionEval(version, eval_set.source, eval_set.digest, n, k, k / n, low, high, k / n, None, 0.0, 0.0,
                           failed[:20], [])

    async def references(self, version: int, eval_set: EvalSet, max_tokens: int) -> list[EvalItem] | None:
        self.asked.append((version, "references"))
        if self.references_of is None:
            return None
        return [EvalItem("held_out", it.id, prompt_ids=(1,), completion_ids=(2, 3), completion_logprobs=(-0.5, -0.5),
                         verdict=1) for it in eval_set.items[:self.references_of[version]]]


class Evaluator:
    """Greedy answers of a version to each item, scored (module invariants)."""

    def __init__(self, router: VersionRouter, renderer: ChatFormat, judge: JudgeModel | None = None,
                 max_tokens: int = 256, concurrency: int = EVAL_CONCURRENCY, votes: VoteConfig | None = None) -> None:
        self.router = router
        self.renderer = renderer
        self.judge = judge
        self.max_tokens = max_tokens
        self.slots = asyncio.Semaphore(concurrency)
        self.votes = votes or VoteConfig()

    async def evaluate(self, version: int, eval_set: EvalSet) -> VersionEval:
        """Score `version` on `eval_set`; raises `VersionNotFound` (no such version) or
        `EvalSetError` (rubric items without a judge)."""
        if eval_set.needs_judge and self.judge is None:
            raise EvalSetError(f"{eval_set.source}: rubric items need a judge (set judge = endpoint or base)")
        sampler = await self.router.sampler_for(version, OPERATOR, "evaluate")
        t0 = time.monotonic()
        cut = eval_set.max_tokens or self.max_tokens
        results = await asyncio.gather(*(self._item(sampler, item, cut) for item in eval_set.items))
        seconds = time.monotonic() - t0
        n = len(results)
        passed = sum(r.passed for r in results)
        low, high = wilson(passed, n)
        judged = [r.judge_score for r in results if r.judge_score is not None]
        return VersionEval(
            version=version, source=eval_set.source, digest=eval_set.digest, items=n, passed=passed,
            pass_rate=passed / n if n else 0.0, ci_low=low, ci_high=high,
            score=sum(r.score for r in results) / n if n else 0.0,
            mean_judge_score=sum(judged) / len(judged) if judged else None,
            mean_answer_tokens=sum(r.tokens for r in results) / n if n else 0.0,
            seconds=seconds, failed=[r.id for r in results if not r.passed][:20],
            failed_answers=[r.answer[:200] for r in results if not r.passed][:5])

    async def answer(self, sampler: Sampler, prompt_ids: list[int], max_tokens: int,
                     done: Callable[[list[int]], bool] | None = None) -> list[int]:
        """The greedy completion ids of `prompt_ids` (stop token included when one ended it), cut
        short as soon as `done(ids so far)` says the item's outcome is known."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                stop_token_ids=tuple(self.renderer.stop_token_ids))
        async with self.slots:
            for attempt in range(OVERLOAD_RETRIES + 1):
                try:
                    stream = await sampler.sample(prompt_ids, params)
                    break
                except SamplerOverloaded as exc:
                    if attempt == OVERLOAD_RETRIES:
                        raise
                    await asyncio.sleep(min(5.0, max(0.1, exc.retry_after_s)))
            ids: list[int] = []
            async for t in stream:
                ids.append(t.token_id)
                if done is not None and done(ids):
                    await stream.aclose()
                    break
            return ids

    async def _item(self, sampler: Sampler, item: EvalItem, max_tokens: int) -> ItemResult:
        if item.kind == "held_out" and isinstance(sampler, SequenceScorer) and item.completion_ids:
            async with self.slots:
                lps = await sampler.score(item.prompt_ids, item.completion_ids)
            margin, score = held_out_score(item.verdict, lps, item.completion_logprobs)
            return ItemResult(item.id, item.kind, margin > HELD_OUT_PASS, score,
                              f"margin {margin:+.4f} nats per token", len(item.completion_ids))
        if item.kind == "held_out":
            ids = await self.answer(sampler, list(item.prompt_ids), max(1, len(item.completion_ids)))
            same = tuple(ids) == item.completion_ids
            passed = same if item.verdict > 0 else not same
            return ItemResult(item.id, item.kind, passed, float(passed), self._text(ids), len(ids))
        if item.kind == "open":
            raise EvalSetError(f"{item.id}: an open question is scored only through a reference answer to it")
        if item.kind == "expect":
            _, ids, passed = await self._expect(sampler, item, max_tokens)
            return ItemResult(item.id, item.kind, passed, float(passed), self._text(ids), len(ids))
        prompt = await asyncio.to_thread(self.renderer.render, list(item.chat))
        ids = await self.answer(sampler, prompt, max_tokens)
        text = self._text(ids)
        if item.kind == "topic":
            passed = on_topic(item.question, text)
            return ItemResult(item.id, item.kind, passed, float(passed), text, len(ids))
        verdict = await self._judge(item, text)
        return ItemResult(item.id, item.kind, verdict > 0, (verdict + 1) / 2, text, len(ids), verdict)

    async def references(self, version: int, eval_set: EvalSet, max_tokens: int) -> list[EvalItem] | None:
        """`version`'s greedy answers to the expect items of `eval_set` it passes within
        `max_tokens` (cut where they match, token exact) and to its open items (whole, non-empty),
        each with its own logprobs of them, as verdict +1 held-out items
        (`clawbridge.promotion.likelihood`); None when its sampler cannot score given tokens."""
        sampler = await self.router.sampler_for(version, OPERATOR, "evaluate")
        if not isinstance(sampler, SequenceScorer):
            return None
        scorer: SequenceScorer = sampler

        async def one(item: EvalItem) -> EvalItem | None:
            if item.kind == "open":
                prompt = await asyncio.to_thread(self.renderer.render, list(item.chat))
                ids, passed = await self.answer(sampler, prompt, max_tokens), True
            elif item.kind == "expect":
                prompt, ids, passed = await self._expect(sampler, item, max_tokens)
            else:
                return None
            if not passed or not ids:  # an empty answer (even one a pattern matched) has no token to score
                return None
            async with self.slots:
                lps = await scorer.score(prompt, ids)
            return EvalItem("held_out", item.id, prompt_ids=tuple(prompt), completion_ids=tuple(ids),
                            completion_logprobs=tuple(lps), verdict=1)

        found = await asyncio.gather(*(one(i) for i in eval_set.items))
        return [i for i in found if i is not None]

    async def _expect(self, sampler: Sampler, item: EvalItem, max_tokens: int) -> tuple[list[int], list[int], bool]:
        """(prompt ids, greedy answer ids, passed) of an expect item: a greedy answer that matched
        passes whatever follows, so it stops there."""
        prompt = await asyncio.to_thread(self.renderer.render, list(item.chat))
        pattern = re.compile(item.expect, re.IGNORECASE)
        ids = await self.answer(sampler, prompt, max_tokens, lambda ids: pattern.search(self._text(ids)) is not None)
        return prompt, ids, pattern.search(self._text(ids)) is not None

    def _text(self, ids: list[int]) -> str:
        stops = set(self.renderer.stop_token_ids)
        return str(self.renderer.decode([i for i in ids if i not in stops]))

    async def _judge(self, item: EvalItem, answer: str) -> int:
        from clawbridge.rewards.judge import last_user_text

        assert self.judge is not None
        user = (f"## The user's last message\n{last_user_text(list(item.messages)) or '(none)'}\n\n"
                f"## The assistant's answer\n{answer or '(empty)'}\n\n## Rubric\n{item.rubric}")
        messages = [{"role": "system", "content": RUBRIC_PROMPT}, {"role": "user", "content": user}]
        return (await judge_turn(self.judge, messages, self.votes, seed=0)).score
