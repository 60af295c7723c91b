"""POST /v1/responses (OpenAI Responses API): a shape over the shared `SampledCall` path.

Invariants:
- Everything `call` promises holds here (token exact, the turn committed before the last byte:
  for a stream before `response.completed` / `response.incomplete`, an abandoned call recorded
  `cancelled`). The recorded request is the raw body; the recorded response the response object.
- Streamed and non-streamed answers are built by the same `Items` from the same `StreamParser`
  deltas, so a stream's final response equals the non-streamed one (ids aside). Output items are,
  in the order sampled: `reasoning` (the thinking, as a summary part), `message` (`output_text`),
  `function_call` (one per tool call; `call_id` is the tool call's id).
- Ids: the response is `resp_<hex>` and its first message item `msg_<hex>`, with the turn's hex
  part, so both work as `interaction_id` in `/rl/set_reward`.
- `previous_response_id` continues the conversation of a recorded, stored responses turn (its
  input and output items; not its instructions); any other id is a 400 naming why.
  `store: false` is honoured as "kept only as training data": the turn is recorded, but it can be
  neither retrieved (`GET /v1/responses/{id}` answers 404) nor continued. Who may retrieve or
  continue a response is `clawbridge.access`'s (`turns` x `read`): another user's is answered as
  one never recorded, a session key may only reach its own session's (403).
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from clawbridge.access import Action, Denied, Hidden, Principal, Target, check
from clawbridge.chat.parse import Delta
from clawbridge.proxy.call import SampledCall, turn_id_for
from clawbridge.proxy.errors import ApiError, denied, refused_as_400
from clawbridge.proxy.model_routes import Prepared, openai_error
from clawbridge.proxy.ownership import caller
from clawbridge.proxy.request import validate_chat_request
from clawbridge.proxy.state import ProxyState
from clawbridge.serving.sampler import SampledToken
from clawbridge.shapes.errors import invalid
from clawbridge.shapes.responses import (
    ResponsesRequest,
    chat_data,
    input_messages,
    output_messages,
    validate_responses_request,
)
from clawbridge.store.users import UserStore

MAX_CHAIN = 256
"""The longest previous_response_id chain followed."""


class Items:
    """Responses output items built from parser deltas, with the stream events that build them."""

    def __init__(self, hex_id: str) -> None:
        self.hex = hex_id
        self.output: list[dict[str, Any]] = []
        self._open = False

    def _item_id(self, prefix: str) -> str:
        n = sum(1 for item in self.output if str(item.get("id", "")).startswith(prefix))
        return f"{prefix}{self.hex}" if n == 0 else f"{prefix}{self.hex}_{n}"

    def _close(self, events: list[dict[str, Any]]) -> None:
        if not self._open:
            return
        self._open = False
        index = len(self.output) - 1
        item = self.output[index]
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            part = item["summary"][0]
            events += [{"type": "response.reasoning_summary_text.done", **ids, "summary_index": 0, "text": part["text"]},
                       {"type": "response.reasoning_summary_part.done", **ids, "summary_index": 0, "part": dict(part)}]
        elif item["type"] == "message":
            part = item["content"][0]
            item["status"] = "completed"
            events += [{"type": "response.output_text.done", **ids, "content_index": 0, "text": part["text"],
                        "logprobs": []},
                       {"type": "response.content_part.done", **ids, "content_index": 0, "part": dict(part)}]
        events.append({"type": "response.output_item.done", "output_index": index, "item": json.loads(json.dumps(item))})

    def _start(self, item: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, str | int]:
        self._close(events)
        added = json.loads(json.dumps(item))
        self.output.append(item)
        self._open = True
        index = len(self.output) - 1
        ids: dict[str, str | int] = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            added["summary"] = []
            events += [{"type": "response.output_item.added", "output_index": index, "item": added},
                       {"type": "response.reasoning_summary_part.added", **ids, "summary_index": 0,
                        "part": {"type": "summary_text", "text": ""}}]
        elif item["type"] == "message":
            added["content"] = []
            events += [{"type": "response.output_item.added", "output_index": index, "item": added},
                       {"type": "response.content_part.added", **ids, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}]
        else:
            added["arguments"] = ""
            events.append({"type": "response.output_item.added", "output_index": index, "item": added})
        return ids

    def add(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        """Fold `deltas` into the items; the events that say so, in order."""
        events: list[dict[str, Any]] = []
        for d in deltas:
            last = self.output[-1] if self.output else None
            if d.kind == "reasoning":
                if not (self._open and last is not None and last["type"] == "reasoning"):
                    self._start({"type": "reasoning", "id": self._item_id("rs_"),
                                 "summary": [{"type": "summary_text", "text": ""}]}, events)
                item = self.output[-1]
                item["summary"][0]["text"] += d.text
                events.append({"type": "response.reasoning_summary_text.delta", "item_id": item["id"],
                               "output_index": len(self.output) - 1, "summary_index": 0, "delta": d.text})
            elif d.kind == "content":
                if not (self._open and last is not None and last["type"] == "message"):
                    self._start({"type": "message", "id": self._item_id("msg_"), "status": "in_progress",
                                 "role": "assistant",
                                 "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]},
                                events)
                item = self.output[-1]
                item["content"][0]["text"] += d.text
                events.append({"type": "response.output_text.delta", "item_id": item["id"],
                               "output_index": len(self.output) - 1, "content_index": 0, "delta": d.text,
                               "logprobs": []})
            elif d.kind == "tool_call" and d.tool_call is not None:
                call = d.tool_call
                item = {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
                        "name": call.name, "arguments": call.arguments, "status": "completed"}
                ids = self._start(item, events)
                events += [{"type": "response.function_call_arguments.delta", **ids, "delta": call.arguments},
                           {"type": "response.function_call_arguments.done", **ids, "name": call.name,
                            "arguments": call.arguments}]
                self._close(events)
        return events

    def finish(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        self._close(events)
        return events


class ResponsesShape:
    """A `SampledCall` answered as a Responses `response` object (or its event stream)."""

    def __init__(self, call: SampledCall, req: ResponsesRequest) -> None:
        self.call = call
        self.req = req
        self.response_id = "resp_" + call.hex
        self._items = Items(call.hex)
        self._seq = 0

    def usage(self) -> dict[str, Any]:
        p, c = len(self.call.prompt_ids), len(self.call.gen.ids)
        return {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0}, "output_tokens": c,
                "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}

    def response(self, output: list[dict[str, Any]], status: str) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.response_id, "object": "response", "created_at": int(self.call.created), "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": self.usage() if status in ("completed", "incomplete") else None,
            "metadata": req.metadata or {}, "user": None,
        }

    def status(self) -> str:
        return "incomplete" if self.call.gen.finish_reason == "length" else "completed"

    def body(self) -> dict[str, Any]:
        parser, items = self.call.parser(), Items(self.call.hex)
        items.add(parser.feed(self.call.gen.text))
        items.add(parser.finish())
        items.finish()
        return self.response(items.output, self.status())

    # ------------------------------------------------------------------ stream
    def _sse(self, events: list[dict[str, Any]]) -> list[bytes]:
        out = []
        for event in events:
            event["sequence_number"] = self._seq
            self._seq += 1
            out.append(b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n")
        return out

    def opening(self) -> list[bytes]:
        return self._sse([{"type": "response.created", "response": self.response([], "in_progress")},
                          {"type": "response.in_progress", "response": self.response([], "in_progress")}])

    def piece(self, text: str, tokens: list[SampledToken]) -> list[bytes]:
        return self._sse(self._items.add(self.call.stream_parser.feed(text))) if text else []

    def flush(self) -> list[bytes]:
        return self._sse(self._items.add(self.call.stream_parser.finish()) + self._items.finish())

    def recorded(self) -> dict[str, Any]:
        return self.response(self._items.output, self.status())

    def closing(self) -> list[bytes]:
        status = self.status()
        return self._sse([{"type": f"response.{status}", "response": self.recorded()}])

    def stream_error(self, err: ApiError) -> bytes:
        return self._sse([{"type": "error", "code": err.code or "api_error", "message": err.message,
                           "param": err.param}])[0]


# ---------------------------------------------------------------------- stored responses
def stored_response(state: ProxyState, response_id: str, param: str, by: Principal, action: Action) -> dict[str, Any]:
    """The recorded turn (plus its `session_id`) of a stored responses call that `by` may `action`
    (`turns` x `read` or `continue`, `clawbridge.access`), or a 4xx saying why it cannot be used.
    Whose it is is checked before anything else is said about it (stored? completed?), and one the
    caller may not see is answered as one never recorded. Reads the store: call it off the loop."""
    turn_id = turn_id_for(response_id)
    session = state.store.turn_session(turn_id) if response_id.startswith("resp_") else None
    if session is not None:
        try:
            check(by, "turns", action, Target(UserStore(state.store).session_owner(session)[1], session))
        except Hidden:
            session = None
        except Denied as d:
            raise denied(d) from None
    turn = None
    if session is not None:
        turn = next((t for t in state.store.session_turns(session) if t["turn_id"] == turn_id), None)
        turn = None if turn is None else {**turn, "session_id": session}
    if turn is None or turn["meta"].get("api") != "responses":
        raise ApiError(404 if param == "response_id" else 400,
                       f"no response {response_id!r} was recorded by this server", param=param,
                       code="response_not_found")
    if turn["meta"].get("store") is False:
        raise ApiError(404 if param == "response_id" else 400,
                       f"response {response_id!r} was created with store: false; it is kept only as "
                       "training data", param=param, code="response_not_stored")
    if turn["status"] != "ok" or turn["response"] is None:
        raise ApiError(400, f"response {response_id!r} did not complete (status {turn['status']})", param=param,
                       code="response_not_completed")
    return dict(turn)


def history(state: ProxyState, previous_response_id: str, by: Principal) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    """The chat messages of a previous_response_id chain that `by` may continue, oldest first,
    without instructions; and the sessions they were recorded in."""
    chain: list[dict[str, Any]] = []
    next_id: str | None = previous_response_id
    while next_id is not None:
        if len(chain) >= MAX_CHAIN:
            raise invalid(f"previous_response_id chain is longer than {MAX_CHAIN} responses", "previous_response_id")
        turn = stored_response(state, next_id, "previous_response_id", by, "continue")
        chain.append(turn)
        prev = turn["request"].get("previous_response_id")
        next_id = prev if isinstance(prev, str) else None
    messages: list[dict[str, Any]] = []
    for turn in reversed(chain):
        request_input = turn["request"].get("input")
        if request_input:
            messages += input_messages(request_input)
        messages += output_messages(turn["response"].get("output") or [])
    return messages, tuple(sorted({str(turn["session_id"]) for turn in chain}))


class ResponsesApi:
    """The Responses API as a `model_routes.ApiAdapter`."""

    name = "responses"
    prepare_reads_store = True

    def prepare(self, state: ProxyState, body: dict[str, Any], by: Principal) -> Prepared:
        with refused_as_400():
            items, limit = body.get("input"), state.settings.max_messages
            if isinstance(items, list) and len(items) > limit:
                raise invalid(f"{len(items)} input items is over the limit of {limit} (max_messages)", "input")
            req = validate_responses_request(body)
            past, reads = (history(state, req.previous_response_id, by) if req.previous_response_id is not None
                           else ([], ()))
            data = chat_data(req, past)
            if not data["messages"]:
                raise invalid("input must have at least one item", "input")
        chat = validate_chat_request(data)
        return Prepared(chat, data, lambda call: ResponsesShape(call, req), meta={"store": req.store},
                        reads=reads)

    def error_response(self, err: ApiError) -> Response:
        return openai_error(err)


def add_responses_retrieval(app: FastAPI, state: ProxyState) -> None:
    """GET /v1/responses/{id} (and without /v1): a stored response as it was answered."""

    async def retrieve(request: Request, response_id: str) -> Response:
        principal = await caller(state, request, "turns", "read")
        turn = await state.read(stored_response, state, response_id, "response_id", principal, "read")
        return JSONResponse(turn["response"])

    app.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    app.add_api_route("/responses/{response_id}", retrieve, methods=["GET"])


__all__ = ["ResponsesApi", "add_responses_retrieval"]
