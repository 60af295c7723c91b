"""POST /v1/chat/completions: render, sample, answer (streamed or not), record.

Invariants:
- Token exact: the prompt ids recorded are the ids given to the sampler; the completion ids and
  logprobs recorded are those the sampler yielded, stop token included. Text sent to the client is
  decoded from those ids; nothing is re-tokenized.
- A turn is committed to the store before the last byte of its response is sent: for a stream,
  before the chunk carrying `finish_reason`; otherwise before the JSON body.
- A call whose client goes away is cancelled at the sampler and recorded with status `cancelled`
  (never trained on), so nothing is silently dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from clawbridge.parse import IncrementalDecoder, StreamParser, parse_completion
from clawbridge.proxy.errors import ApiError, error_body
from clawbridge.proxy.request import ChatRequest
from clawbridge.proxy.sessions import CallSession
from clawbridge.proxy.state import ProxyState
from clawbridge.proxy.stops import StopMatcher
from clawbridge.render import RenderError
from clawbridge.sampler import (
    PromptTooLong,
    SampledToken,
    SamplerError,
    SamplerOverloaded,
    SamplerTimeout,
    SamplerUnavailable,
    SampleStream,
    SamplingParams,
)
from clawbridge.store import TurnRecord

log = logging.getLogger("clawbridge.proxy")


def sampler_error(exc: SamplerError) -> ApiError:
    """Map a sampler failure to the status the client sees."""
    if isinstance(exc, SamplerOverloaded):
        retry = max(1, round(exc.retry_after_s))
        return ApiError(429, f"model is busy: {exc}; retry after {retry}s", code="overloaded",
                        headers={"Retry-After": str(retry)})
    if isinstance(exc, PromptTooLong):
        return ApiError(400, str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, SamplerTimeout):
        return ApiError(504, f"model timed out: {exc}", code="model_timeout")
    if isinstance(exc, SamplerUnavailable):
        return ApiError(502, f"model unreachable: {exc}", code="model_unreachable")
    return ApiError(502, f"model failed: {exc}", code="model_error")


@dataclass
class Generation:
    """What has been sampled so far for one call, and the text made from it."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tokens: list[SampledToken] = field(default_factory=list)
    text: str = ""
    first_token_at: float | None = None
    finish_reason: str | None = None


