"""Logprobs of given tokens on Tinker: `compute_logprobs` on a sampling client.

Two users: `BaseScorer`, the base model as on-policy-distillation teacher
(`clawbridge.backend.LogprobScorer`), and `TinkerSampler.score`, a committed version's own logprobs
of given tokens (`clawbridge.serving.sampler.SequenceScorer`: promotion's held-out items and
likelihood guard). Both go through `PromptLogprobs`.

Invariants:
- Only the last n prompt logprobs are asked for (`prompt_logprobs_last_n`); a server that refuses
  that option (a 4xx) gets full prompt logprobs from then on, sliced here (logged once: a
  backend's samplers and teacher share one `PromptLogprobs`).
- An answer with the wrong length or a missing value is `TinkerRequestFailed`, never a guess.
- The base scorer's client is created once on the BASE model (no trained weights), kept apart from
  the serving sampler: published weights never reach the teacher.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from .errors import TinkerRequestFailed
from .sdk import APIStatusError, ModelInput

log = logging.getLogger(__name__)

Retry = Callable[[str, Any, float], Awaitable[Any]]
"""(what, call, timeout_s) -> the call's result, transient errors retried (`retry_transient`)."""


class LogprobCall(Protocol):
    """The `tinker.SamplingClient` method scoring uses."""

    def compute_logprobs(self, prompt: ModelInput, prompt_logprobs_last_n: int | None = ...) -> Any:
        """An awaitable of one logprob per prompt token (None where not scored)."""
        ...


class PromptLogprobs:
    """The last n prompt logprobs of a token sequence on a sampling client (module invariants)."""

    def __init__(self, retry: Retry, timeout_s: float) -> None:
        self._retry = retry
        self.timeout_s = timeout_s
        self.suffix = True
        """False once the server refused `prompt_logprobs_last_n`."""

    async def last(self, client: LogprobCall, tokens: Sequence[int], n: int) -> list[float]:
        """logprob(tokens[i] | tokens[:i]) for the last `n` positions, in order."""
        if n <= 0:
            return []
        ids = [int(t) for t in tokens]
        lps = await self._prompt_logprobs(client, ids, n)
        if len(lps) != n or any(v is None or math.isnan(float(v)) for v in lps):
            raise TinkerRequestFailed(f"compute_logprobs returned {lps!r} for the last {n} tokens")
        return [float(v) for v in lps]

    async def _prompt_logprobs(self, client: LogprobCall, tokens: list[int], n: int) -> list[Any]:
        if self.suffix:

            async def suffix() -> Any:
                return await client.compute_logprobs(ModelInput.from_ints(tokens), prompt_logprobs_last_n=n)

            try:
                return list(await self._retry("compute_logprobs", suffix, self.timeout_s))[-n:]
            except (TinkerRequestFailed, APIStatusError) as e:
                if isinstance(e, APIStatusError) and not 400 <= e.status_code < 500:
                    raise
                self.suffix = False
                log.warning("tinker: the server refused prompt_logprobs_last_n (%s); scoring with full prompt "
                            "logprobs from now on", e)

        async def full() -> Any:
            return await client.compute_logprobs(ModelInput.from_ints(tokens))

        return list(await self._retry("compute_logprobs", full, self.timeout_s))[-n:]


class BaseScorer:
    """Logprobs under the base model, from one lazily created sampling client."""

    def __init__(self, logprobs: PromptLogprobs) -> None:
        self.logprobs = logprobs
        self.client: Any = None
        """The base sampling client, once created."""

    async def score(self, new_client: Callable[[], Awaitable[Any]], sequences: Sequence[Sequence[int]],
                    prompt_lens: Sequence[int]) -> list[list[float]]:
        """Logprobs of the tokens after each prompt; `new_client` makes the base sampling client the
        first time."""
        if self.client is None:
            self.client = await new_client()
        return [await self.logprobs.last(self.client, seq, len(seq) - p)
                for seq, p in zip(sequences, prompt_lens, strict=True)]
