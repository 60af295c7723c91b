"""The Sampler seam: token ids in, token ids (with logprobs) out.

Invariants kept by every Sampler implementation:
- Token exact: `sample` takes prompt token ids exactly as rendered and yields the ids it sampled,
  each with the logprob the sampling distribution gave it (after temperature, before top-p/top-k
  truncation is not promised: see `SampledToken.logprob`). Nothing here sees text.
- The policy version of a stream is fixed when the stream is created: a weight swap during the
  stream does not change which weights finish it, nor the version it reports.
- A stop token (one of `SamplingParams.stop_token_ids`) that ends the stream is yielded as the
  last token, so training data contains the end-of-turn token the model produced.
- `aclose()` (or cancelling the consuming task) stops generation promptly and frees the slot.
- Overload is an exception raised by `sample` (`SamplerOverloaded`), never an unbounded wait.

`FakeSampler` beside the protocol is a scripted, instant sampler for tests and benchmarks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "cancelled"]


MIN_TEMPERATURE = 1e-4
"""Temperatures in (0, MIN_TEMPERATURE) are treated as 0 (greedy): dividing logits by a tiny
temperature overflows float32 to inf and the softmax to nan, and the distribution they ask for is
argmax anyway to within float precision."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    Normalised on construction, so no Sampler sees numerically unsafe values: a temperature in
    (0, `MIN_TEMPERATURE`) becomes 0 (greedy).
    """

    max_tokens: int
    """Upper bound on sampled tokens (the stop token counts)."""
    temperature: float = 1.0
    """0 means greedy (argmax); logprobs are then those of the untempered distribution."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    seed: int | None = None
    """Same seed, prompt and weights give the same tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Sampling ends after yielding any of these ids (finish_reason 'stop')."""
    top_logprobs: int = 0
    """How many alternatives to report per position (0: none)."""

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)


@dataclass(frozen=True)
class SampledToken:
    """One sampled position."""

    token_id: int
    logprob: float
    """log p(token_id) under the distribution it was sampled from (temperature applied;
    for temperature 0, the plain softmax)."""
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """(token_id, logprob) of the most likely alternatives, best first, when asked for."""


class SamplerError(Exception):
    """Base of the errors a Sampler raises; the proxy maps each to an HTTP status."""


class SamplerOverloaded(SamplerError):
    """Too many requests in flight and queued: answer 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SamplerUnavailable(SamplerError):
    """The model server cannot be reached or failed: answer 502."""


class SamplerFailed(SamplerError):
    """The sampler itself failed (a bug or bad numerics), with the model reachable: answer 502
    `model_error`, never 'model unreachable'."""


class SamplerTimeout(SamplerError):
    """The model server did not answer in time: answer 504."""


class PromptTooLong(SamplerError):
    """The prompt (plus max_tokens) does not fit the model's context: answer 400."""


def check_prompt_fits(prompt_len: int, max_tokens: int, context_window: int) -> None:
    """Raise `PromptTooLong` for an empty prompt, or one that with `max_tokens` does not fit
    `context_window`: what a hosted sampler checks before sending anything."""
    if prompt_len == 0:
        raise PromptTooLong("empty prompt")
    if prompt_len + max_tokens > context_window:
        raise PromptTooLong(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                            f"context window of {context_window}")


def finish_sample(tokens: Sequence[SampledToken], server_stopped: bool,
                  params: SamplingParams) -> tuple[list[SampledToken], FinishReason]:
    """A whole sample as a server returned it, cut the way a streamed one ends: after the first
    of `params.stop_token_ids` ("stop"), at `params.max_tokens` ("length"); else "stop" when the
    server says it stopped, "length" when not. What hosted samplers hand to `FinishedStream`."""
    out = list(tokens)
    reason: FinishReason = "stop" if server_stopped else "length"
    stops = set(params.stop_token_ids)
    for i, tok in enumerate(out):
        if tok.token_id in stops:
            out, reason = out[: i + 1], "stop"
            break
    if len(out) > params.max_tokens:
        out, reason = out[: params.max_tokens], "length"
    return out, reason


@runtime_checkable
class SampleStream(Protocol):
    """An in-progress sample. Iterate it for tokens; read `finish_reason` after it ends."""

    policy_version: int
    finish_reason: FinishReason | None

    def __aiter__(self) -> AsyncIterator[SampledToken]: ...

    async def aclose(self) -> None:
        """Stop sampling now (client went away). Idempotent."""
        ...


