"""Best of n for a call that carries its user's notes: serve the answer the note explains best.

A small model follows a note only part of the time (bench/note_effect.py: SmolLM2 kept "Keep it
under 30 words." in about half its answers), so a person who asked once sees the old habit again
in the next sessions. A call with notes (`clawbridge.rewards.notes`) that asks for `n` > 1
(`notes_best_of`) samples `n` answers from the routed version with the noted prompt and serves the
one whose tokens the note made most likely: the highest note score, the mean over its tokens of
log p(token | noted prompt) - log p(token | the prompt without notes). An answer the note did not
shape scores near 0; one that follows it scores above (its short ending, the name it asks for).
Nothing here knows what a note asks.

Invariants:
- Token exact: what is served is one candidate as its sampler yielded it (ids, logprobs, top
  logprobs, finish reason) and its `policy_version`; every candidate comes from the one sampler
  the call was routed to, so from one version.
- Seeds: candidate i samples with `seed + i` (None stays None): a seeded call is reproducible and
  its candidates differ.
- Never fails where one sample would not: the first candidate is sampled like a plain call (its
  error is the call's); another that cannot start or fails is left out and the best of the rest is
  served. A score that cannot be computed leaves that candidate unscored (scored last).
- An answer that echoes its note (`echoes`, `clawbridge.rewards.notes.echoes_note`) is served only
  when every candidate does: it would win on the note's own words.
- With a checker (`follows`, the judge: `clawbridge.rewards.note_check`), the answers it says
  follow the notes are served before the rest (none, or no judgement: all as above); among those
  the note score decides. The checker sees the candidates once all are sampled and scored.
- A second round only on the checker's word: when it says none of the `n` follows, or names only
  answers that echo their note (never served while another does not), but not when it gives no
  judgement, `more` answers are sampled once (seeds go on at `seed + n`; the first round's
  version only), scored and checked; those it names are served first, else all `n + more` compete
  as above. One second round at most: the wait is bounded by two samplings and two checks.
- Cancelling `best_of` (client gone, user forgotten, timeout) closes every candidate's stream.

`FakeScoringSampler` in tests/test_best_of.py is the scripted sampler these rules are tested with;
the proxy path is tested there too (tests/test_best_of.py), over HTTP with the real openai SDK.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from clawbridge.serving.sampler import (
    FinishedStream,
    FinishReason,
    SampledToken,
    Sampler,
    SamplerError,
    SampleStream,
    SamplingParams,
    SequenceScorer,
)

log = logging.getLogger("clawbridge.serving")


@dataclass(frozen=True)
class Candidate:
    """One sampled answer and its note score."""

    tokens: list[SampledToken]
    finish_reason: FinishReason
    score: float | None
    """Mean over tokens of log p(noted) - log p(plain); None when it could not be computed."""
    echoes: bool
    """The answer repeats its note (never served while another does not)."""


@dataclass(frozen=True)
class BestOf:
    """What `best_of` served and what it chose from (recorded in the turn's meta)."""

    stream: FinishedStream
    picked: int
    """Index of the served candidate in `candidates`."""
    candidates: list[Candidate]
    checked: bool = False
    """A checker was asked which candidates follow the notes."""
    follows: list[int] | None = None
    """The candidates it said follow them (None: it gave no judgement)."""
    resampled: int = 0
    """Candidates sampled in a second round because none of the first that the checker said follow
    could be served (it named none, or only echoes; they are the last `resampled` of `candidates`)."""

    def meta(self) -> dict[str, object]:
        """The turn's `meta["best_of"]`: n sampled, which was served, every candidate's score, and
        when the judge checked them, those it said follow the notes (`follows`, None: no judgement)."""
        out: dict[str, object] = {
            "n": len(self.candidates), "picked": self.picked,
            "scores": [None if c.score is None else round(c.score, 4) for c in self.candidates],
            "echoes": sum(c.echoes for c in self.candidates)}
        if self.checked:
            out["follows"] = self.follows
        if self.resampled:
            out["resampled"] = self.resampled
        return out


def note_score(noted: Sequence[float], plain: Sequence[float]) -> float:
    """Mean per-token log-likelihood ratio of an answer with and without its note (module doc).
    The mean, not the sum: brevity is said by one early end token, which a sum over a long answer
    drowns (measured in docs/training.md, "Kept: best of n for noted calls")."""
    if not noted:
        return 0.0
    return sum(a - b for a, b in zip(noted, plain, strict=True)) / len(noted)


def pick(candidates: Sequence[Candidate], follows: Sequence[int] | None = None) -> int:
    """The served candidate (module rules): among those that do not echo their note (all of them
    when every one does), those `follows` names when it names any of them; there the highest score,
    unscored last, the earliest on ties."""
    pool = [i for i, c in enumerate(candidates) if not c.echoes] or list(range(len(candidates)))
    pool = [i for i in pool if i in (follows or ())] or pool
    return max(pool, key=lambda i: (candidates[i].score is not None, candidates[i].score or 0.0, -i))


async def _drain(stream: SampleStream) -> tuple[list[SampledToken], FinishReason]:
    tokens = [tok async for tok in stream]
    return tokens, stream.finish_reason or "stop"


async def _sample_one(sampler: Sampler, prompt_ids: Sequence[int],
                      params: SamplingParams) -> tuple[list[SampledToken], FinishReason, int]:
    stream = await sampler.sample(prompt_ids, params)
    try:
        tokens, reason = await _drain(stream)
    finally:
        with contextlib.suppress(Exception):
            await stream.aclose()
    return tokens, reason, stream.policy_version


async def _score(scorer: SequenceScorer, noted_ids: Sequence[int], plain_ids: Sequence[int],
                 tokens: list[SampledToken], params: SamplingParams) -> float | None:
    ids = [t.token_id for t in tokens]
    if not ids:
        return 0.0
    try:
        plain = await scorer.score(plain_ids, ids)
        # At temperature 1 the sampled logprobs are the untempered ones (`SampledToken.logprob`).
        noted = ([t.logprob for t in tokens] if params.temperature == 1.0
                 else await scorer.score(noted_ids, ids))
        return note_score(noted, plain)
    except SamplerError as exc:
        log.warning("best of n: a candidate could not be scored (%s); it is served only if none is", exc)
        return None


def can_pick(sampler: Sampler, params: SamplingParams, n: int) -> bool:
    """Whether a call can be served best of `n`: n > 1, sampled (greedy gives one answer n times),
    and a sampler that scores given tokens under its own weights (`SequenceScorer`)."""
    return n > 1 and params.temperature > 0.0 and isinstance(sampler, SequenceScorer)


Follows = Callable[[list[list[int]]], Awaitable[list[int] | None]]
"""A checker: the candidates' completion ids -> the indices that follow the notes, or None (no
judgement). It must not raise (`clawbridge.rewards.note_check.NoteChecker.follows`)."""


def _seeded(params: SamplingParams, i: int) -> SamplingParams:
    """Candidate i's sampling params: seed + i (module rules)."""
    return params if params.seed is None or i == 0 else dataclasses.replace(params, seed=params.seed + i)


async def _sample_round(sampler: Sampler, scorer: SequenceScorer, noted_ids: Sequence[int], plain_ids: Sequence[int],
                        params: SamplingParams, first: int, k: int, echoes: Callable[[list[int]], bool],
                        version: int | None) -> tuple[int, list[Candidate]]:
    """Candidates `first` .. `first + k - 1`, sampled at once and scored: the version they come from
    and those of it that did not fail. `version` None: the first round, whose first candidate's
    error is the call's; else candidates of another version are left out (never mixed)."""
    runs = [asyncio.ensure_future(_sample_one(sampler, noted_ids, _seeded(params, first + i))) for i in range(k)]
    try:
        await asyncio.wait(runs)
    except BaseException:
        for run in runs:
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        raise
    failed = [run.exception() for run in runs]
    if version is None:
        if failed[0] is not None:
            raise failed[0]  # the call's own error when even the first sample fails
        version = runs[0].result()[2]
    kept: list[tuple[list[SampledToken], FinishReason]] = []
    for i, (run, exc) in enumerate(zip(runs, failed, strict=True)):
        if exc is not None:
            log.warning("best of n: candidate %d failed (%s); served from the rest", first + i + 1, exc)
        elif run.result()[2] == version:  # a version published between two starts: not mixed
            kept.append(run.result()[:2])
    scores = await asyncio.gather(*(_score(scorer, noted_ids, plain_ids, toks, params) for toks, _ in kept))
    return version, [Candidate(toks, reason, score, echoes([t.token_id for t in toks]))
                     for (toks, reason), score in zip(kept, scores, strict=True)]


def _clean(candidates: Sequence[Candidate], named: Sequence[int]) -> list[int]:
    """Those of `named` (the checker's indices) that exist and do not echo their note."""
    return [i for i in named if 0 <= i < len(candidates) and not candidates[i].echoes]


def _ids(candidates: Sequence[Candidate]) -> list[list[int]]:
    return [[t.token_id for t in c.tokens] for c in candidates]


async def best_of(sampler: Sampler, noted_ids: Sequence[int], plain_ids: Sequence[int],
                  params: SamplingParams, n: int, echoes: Callable[[list[int]], bool],
                  follows: Follows | None = None, more: int = 0) -> BestOf:
    """Sample `n` answers to `noted_ids` from `sampler` (a `SequenceScorer`, see `can_pick`) and
    return the one to serve (module rules). `echoes(ids)`: does that answer repeat its note;
    `follows`: the checker, when the judge checks the candidates; `more`: answers sampled once more
    when none of the first `n` it says follow the notes can be served (it checks those too)."""
    assert isinstance(sampler, SequenceScorer), "best_of needs a sampler that scores (can_pick)"
    version, candidates = await _sample_round(sampler, sampler, noted_ids, plain_ids, params, 0, n, echoes, None)
    judged = await follows(_ids(candidates)) if follows is not None else None
    resampled = 0
    if follows is not None and judged is not None and more > 0 and not _clean(candidates, judged):
        _, extra = await _sample_round(sampler, sampler, noted_ids, plain_ids, params, n, more, echoes, version)
        again = await follows(_ids(extra)) if extra else None
        judged = judged + [len(candidates) + i for i in again or ()]
        candidates, resampled = candidates + extra, len(extra)
    chosen = pick(candidates, judged)
    served = candidates[chosen]
    return BestOf(FinishedStream(list(served.tokens), version, served.finish_reason), chosen, candidates,
                  follows is not None, judged, resampled)