class ChatCall:
    """One chat completion call, from validated request to recorded turn."""

    def __init__(self, state: ProxyState, req: ChatRequest, data: dict[str, Any], raw: bytes,
                 call: CallSession) -> None:
        self.state = state
        self.req = req
        self.data = data
        self.raw = raw
        self.call = call
        self.created = time.time()
        self.completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.gen = Generation()
        self.prompt_ids: list[int] = []
        self.policy_version = 0
        self.stream: SampleStream | None = None
        self._decoder = IncrementalDecoder(state.renderer.decode)
        self._stops = StopMatcher(req.stop_strings)
        self._stop_ids = set(state.renderer.stop_token_ids)

    # ------------------------------------------------------------------ set-up
    def params(self) -> SamplingParams:
        info = self.state.model_info
        req = self.req
        asked = req.max_completion_tokens or req.max_tokens or info.max_output_tokens
        room = info.context_window - len(self.prompt_ids)
        if room < 1:
            raise ApiError(400, f"prompt is {len(self.prompt_ids)} tokens; the model's context is "
                           f"{info.context_window}", code="context_length_exceeded", param="messages")
        return SamplingParams(
            max_tokens=min(asked, room),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            seed=req.seed,
            stop_token_ids=tuple(self.state.renderer.stop_token_ids),
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        )

    async def start(self) -> None:
        try:
            self.prompt_ids = self.state.renderer.render(
                self.data["messages"], self.data.get("tools"), self.data.get("tool_choice")
            )
        except RenderError as exc:
            raise ApiError(400, f"cannot render messages: {exc}", code="invalid_messages") from None
        params = self.params()
        try:
            self.stream = await self.state.sampler.sample(self.prompt_ids, params)
        except SamplerError as exc:
            raise sampler_error(exc) from None
        self.policy_version = self.stream.policy_version

    # ------------------------------------------------------------------ sampling
    async def pieces(self) -> AsyncIterator[tuple[str, list[SampledToken]]]:
        """Decoded text as it becomes certain, with the tokens it came from."""
        assert self.stream is not None
        gen = self.gen
        pending: list[SampledToken] = []
        async for tok in self.stream:
            if gen.first_token_at is None:
                gen.first_token_at = time.time()
            gen.ids.append(tok.token_id)
            gen.logprobs.append(tok.logprob)
            gen.tokens.append(tok)
            pending.append(tok)
            if tok.token_id in self._stop_ids:
                continue
            text, hit = self._stops.push(self._decoder.push(tok.token_id))
            if text:
                gen.text += text
                yield text, pending
                pending = []
            if hit:
                gen.finish_reason = "stop"
                await self.stream.aclose()
                return
        tail, _ = self._stops.push(self._decoder.flush())
        tail += self._stops.flush()
        gen.text += tail
        if tail or pending:
            yield tail, pending
        gen.finish_reason = self.stream.finish_reason or "stop"

    # ------------------------------------------------------------------ output shapes
    def logprobs_entries(self, tokens: list[SampledToken]) -> list[dict[str, Any]]:
        dec = self.state.renderer.decode
        out = []
        for t in tokens:
            s = dec([t.token_id])
            out.append({
                "token": s, "logprob": t.logprob, "bytes": list(s.encode()),
                "top_logprobs": [
                    {"token": (a := dec([i])), "logprob": lp, "bytes": list(a.encode())} for i, lp in t.top_logprobs
                ],
            })
        return out

    def usage(self) -> dict[str, int]:
        p, c = len(self.prompt_ids), len(self.gen.ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def openai_finish_reason(self, has_tool_calls: bool) -> str:
        if self.gen.finish_reason == "length":
            return "length"
        return "tool_calls" if has_tool_calls else "stop"

    def completion_body(self, message: dict[str, Any], finish: str) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if self.req.logprobs:
            choice["logprobs"] = {"content": self.logprobs_entries(self.gen.tokens)}
        return {
            "id": self.completion_id, "object": "chat.completion", "created": int(self.created),
            "model": self.req.model, "choices": [choice], "usage": self.usage(),
            "system_fingerprint": f"policy-v{self.policy_version}",
        }

    # ------------------------------------------------------------------ recording
    def turn(self, status: str, response: dict[str, Any] | None) -> TurnRecord:
        meta = dict(self.call.meta)
        meta["stream"] = self.req.stream
        return TurnRecord(
            session_id=self.call.session_id, turn_type=self.call.turn_type, status=status,
            model=self.state.model_info.name, prompt_token_ids=self.prompt_ids,
            completion_token_ids=self.gen.ids, completion_logprobs=self.gen.logprobs,
            policy_version=self.policy_version,
            finish_reason=self.gen.finish_reason if status == "ok" else status,
            request_json=self.raw.decode("utf-8", errors="replace"),
            response_json=json.dumps(response) if response is not None else None,
            created_at=self.created, completed_at=time.time(), first_token_at=self.gen.first_token_at,
            meta=meta, turn_id=self.completion_id.replace("chatcmpl-", "turn_"),
        )

    async def record(self, status: str, response: dict[str, Any] | None) -> None:
        end = self.call.end_after if status == "ok" else ("single_call" if self.call.source == "implicit" else None)
        await self.state.writer.record_turn(self.turn(status, response), self.call.source, end)

    def record_cancelled_soon(self) -> None:
        """Record a call the client abandoned without awaiting (we may be inside a cancelled scope)."""
        if self.stream is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().create_task(self.stream.aclose())
        self.gen.finish_reason = "cancelled"
        self.state.writer.record_turn_nowait(self.turn("cancelled", None), self.call.source,
                                             "single_call" if self.call.source == "implicit" else None)

    # ------------------------------------------------------------------ non-streaming
    def response_body(self) -> dict[str, Any]:
        """The response for the whole sampled text (also what is recorded); API shapes override it."""
        parsed = parse_completion(self.gen.text)
        return self.completion_body(parsed.to_openai(), self.openai_finish_reason(bool(parsed.tool_calls)))

    async def complete(self, request: Request) -> Response:
        """Sample to the end, record the turn, then answer `response_body()` as JSON."""
        abandoned = await self.sample_all(request)
        if abandoned is not None:
            return abandoned
        body = self.response_body()
        await self.record("ok", body)
        return Response(orjson.dumps(body), media_type="application/json")

    async def sample_all(self, request: Request) -> Response | None:
        """Sample to the end; a 499 response if the client left (the call is recorded cancelled).

        Sampler failures and the request timeout raise `ApiError` (also recorded cancelled).
        """

        async def run() -> None:
            async for _ in self.pieces():
                pass

        task = asyncio.ensure_future(run())
        deadline = time.monotonic() + self.state.settings.request_timeout_s
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    break
                if await request.is_disconnected():
                    task.cancel()
                    self.record_cancelled_soon()
                    return Response(status_code=499)
                if time.monotonic() > deadline:
                    task.cancel()
                    self.record_cancelled_soon()
                    raise ApiError(504, "model did not finish within request_timeout_s", code="model_timeout")
            exc = task.exception()
            if exc is not None:
                self.record_cancelled_soon()
                if isinstance(exc, SamplerError):
                    raise sampler_error(exc)
                raise exc
        except asyncio.CancelledError:
            task.cancel()
            self.record_cancelled_soon()
            raise
        return None

    # ------------------------------------------------------------------ streaming
    def chunk(self, delta: dict[str, Any], finish: str | None = None,
              tokens: list[SampledToken] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if self.req.logprobs and tokens:
            choice["logprobs"] = {"content": self.logprobs_entries(tokens)}
        obj: dict[str, Any] = {
            "id": self.completion_id, "object": "chat.completion.chunk", "created": int(self.created),
            "model": self.req.model, "choices": [choice], "system_fingerprint": f"policy-v{self.policy_version}",
        }
        if self.req.include_usage:
            obj["usage"] = None
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    async def sse(self) -> AsyncIterator[bytes]:
        parser = StreamParser()
        content: list[str] = []
        reasoning: list[str] = []
        tool_calls: list[dict[str, Any]] = []
        finished = False

        def deltas(items: list[Any]) -> list[dict[str, Any]]:
            out = []
            for d in items:
                if d.kind == "content":
                    content.append(d.text)
                    out.append({"content": d.text})
                elif d.kind == "reasoning":
                    reasoning.append(d.text)
                    out.append({"reasoning_content": d.text})
                elif d.kind == "tool_call" and d.tool_call is not None:
                    tc = {"index": d.index, "id": d.tool_call.id, "type": "function",
                          "function": {"name": d.tool_call.name, "arguments": d.tool_call.arguments}}
                    tool_calls.append({k: v for k, v in tc.items() if k != "index"})
                    out.append({"tool_calls": [tc]})
            return out

        deadline = time.monotonic() + self.state.settings.request_timeout_s
        try:
            yield self.chunk({"role": "assistant", "content": ""})
            async for text, toks in self.pieces():
                ds = deltas(parser.feed(text)) if text else []
                if not ds:
                    if toks and self.req.logprobs:
                        yield self.chunk({}, tokens=toks)
                    continue
                for i, d in enumerate(ds):
                    yield self.chunk(d, tokens=toks if i == 0 else None)
                if time.monotonic() > deadline:
                    raise SamplerTimeout("request_timeout_s exceeded while streaming")
            for d in deltas(parser.finish()):
                yield self.chunk(d)
            finish = self.openai_finish_reason(bool(tool_calls))
            message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
            if tool_calls:
                message["tool_calls"] = tool_calls
            await self.record("ok", self.completion_body(message, finish))
            finished = True
            yield self.chunk({}, finish)
            if self.req.include_usage:
                usage = {"id": self.completion_id, "object": "chat.completion.chunk", "created": int(self.created),
                         "model": self.req.model, "choices": [], "usage": self.usage()}
                yield b"data: " + orjson.dumps(usage) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except SamplerError as exc:
            err = sampler_error(exc)
            log.warning("stream %s failed: %s", self.completion_id, exc)
            self.record_cancelled_soon()
            finished = True
            yield b"data: " + orjson.dumps(error_body(err.status, err.message, code=err.code)) + b"\n\n"
        finally:
            if not finished:
                self.record_cancelled_soon()

    def streaming_response(self) -> StreamingResponse:
        return StreamingResponse(
            self.sse(), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Policy-Version": str(self.policy_version)},
        )


async def chat_completions(state: ProxyState, request: Request, req: ChatRequest, data: dict[str, Any],
                           raw: bytes, call: CallSession) -> Response:
    """Serve one validated chat completion call."""
    info = state.model_info
    if req.model not in (info.name, "default"):
        raise ApiError(404, f"model {req.model!r} is not served here; use {info.name!r} or 'default'",
                       code="model_not_found", param="model")
    chat = ChatCall(state, req, data, raw, call)
    await chat.start()
    if req.stream:
        return chat.streaming_response()
    return await chat.complete(request)


__all__ = ["JSONResponse", "chat_completions", "sampler_error"]
