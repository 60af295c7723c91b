"""POST /v1/messages (Anthropic Messages API): a shape over the shared `SampledCall` path.

Invariants:
- Everything `call` promises holds here, because the sampling and recording are `SampledCall`'s:
  token exact, the turn committed before the last byte (for a stream, before the `message_delta`
  carrying `stop_reason`), an abandoned call recorded `cancelled`. The recorded request is the
  raw body the client sent; the recorded response is the Anthropic message object.
- Streamed and non-streamed answers are built by the same `Blocks` from the same `StreamParser`
  deltas, so a stream's accumulated message equals the non-streamed one (ids aside).
- Every error on these routes, including auth, body size and JSON errors raised before the
  handler, is answered Anthropic-shaped (`{"type": "error", "error": {"type", "message"}}`)
  with the status and headers (Retry-After) of the underlying `ApiError`; mid-stream as an
  `event: error`. Never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from clawbridge.access import Principal
from clawbridge.chat.parse import Delta
from clawbridge.proxy.call import SampledCall, render_request
from clawbridge.proxy.errors import ApiError, refused_as_400, validated
from clawbridge.proxy.model_routes import Prepared, check_model
from clawbridge.proxy.ownership import caller
from clawbridge.proxy.request import ChatRequest, parse_json_object, read_body
from clawbridge.proxy.state import ProxyState
from clawbridge.serving.sampler import SampledToken
from clawbridge.shapes.anthropic import MessagesRequest, openai_data, validate_messages_request

log = logging.getLogger("clawbridge.proxy")

ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
    422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 502: "api_error",
    503: "api_error", 504: "timeout_error", 529: "overloaded_error",
}


def anthropic_error_body(err: ApiError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`; a busy model is an `overloaded_error`."""
    kind = "overloaded_error" if err.code == "overloaded" else ERROR_TYPES.get(err.status, "api_error")
    message = err.message
    if err.code == "missing_api_key":
        message = "missing API key: send 'x-api-key: <key>' or 'Authorization: Bearer <key>'"
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error(err: ApiError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(err), status_code=err.status, headers=err.headers)


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's JSON-string arguments as the object Anthropic's `input` must be."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


