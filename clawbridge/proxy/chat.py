"""The OpenAI chat completion shape (`/v1/chat/completions`) over the shared `SampledCall` path.

Invariants: token exactness, commit-before-last-byte and cancelled recording are
`clawbridge.proxy.call.SampledCall`'s. Streamed and non-streamed answers come from the same
`StreamParser` deltas, so a stream's accumulated message equals the non-streamed one; the
recorded response is the `chat.completion` object.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response

from clawbridge.access import Principal
from clawbridge.chat.parse import Delta
from clawbridge.proxy.call import SampledCall
from clawbridge.proxy.errors import ApiError, error_body
from clawbridge.proxy.model_routes import Prepared, openai_error
from clawbridge.proxy.request import validate_chat_request
from clawbridge.proxy.state import ProxyState
from clawbridge.serving.sampler import SampledToken


class ChatShape:
    """A `SampledCall` answered as a chat completion (or its `chat.completion.chunk` stream)."""

    def __init__(self, call: SampledCall) -> None:
        self.call = call
        self.completion_id = "chatcmpl-" + call.hex
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._tool_calls: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ pieces of the body
    def logprobs_entries(self, tokens: list[SampledToken]) -> list[dict[str, Any]]:
        dec = self.call.state.renderer.decode
        out: list[dict[str, Any]] = []
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
        p, c = len(self.call.prompt_ids), len(self.call.gen.ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def finish_reason(self, has_tool_calls: bool) -> str:
        if self.call.gen.finish_reason == "length":
            return "length"
        return "tool_calls" if has_tool_calls else "stop"

    def completion_body(self, message: dict[str, Any], finish: str) -> dict[str, Any]:
        call = self.call
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if call.req.logprobs:
            choice["logprobs"] = {"content": self.logprobs_entries(call.gen.tokens)}
        return {
            "id": self.completion_id, "object": "chat.completion", "created": int(call.created),
            "model": call.req.model, "choices": [choice], "usage": self.usage(),
            "system_fingerprint": f"policy-v{call.policy_version}",
        }

    def body(self) -> dict[str, Any]:
        parsed = self.call.parsed()
        return self.completion_body(parsed.to_openai(), self.finish_reason(bool(parsed.tool_calls)))

    # ------------------------------------------------------------------ stream
    def chunk(self, delta: dict[str, Any], finish: str | None = None,
              tokens: list[SampledToken] | None = None) -> bytes:
        call = self.call
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if call.req.logprobs and tokens:
            choice["logprobs"] = {"content": self.logprobs_entries(tokens)}
        obj: dict[str, Any] = {
            "id": self.completion_id, "object": "chat.completion.chunk", "created": int(call.created),
            "model": call.req.model, "choices": [choice], "system_fingerprint": f"policy-v{call.policy_version}",
        }
        if call.req.include_usage:
            obj["usage"] = None
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def _deltas(self, items: list[Delta]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in items:
            if d.kind == "content":
                self._content.append(d.text)
                out.append({"content": d.text})
            elif d.kind == "reasoning":
                self._reasoning.append(d.text)
                out.append({"reasoning_content": d.text})
            elif d.kind == "tool_call" and d.tool_call is not None:
                tc = {"index": d.index, "id": d.tool_call.id, "type": "function",
                      "function": {"name": d.tool_call.name, "arguments": d.tool_call.arguments}}
                self._tool_calls.append({k: v for k, v in tc.items() if k != "index"})
                out.append({"tool_calls": [tc]})
        return out

    def opening(self) -> list[bytes]:
        return [self.chunk({"role": "assistant", "content": ""})]

    def piece(self, text: str, tokens: list[SampledToken]) -> list[bytes]:
        ds = self._deltas(self.call.stream_parser.feed(text)) if text else []
        if not ds:
            return [self.chunk({}, tokens=tokens)] if tokens and self.call.req.logprobs else []
        return [self.chunk(d, tokens=tokens if i == 0 else None) for i, d in enumerate(ds)]

    def flush(self) -> list[bytes]:
        return [self.chunk(d) for d in self._deltas(self.call.stream_parser.finish())]

    def recorded(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._content) or None}
        if self._reasoning:
            message["reasoning_content"] = "".join(self._reasoning)
        if self._tool_calls:
            message["tool_calls"] = self._tool_calls
        return self.completion_body(message, self.finish_reason(bool(self._tool_calls)))

    def closing(self) -> list[bytes]:
        call = self.call
        out = [self.chunk({}, self.finish_reason(bool(self._tool_calls)))]
        if call.req.include_usage:
            usage = {"id": self.completion_id, "object": "chat.completion.chunk", "created": int(call.created),
                     "model": call.req.model, "choices": [], "usage": self.usage()}
            out.append(b"data: " + orjson.dumps(usage) + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        return out

    def stream_error(self, err: ApiError) -> bytes:
        return b"data: " + orjson.dumps(error_body(err.status, err.message, code=err.code)) + b"\n\n"


class ChatApi:
    """OpenAI chat completions as a `model_routes.ApiAdapter`."""

    name = "chat"
    prepare_reads_store = False

    def prepare(self, state: ProxyState, body: dict[str, Any], by: Principal) -> Prepared:
        return Prepared(validate_chat_request(body), body, ChatShape)

    def error_response(self, err: ApiError) -> Response:
        return openai_error(err)