@runtime_checkable
class Sampler(Protocol):
    """Token-level sampling from the current policy.

    Fake: `FakeSampler` below (scripted ids and logprobs; `tests/fake_proxy.SwitchableSampler`
    adds failures). Tested by tests/test_chat_scripted.py, tests/test_proxy_engine.py (the
    in-process engine), tests/test_tinker_backend.py and tests/test_fireworks_backend.py (hosted)."""

    @property
    def policy_version(self) -> int:
        """The version new streams will be sampled from."""
        ...

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> SampleStream:
        """Start sampling. Raises a `SamplerError` subclass when it cannot start."""
        ...


@dataclass
class FinishedStream:
    """A `SampleStream` replaying a sample that is already finished: the one replay that hosted
    samplers (which get whole samples back) and `FakeSampler` share.

    Yields `tokens` in order, giving the event loop a turn every `chunk_size` tokens and waiting
    `delay_s` before each token (0: none); its `finish_reason` is `final_reason` once every token
    is out, or "cancelled" when `aclose` comes first."""

    tokens: list[SampledToken]
    policy_version: int
    final_reason: FinishReason
    """The finish reason once every token has been yielded."""
    chunk_size: int = 16
    """Tokens yielded between event-loop turns."""
    delay_s: float = 0.0
    """Wait before each token (a slow fake model); 0 for a real finished sample."""
    finish_reason: FinishReason | None = None
    _closed: bool = False

    def __aiter__(self) -> AsyncIterator[SampledToken]:
        return self._run()

    async def _run(self) -> AsyncIterator[SampledToken]:
        for i, tok in enumerate(self.tokens):
            if self._closed:
                self.finish_reason = "cancelled"
                return
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            elif i and i % self.chunk_size == 0:
                await asyncio.sleep(0)
            yield tok
        self.finish_reason = self.final_reason

    async def aclose(self) -> None:
        self._closed = True
        if self.finish_reason is None:
            self.finish_reason = "cancelled"


# --------------------------------------------------------------------------------------------
# Fake, for tests and benchmarks.


@dataclass
class FakeSampler:
    """Replays `script` (token ids) for every prompt, instantly or with `delay_s` per token.

    Records every prompt it was given in `prompts`, so tests can assert on what was fed (unless
    `keep_prompts` is False: a benchmark's stand-in for a model, whose copies would be counted
    as the proxy's time and grow without bound).
    """

    script: list[int]
    logprob: float = -0.5
    delay_s: float = 0.0
    version: int = 0
    prompts: list[list[int]] = field(default_factory=list)
    keep_prompts: bool = True

    @property
    def policy_version(self) -> int:
        return self.version

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> SampleStream:
        if self.keep_prompts:
            self.prompts.append(list(prompt_ids))
        toks: list[SampledToken] = []
        reason: FinishReason = "length"
        for t in self.script[: params.max_tokens]:
            toks.append(SampledToken(t, self.logprob))
            if t in params.stop_token_ids:
                reason = "stop"
                break
        return FinishedStream(toks, self.version, reason, delay_s=self.delay_s)


@runtime_checkable
class SequenceScorer(Protocol):
    """Optional: a sampler that scores given tokens under its own weights, without sampling
    (check with `isinstance(sampler, SequenceScorer)`). Promotion scores held-out turns with it
    (`clawbridge.promotion.runner`).

    Invariant: token exact, like `clawbridge.backend.LogprobScorer` but for THIS sampler's
    version: logprob(completion[i] | prompt + completion[:i]) for every i, in order, untempered
    (temperature 1, no truncation): the numbers sampling at temperature 1 would report.

    Implemented by the local torch engine (`TorchEngine`, `TorchVersionSampler`; tested by
    tests/test_engine.py::test_score_equals_the_sampled_logprobs) and by Tinker's samplers
    (`compute_logprobs` on the version's own sampling client; tests/test_likelihood_guard_tinker.py)."""

    async def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]: ...


@runtime_checkable
class EngineStatus(Protocol):
    """Optional: a serving engine that can say how full its KV budget is (status pages show it)."""

    def engine_status(self) -> dict[str, object]:
        """A snapshot: kv_budget_tokens, kv_used_tokens (reserved by running requests),
        kv_cached_tokens (evictable prefixes), kv_used_fraction, running, waiting (accepted, not yet
        running), waited_for_budget (requests so far that found the budget full)."""
        ...


def engine_status(engine: object) -> dict[str, object] | None:
    """`engine.engine_status()` when the engine has one, else None."""
    return engine.engine_status() if isinstance(engine, EngineStatus) else None
