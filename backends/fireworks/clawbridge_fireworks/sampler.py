"""A token-level Sampler over a Fireworks deployment's completions API.

Invariants:
- Token exact: the prompt is sent as token ids; completion ids come from the server
  (`raw_output.completion_token_ids`, else `token_ids` of `return_token_ids`) with per-token
  logprobs from `logprobs.content[]` (`sampling_logprob` when the server gives it, which is the
  distribution actually sampled from, else `logprob`). Nothing is re-tokenized.
- Version labels are exact: a request is only *sent* while the gate is open, and the gate is
  closed by the backend before a hot load starts and reopened, with the new version, only after
  the deployment reports the new snapshot loaded. With the deployment's SYNC transition, requests
  already sent finish on the old weights, so "version at send time of the attempt that
  succeeded" is the version that produced the tokens.
- Errors: 425 (hot load in progress) and 429 are retried with backoff inside
  `retry_budget_s`; a 429 that outlasts it raises `SamplerOverloaded`, everything else that
  outlasts it `SamplerUnavailable`. 5xx, connection errors, bad bodies -> `SamplerUnavailable`;
  timeouts -> `SamplerTimeout`; a prompt that cannot fit -> `PromptTooLong`.
- The completion is fetched whole (non-streamed) and then yielded token by token; streaming to
  the agent is chunked from the finished sample.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from clawbridge.serving.sampler import (
    FinishedStream,
    PromptTooLong,
    SampledToken,
    SamplerOverloaded,
    SamplerTimeout,
    SamplerUnavailable,
    SampleStream,
    SamplingParams,
    check_prompt_fits,
    finish_sample,
)

COMPLETIONS_PATH = "/inference/v1/completions"
_BACKOFF_START_S = 0.25
_BACKOFF_MAX_S = 4.0


@dataclass
class SamplerStats:
    """Counters for status output and tests."""

    requests: int = 0
    retries_425: int = 0
    retries_429: int = 0
    gate_waits: int = 0
    last_payload: dict[str, Any] = field(default_factory=dict)


class FireworksSampler:
    """Sampler over `POST {inference_url}/inference/v1/completions` (see module invariants)."""

    def __init__(
        self,
        *,
        inference_url: str,
        model: str,
        api_key: str,
        context_window: int,
        timeout_s: float,
        retry_budget_s: float,
        version: int = 0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._url = inference_url.rstrip("/") + COMPLETIONS_PATH
        self._model = model
        self._api_key = api_key
        self._context_window = context_window
        self._timeout_s = timeout_s
        self._retry_budget_s = retry_budget_s
        self._version = version
        self._gate_open = True
        self._gate_changed: asyncio.Condition | None = None
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self.stats = SamplerStats()

    # -- version gate (driven by the backend's publish) ---------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    def _cond(self) -> asyncio.Condition:
        if self._gate_changed is None:
            self._gate_changed = asyncio.Condition()
        return self._gate_changed

    async def close_gate(self) -> None:
        """Stop sending new requests (a hot load is about to start)."""
        async with self._cond():
            self._gate_open = False

    async def open_gate(self, version: int) -> None:
        """Serve `version` from now on and let waiting requests go."""
        async with self._cond():
            self._version = max(self._version, version)
            self._gate_open = True
            self._cond().notify_all()

    async def _wait_gate(self, deadline: float) -> int:
        async with self._cond():
            if not self._gate_open:
                self.stats.gate_waits += 1
            while not self._gate_open:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SamplerTimeout("timed out waiting for a weight update to finish")
                try:
                    await asyncio.wait_for(self._cond().wait(), timeout=remaining)
                except TimeoutError:
                    raise SamplerTimeout("timed out waiting for a weight update to finish") from None
            return self._version

    # -- sampling ------------------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        if self._client is None or self._client.is_closed:
            self._client = httpx.AsyncClient(
                transport=self._transport, timeout=httpx.Timeout(self._timeout_s)
            )
        return self._client

    def _payload(self, prompt_ids: Sequence[int], params: SamplingParams) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self._model,
            "prompt": [int(t) for t in prompt_ids],
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "n": 1,
            "stream": False,
            "echo": False,
            "logprobs": True,
            "raw_output": True,
            "return_token_ids": True,
        }
        if params.top_logprobs:
            payload["top_logprobs"] = params.top_logprobs
        if params.seed is not None:
            payload["seed"] = params.seed
        return payload

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> SampleStream:
        check_prompt_fits(len(prompt_ids), params.max_tokens, self._context_window)
        payload = self._payload(prompt_ids, params)
        self.stats.last_payload = payload
        start = time.monotonic()
        deadline = start + self._timeout_s
        budget_end = start + self._retry_budget_s
        backoff = _BACKOFF_START_S
        while True:
            version = await self._wait_gate(deadline)
            self.stats.requests += 1
            try:
                resp = await self._http().post(
                    self._url,
                    json=payload,
                    headers={"Authorization": f"Bearer {self._api_key}"},
                    timeout=max(0.001, deadline - time.monotonic()),
                )
            except httpx.TimeoutException as e:
                raise SamplerTimeout(
                    f"Fireworks deployment did not answer in time: {type(e).__name__}"
                ) from e
            except httpx.HTTPError as e:
                raise SamplerUnavailable(f"Fireworks deployment unreachable: {type(e).__name__}: {e}") from e
            status = resp.status_code
            if status == 200:
                return self._parse(resp, version, params)
            now = time.monotonic()
            if status in (425, 429):
                retry_after = _retry_after(resp)
                wait = retry_after if retry_after is not None else backoff
                if now + wait > budget_end or now + wait > deadline:
                    if status == 429:
                        raise SamplerOverloaded("Fireworks deployment is rate limiting", retry_after_s=wait)
                    raise SamplerUnavailable(
                        "Fireworks deployment stayed busy loading new weights (HTTP 425)"
                    )
                if status == 425:
                    self.stats.retries_425 += 1
                else:
                    self.stats.retries_429 += 1
                await asyncio.sleep(wait)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                continue
            detail = _error_detail(resp)
            if status == 400 and "context" in detail.lower() and "length" in detail.lower():
                raise PromptTooLong(detail)
            if status in (408, 504):
                raise SamplerTimeout(f"Fireworks deployment timed out (HTTP {status}): {detail}")
            raise SamplerUnavailable(f"Fireworks deployment failed (HTTP {status}): {detail}")

    def _parse(self, resp: httpx.Response, version: int, params: SamplingParams) -> FinishedStream:
        try:
            choice = resp.json()["choices"][0]
            raw = choice.get("raw_output") or {}
            ids = raw.get("completion_token_ids")
            if ids is None:
                ids = choice.get("token_ids")
            content = (choice.get("logprobs") or {}).get("content")
            if ids is None or not isinstance(content, list):
                raise ValueError(f"response has no token ids or logprobs (keys: {sorted(choice)})")
            if len(content) != len(ids):
                raise ValueError(f"{len(ids)} token ids but {len(content)} logprobs")
            tokens: list[SampledToken] = []
            for tid, entry in zip(ids, content, strict=True):
                lp = entry.get("sampling_logprob")
                if lp is None:
                    lp = entry["logprob"]
                top: tuple[tuple[int, float], ...] = ()
                if params.top_logprobs:
                    top = tuple(
                        (int(t["token_id"]), float(t["logprob"]))
                        for t in (entry.get("top_logprobs") or [])[: params.top_logprobs]
                    )
                tokens.append(SampledToken(int(tid), float(lp), top))
            server_reason = choice.get("finish_reason")
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise SamplerUnavailable(f"Fireworks deployment sent an unusable completion: {e}") from e
        tokens, reason = finish_sample(tokens, server_reason == "stop", params)
        return FinishedStream(tokens=tokens, policy_version=version, final_reason=reason)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _retry_after(resp: httpx.Response) -> float | None:
    raw = resp.headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(0.0, min(float(raw), 30.0))
    except ValueError:
        return None


def _error_detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))[:300]
        if err:
            return str(err)[:300]
        return str(body)[:300]
    return str(body)[:300]
