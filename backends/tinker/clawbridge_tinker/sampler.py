"""Token-level sampling through a Tinker `SamplingClient`, behind clawbridge's Sampler seam.

Invariants:
- Tinker returns a finished sample, not a token stream. The stream handed to the proxy is chunked
  from that finished sample: ids and logprobs are exactly what Tinker returned.
- Each stream reads (policy version, sampling client) once, as one tuple, when it starts. `swap`
  replaces that tuple in a single assignment, so a publish never pauses sampling, and a call in
  flight finishes on the client it started on and reports that client's version.
- Versions only go up: `swap` refuses a version that is not newer than the current one. `rebind`
  keeps the version and changes the client, for the same weights served from another client (a
  restore of the served version's own checkpoint, whose old client is about to be released).
- Errors map onto the seam: timeout -> SamplerTimeout, 429 that outlasts the retries ->
  SamplerOverloaded, anything else Tinker fails -> SamplerUnavailable; an over-long prompt is
  refused before anything is sent (PromptTooLong).
- `score` (`SequenceScorer`) reads (version, client) once, like a stream, and asks that client's
  `compute_logprobs` for the given tokens (`clawbridge_tinker.scoring`): the version's own
  logprobs, untempered, which is what promotion's held-out items and likelihood guard need.

`FakeSamplingClient` beside the seam scripts Tinker responses for unit tests.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from clawbridge.serving.sampler import (
    FinishedStream,
    FinishReason,
    SampledToken,
    SamplerOverloaded,
    SamplerTimeout,
    SamplerUnavailable,
    SampleStream,
    SamplingParams,
    check_prompt_fits,
    finish_sample,
)

from .convert import to_tinker_sampling_params
from .errors import TinkerRequestFailed, TinkerTransientError, retry_transient
from .scoring import LogprobCall, PromptLogprobs
from .sdk import ModelInput, RateLimitError, SampleResponse
from .sdk import SamplingParams as TinkerSamplingParams


class SampleCall(LogprobCall, Protocol):
    """The `tinker.SamplingClient` methods this module uses: `sample`, and `compute_logprobs` to score."""

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int,
        sampling_params: TinkerSamplingParams,
        include_prompt_logprobs: bool = ...,
        topk_prompt_logprobs: int = ...,
        topk_sample_logprobs: int = ...,
    ) -> Any:
        """Returns an awaitable of `tinker.SampleResponse` (an `APIFuture`)."""
        ...


@dataclass(frozen=True)
class SamplerLimits:
    """Bounds on one sample call."""

    context_window: int
    """Prompt + max_tokens above this is refused with PromptTooLong."""
    timeout_s: float = 300.0
    """Wall-clock bound on one sample, retries included."""
    max_retries: int = 3
    """Retries of a transient failure."""
    backoff_s: float = 1.0
    """First wait between retries; doubles each time."""
    chunk_size: int = 16
    """Tokens yielded between event-loop yields when replaying the finished sample."""


class TinkerSampler:
    """Sampler over the current Tinker sampling client; `swap` publishes a new one."""

    def __init__(self, client: SampleCall, version: int, limits: SamplerLimits,
                 logprobs: PromptLogprobs | None = None) -> None:
        """`logprobs`: the backend's shared `compute_logprobs` state (`score`); default, one of its own."""
        self._current: tuple[int, SampleCall] = (version, client)
        self.limits = limits
        self._logprobs = logprobs or PromptLogprobs(self._retry, limits.timeout_s)

    async def _retry(self, what: str, call: Any, timeout_s: float) -> Any:
        """`call` with transient failures retried within this sampler's limits."""
        return await retry_transient(what, call, timeout_s=timeout_s, max_retries=self.limits.max_retries,
                                     backoff_s=self.limits.backoff_s)

    @property
    def policy_version(self) -> int:
        return self._current[0]

    def swap(self, client: SampleCall, version: int) -> None:
        """Serve `client` as `version` for streams started from now on."""
        if version <= self._current[0]:
            raise ValueError(f"policy version must increase: {version} <= {self._current[0]}")
        self._current = (version, client)

    def rebind(self, client: SampleCall) -> None:
        """Serve the current version from `client`, which samples the same weights."""
        self._current = (self._current[0], client)

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> SampleStream:
        version, client = self._current
        limits = self.limits
        check_prompt_fits(len(prompt_ids), params.max_tokens, limits.context_window)
        prompt = ModelInput.from_ints([int(t) for t in prompt_ids])
        tparams = to_tinker_sampling_params(params)

        def call() -> Awaitable[SampleResponse]:
            return _as_coroutine(
                client.sample(
                    prompt,
                    num_samples=1,
                    sampling_params=tparams,
                    topk_sample_logprobs=params.top_logprobs,
                )
            )

        try:
            response = await self._retry("tinker sample", call, limits.timeout_s)
        except Exception as e:
            raise seam_error("sample", e, limits) from e
        tokens, reason = sampled_tokens(response, params)
        return FinishedStream(tokens, version, reason, limits.chunk_size)

    async def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        """logprob(completion[i] | prompt + completion[:i]) under this sampler's version, in order
        (`SequenceScorer`); errors map onto the seam as `sample`'s do."""
        _, client = self._current
        check_prompt_fits(len(prompt_ids) + len(completion_ids), 0, self.limits.context_window)
        try:
            return await self._logprobs.last(client, [*prompt_ids, *completion_ids], len(completion_ids))
        except Exception as e:
            raise seam_error("compute_logprobs", e, self.limits) from e


