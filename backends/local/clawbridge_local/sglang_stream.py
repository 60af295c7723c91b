"""`SGLangSampleStream`: one streamed `/generate` request of `SGLangEngine`.

Invariants:
- Token ids are those of `meta_info.output_token_logprobs` ([logprob, id, text] per sampled token,
  cumulative in sglang 0.5.x; incremental accepted: `meta_info.completion_tokens` tells which);
  `output_ids`, whose streaming semantics changed within 0.5.x, is cross-checked when unambiguous.
- The `release` callback (the owner's refcount of the stream's version) is called exactly once: when SGLang finished the
  request (end of the SSE body) or when the stream is closed or cancelled, whichever comes first.
- A finish of type `abort` or an `{"error": ...}` event is raised as the matching `SamplerError`
  (`clawbridge_local.sglang_errors`);
  closing the HTTP response is how a request is cancelled (SGLang aborts on disconnect).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson

from clawbridge.serving.sampler import (
    FinishReason,
    SampledToken,
    SamplerError,
    SamplerUnavailable,
    SamplingParams,
)
from clawbridge_local.sglang_errors import error_message, request_error, transport_error


class _End:
    """Last item of a stream's token queue."""


class SGLangSampleStream:
    """The `SampleStream` of one `/generate` request. Iterate it once.

    `SGLangEngine.sample` reads up to the first tokens (`_prime`); a pump task then reads the rest
    of the SSE body into a queue, so `aclose()` from any task stops the read at once.
    """

    def __init__(
        self, response: httpx.Response, version: int, params: SamplingParams, *,
        release: Callable[[], None], retry_after_s: float,
    ) -> None:
        """`release`: called once when the stream no longer needs `version`'s weights;
        `retry_after_s`: the Retry-After of an overload error raised mid-stream."""
        self._release = release
        self._retry_after_s = retry_after_s
        self._response = response
        self._events = response.aiter_lines()
        self._params = params
        self._queue: asyncio.Queue[SampledToken | _End | SamplerError] = asyncio.Queue()
        self._pump_task: asyncio.Task[None] | None = None
        self._seen = 0
        self._released = False
        self._ended = False
        self._end_reason: FinishReason = "stop"
        self.policy_version: int = version
        """The version that samples this stream (fixed at creation)."""
        self.finish_reason: FinishReason | None = None
        """'stop', 'length' or 'cancelled' once the stream has ended."""

    # ---- reading -------------------------------------------------------------------------
    async def _next_event(self) -> dict[str, Any] | None:
        """The next JSON event, or None at `[DONE]` / end of body."""
        try:
            async for line in self._events:
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return None
                event = orjson.loads(data)
                if not isinstance(event, dict):
                    raise SamplerUnavailable(f"sglang sent a non-object event: {data[:200]}")
                return event
        except httpx.HTTPError as exc:
            raise transport_error(exc, "while streaming") from None
        except orjson.JSONDecodeError as exc:
            raise SamplerUnavailable(f"sglang sent invalid JSON: {exc}") from None
        return None

    def _take(self, event: dict[str, Any]) -> list[SampledToken]:
        """The new tokens of `event`; sets `_ended` at its end; raises what the event reports."""
        if "error" in event:
            err = event["error"]
            code = int(err.get("code", 400)) if isinstance(err, dict) else 400
            raise request_error(code, error_message(event), self._retry_after_s)
        meta = event.get("meta_info")
        if not isinstance(meta, dict):
            raise SamplerUnavailable("sglang event without meta_info")
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "abort":
            status = int(finish.get("status_code") or 500)
            raise request_error(status, str(finish.get("message", "aborted")), self._retry_after_s)
        total = int(meta.get("completion_tokens", self._seen))
        entries = meta.get("output_token_logprobs") or []
        if len(entries) == total:  # cumulative (sglang 0.5.x)
            new = entries[self._seen :]
        elif len(entries) == total - self._seen:  # incremental
            new = entries
        else:
            raise SamplerUnavailable(
                f"sglang sent {len(entries)} logprobs for {total} tokens ({self._seen} seen): is return_logprob on?"
            )
        tops = self._new_tops(meta, total, len(new))
        ids = [int(e[1]) for e in new]
        out_ids = event.get("output_ids")
        if isinstance(out_ids, list) and new and len(out_ids) in (len(new), total):
            tail = [int(t) for t in out_ids[-len(new) :]]
            if tail != ids:
                raise SamplerUnavailable(f"sglang output_ids {tail} disagree with logprob ids {ids}")
        self._seen = total
        if finish is not None:
            self._ended = True
            self._end_reason = "length" if finish.get("type") == "length" else "stop"
        return [
            SampledToken(t, float(e[0]), tops[i] if tops else ())
            for i, (e, t) in enumerate(zip(new, ids, strict=True))
        ]

    def _new_tops(self, meta: dict[str, Any], total: int, n_new: int) -> list[tuple[tuple[int, float], ...]]:
        if self._params.top_logprobs <= 0:
            return []
        tops = meta.get("output_top_logprobs") or []
        new = tops[self._seen :] if len(tops) == total else tops
        if len(new) != n_new:
            raise SamplerUnavailable(f"sglang sent {len(new)} top-logprob rows for {n_new} tokens")
        return [tuple((int(alt[1]), float(alt[0])) for alt in row or ()) for row in new]

    async def _prime(self) -> None:
        """Read up to the first tokens (or the end), raising what went wrong; then start the pump."""
        while True:
            event = await self._next_event()
            if event is None:
                raise SamplerUnavailable("sglang ended the stream before any token")
            tokens = self._take(event)
            for tok in tokens:
                self._queue.put_nowait(tok)
            if tokens or self._ended:
                break
        self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        try:
            while not self._ended:
                event = await self._next_event()
                if event is None:
                    raise SamplerUnavailable("sglang ended the stream without a finish reason")
                for tok in self._take(event):
                    self._queue.put_nowait(tok)
            self._queue.put_nowait(_End())
        except SamplerError as exc:
            self._queue.put_nowait(exc)
        finally:
            await self._close_http()

    # ---- SampleStream ----------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[SampledToken]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[SampledToken]:
        try:
            while self.finish_reason is None:
                item = await self._queue.get()
                if isinstance(item, SamplerError):
                    raise item
                if isinstance(item, _End):
                    self.finish_reason = self.finish_reason or self._end_reason
                    return
                yield item
        finally:
            if self.finish_reason is None:  # consumer cancelled, left early, or an error
                self.finish_reason = "cancelled"
            if self.finish_reason == "cancelled":
                await self._stop()

    async def aclose(self) -> None:
        """Stop sampling now: close the HTTP stream (SGLang aborts the request). Idempotent."""
        if self.finish_reason is None:
            self.finish_reason = "cancelled"
            self._queue.put_nowait(_End())  # wakes a consumer waiting in another task
        await self._stop()

    async def _stop(self) -> None:
        if self._pump_task is not None and not self._pump_task.done():
            self._pump_task.cancel()
        await self._close_http()

    async def _close_http(self) -> None:
        if not self._released:
            self._released = True
            self._release()
        try:
            await self._response.aclose()
        except Exception:  # already closed
            pass
