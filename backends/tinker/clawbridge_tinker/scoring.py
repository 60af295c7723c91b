"""The base model as on-policy-distillation teacher on Tinker (`clawbridge.backend.LogprobScorer`).

Invariants:
- Scores come from a sampling client created once on the BASE model (no trained weights), kept
  apart from the serving sampler: published weights never reach the teacher.
- Only the last n prompt logprobs are asked for (`prompt_logprobs_last_n`); a server that refuses
  that option (a 4xx) gets full prompt logprobs from then on, sliced here (logged once).
- An answer with the wrong length or a missing value is `TinkerRequestFailed`, never a guess.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .errors import TinkerRequestFailed
from .sdk import APIStatusError, ModelInput

log = logging.getLogger(__name__)

Retry = Callable[[str, Any, float], Awaitable[Any]]
"""`TinkerBackend._retry`: (what, call, timeout_s) -> the call's result, transient errors retried."""


class BaseScorer:
    """Logprobs under the base model, from one lazily created sampling client."""

    def __init__(self, retry: Retry, timeout_s: float) -> None:
        self._retry = retry
        self.timeout_s = timeout_s
        self.client: Any = None
        """The base sampling client, once created."""
        self.suffix = True
        """False once the server refused `prompt_logprobs_last_n`."""

    async def score(self, new_client: Callable[[], Awaitable[Any]], sequences: Sequence[Sequence[int]],
                    prompt_lens: Sequence[int]) -> list[list[float]]:
        """Logprobs of the tokens after each prompt; `new_client` makes the base sampling client the
        first time."""
        if self.client is None:
            self.client = await new_client()
        out: list[list[float]] = []
        for seq, p in zip(sequences, prompt_lens, strict=True):
            n = len(seq) - p
            if n <= 0:
                out.append([])
                continue
            lps = await self._prompt_logprobs([int(t) for t in seq], n)
            if len(lps) != n or any(v is None for v in lps):
                raise TinkerRequestFailed(f"compute_logprobs returned {lps!r} for the last {n} tokens")
            out.append([float(v) for v in lps])
        return out

    async def _prompt_logprobs(self, tokens: list[int], n: int) -> list[Any]:
        """The last `n` prompt logprobs of `tokens` (module invariants)."""
        client = self.client
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