def seam_error(what: str, e: Exception, limits: SamplerLimits) -> Exception:
    """A failed Tinker call as the Sampler seam's error (module invariants); `e` becomes its cause."""
    if isinstance(e, TinkerTransientError):
        if isinstance(e.__cause__, TimeoutError):
            return SamplerTimeout(str(e))
        if isinstance(e.__cause__, RateLimitError):
            return SamplerOverloaded(str(e), retry_after_s=limits.backoff_s)
        return SamplerUnavailable(str(e))
    if isinstance(e, TinkerRequestFailed):
        return SamplerUnavailable(str(e))
    # the SDK raises ValueError/APIStatusError for protocol trouble
    return SamplerUnavailable(f"tinker {what} failed: {type(e).__name__}: {e}")


async def _as_coroutine(awaitable: Any) -> SampleResponse:
    result: SampleResponse = await awaitable
    return result


def sampled_tokens(
    response: SampleResponse, params: SamplingParams
) -> tuple[list[SampledToken], FinishReason]:
    """The sampled ids with their logprobs, cut after a stop id or at max_tokens."""
    if not response.sequences:
        raise SamplerUnavailable("tinker returned no sequence")
    seq = response.sequences[0]
    ids = [int(t) for t in seq.tokens]
    logprobs = seq.logprobs
    if logprobs is None or len(logprobs) != len(ids):
        raise SamplerUnavailable(
            "tinker returned no logprob per sampled token; cannot record token-exact data"
        )
    topk = seq.topk_logprobs if params.top_logprobs else None
    out: list[SampledToken] = []
    for i, (tid, lp) in enumerate(zip(ids, logprobs, strict=True)):
        row = topk[i] if topk is not None and i < len(topk) else None
        out.append(SampledToken(tid, float(lp), tuple((int(a), float(b)) for a, b in row or ())))
    return finish_sample(out, seq.stop_reason == "stop", params)


# --------------------------------------------------------------------------------------------
# Fake, for unit tests of the seam without a server.


@dataclass
class FakeSamplingClient:
    """Answers every sample with `tokens` / `logprobs` and every prompt token's logprob with
    `prompt_logprob` (None for the first, as Tinker answers); records each call in `calls`."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str = "stop"
    prompt_logprob: float = -1.0
    calls: list[tuple[list[int], TinkerSamplingParams | None]] = field(default_factory=list)

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int,
        sampling_params: TinkerSamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
    ) -> Awaitable[SampleResponse]:
        from tinker.types import SampledSequence

        self.calls.append((prompt.to_ints(), sampling_params))
        seq = SampledSequence(
            stop_reason=self.stop_reason,  # type: ignore[arg-type]
            sequence_id="fake-0",
            tokens_np=np.asarray(self.tokens, dtype=np.int32),
            logprobs_np=np.asarray(self.logprobs, dtype=np.float32),
        )

        async def done() -> SampleResponse:
            return SampleResponse(sequences=[seq])

        return done()

    def compute_logprobs(self, prompt: ModelInput, prompt_logprobs_last_n: int | None = None) -> Awaitable[list[float | None]]:
        ids = prompt.to_ints()
        self.calls.append((ids, None))
        lps: list[float | None] = [None] + [self.prompt_logprob] * (len(ids) - 1)

        async def done() -> list[float | None]:
            return lps[-prompt_logprobs_last_n:] if prompt_logprobs_last_n else lps

        return done()