class Blocks:
    """Anthropic content blocks built from parser deltas, with the stream events that build them."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self._open = False

    def _close(self, events: list[dict[str, Any]]) -> None:
        if self._open:
            events.append({"type": "content_block_stop", "index": len(self.content) - 1})
            self._open = False

    def _start(self, block: dict[str, Any], events: list[dict[str, Any]]) -> int:
        self._close(events)
        self.content.append(block)
        self._open = True
        events.append({"type": "content_block_start", "index": len(self.content) - 1,
                       "content_block": dict(block)})
        return len(self.content) - 1

    def add(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        """Fold `deltas` into the blocks; the events that say so, in order."""
        events: list[dict[str, Any]] = []
        for d in deltas:
            if d.kind in ("reasoning", "content"):
                kind, field = ("thinking", "thinking") if d.kind == "reasoning" else ("text", "text")
                last = self.content[-1] if self.content else None
                if not (self._open and last is not None and last["type"] == kind):
                    block = {"type": kind, field: ""} | ({"signature": ""} if kind == "thinking" else {})
                    self._start(block, events)
                self.content[-1][field] += d.text
                events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                               "delta": {"type": f"{kind}_delta", field: d.text}})
            elif d.kind == "tool_call" and d.tool_call is not None:
                call = d.tool_call
                args = tool_input(call.arguments)
                index = self._start({"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
                                     "name": call.name, "input": {}}, events)
                self.content[index]["input"] = args
                events.append({"type": "content_block_delta", "index": index,
                               "delta": {"type": "input_json_delta",
                                         "partial_json": json.dumps(args, ensure_ascii=False)}})
                self._close(events)
        return events

    def finish(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        self._close(events)
        return events

    @property
    def has_tool_use(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.content)


def sse_event(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class MessagesShape:
    """A `SampledCall` answered as an Anthropic message (or its event stream)."""

    def __init__(self, call: SampledCall) -> None:
        self.call = call
        self.message_id = "msg_" + call.hex
        self._blocks = Blocks()

    def stop(self, has_tool_use: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) for what was sampled."""
        if self.call.gen.finish_reason == "length":
            return "max_tokens", None
        matched = self.call.matched_stop()
        if matched is not None:
            return "stop_sequence", matched
        return ("tool_use" if has_tool_use else "end_turn"), None

    def usage_body(self) -> dict[str, int]:
        return {"input_tokens": len(self.call.prompt_ids), "output_tokens": len(self.call.gen.ids)}

    def message(self, content: list[dict[str, Any]], stop_reason: str | None,
                stop_sequence: str | None) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.call.req.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self.usage_body()}

    def body(self) -> dict[str, Any]:
        parser, blocks = self.call.parser(), Blocks()
        blocks.add(parser.feed(self.call.gen.text))
        blocks.add(parser.finish())
        blocks.finish()
        return self.message(blocks.content, *self.stop(blocks.has_tool_use))

    # ------------------------------------------------------------------ stream
    def opening(self) -> list[bytes]:
        start = self.message([], None, None)
        start["usage"] = {"input_tokens": len(self.call.prompt_ids), "output_tokens": 0}
        return [sse_event({"type": "message_start", "message": start}), sse_event({"type": "ping"})]

    def piece(self, text: str, tokens: list[SampledToken]) -> list[bytes]:
        return [sse_event(e) for e in self._blocks.add(self.call.stream_parser.feed(text))] if text else []

    def flush(self) -> list[bytes]:
        return [sse_event(e) for e in self._blocks.add(self.call.stream_parser.finish()) + self._blocks.finish()]

    def recorded(self) -> dict[str, Any]:
        return self.message(self._blocks.content, *self.stop(self._blocks.has_tool_use))

    def closing(self) -> list[bytes]:
        stop_reason, stop_sequence = self.stop(self._blocks.has_tool_use)
        return [sse_event({"type": "message_delta",
                           "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                           "usage": {"output_tokens": len(self.call.gen.ids)}}),
                sse_event({"type": "message_stop"})]

    def stream_error(self, err: ApiError) -> bytes:
        return sse_event(anthropic_error_body(err))


class MessagesApi:
    """The Anthropic Messages API as a `model_routes.ApiAdapter`."""

    name = "anthropic"
    prepare_reads_store = False

    def prepare(self, state: ProxyState, body: dict[str, Any], by: Principal) -> Prepared:
        with refused_as_400():
            data = openai_data(validate_messages_request(body))
        return Prepared(validated(ChatRequest, data, code="invalid_field"), data, MessagesShape)

    def error_response(self, err: ApiError) -> Response:
        return anthropic_error(err)


def build_anthropic_router(state: ProxyState) -> APIRouter:
    """`/v1/messages/count_tokens` and its `/s/{session_id}/...` form (messages are in `model_routes`)."""
    router = APIRouter()
    api = MessagesApi()

    async def count(request: Request) -> Response:
        await caller(state, request, "models", "read")
        raw = await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
        body = parse_json_object(raw, state.settings.max_messages)
        body.setdefault("model", state.model_info.name)
        with refused_as_400():
            req: MessagesRequest = validate_messages_request(body, need_max_tokens=False)
        check_model(state, req.model)
        with refused_as_400():
            data = openai_data(req)
        prompt = await asyncio.to_thread(render_request, state, data["messages"], data.get("tools"),
                                         data.get("tool_choice"))
        return JSONResponse({"input_tokens": len(prompt.ids)})

    async def guarded(work: Awaitable[Response]) -> Response:
        """Answer every failure of `work` Anthropic-shaped, keeping its status and headers."""
        try:
            return await work
        except ApiError as exc:
            return api.error_response(exc)
        except Exception:
            log.exception("unexpected error while handling /v1/messages/count_tokens")
            return api.error_response(ApiError(500, "internal error; see the clawbridge log"))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await guarded(count(request))

    @router.post("/s/{session_id}/v1/messages/count_tokens")
    async def count_tokens_in_session(request: Request, session_id: str) -> Response:
        return await guarded(count(request))

    return router
