"""Reading and validating a chat completion request.

Invariants:
- A body larger than `max_body_bytes` is refused with 413 before it is fully read; a body not
  fully received within `timeout_s` is 408.
- Content-Type: a JSON media type (`application/json`, `*/*+json`, any parameters), none at all,
  or `application/x-www-form-urlencoded` (what `curl -d '{...}'` sends without `-H`): all read as
  JSON (a body that is not JSON is then 400 as any malformed body). Anything else (text/plain,
  multipart/form-data, ...) is 415. No route is weakened by reading a form-typed body: every route
  that changes anything needs a key in a header, which a cross-site form cannot send.
- A body with more than `max_messages` messages is 400 right after JSON parsing, before
  validation or rendering (which grow with the message count).
- Messages are parsed once, here, into `clawbridge.chat.messages.ChatMessage`s (the renderer takes
  them as they are): a message that breaks its rules is 422 naming `messages.<i>`.
- Malformed JSON is 400; fields of the wrong type or range are 422; options clawbridge cannot
  honour (n > 1, penalties, logit_bias, structured output, audio, images) are 400 naming the
  option, never silently ignored. Unknown harmless fields (user, store, metadata, ...) are ignored.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from clawbridge.chat.content import TEXT_PART_TYPES
from clawbridge.chat.messages import ChatMessage
from clawbridge.proxy.errors import ApiError, validated

DEFAULT_MAX_MESSAGES = 4096
DEFAULT_BODY_TIMEOUT_S = 60.0


CURL_DATA_TYPE = "application/x-www-form-urlencoded"
"""The Content-Type `curl -d` sends when not told another: its bodies are read as JSON."""


def check_content_type(value: str | None) -> None:
    """415 unless `value` is absent, a JSON media type or curl's default (see the module invariants)."""
    if value is None or not value.strip():
        return
    media = value.split(";", 1)[0].strip().lower()
    if media in ("application/json", CURL_DATA_TYPE) or (media.startswith("application/") and media.endswith("+json")):
        return
    raise ApiError(415, f"Content-Type {media!r} is not supported; send the body as JSON with "
                   "'Content-Type: application/json'", code="unsupported_media_type")


async def read_body(request: Request, max_bytes: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> bytes:
    """The raw JSON body, refusing (413) anything larger than `max_bytes`, (408) anything slower
    than `timeout_s`, and (415) a Content-Type that is not JSON."""
    check_content_type(request.headers.get("content-type"))
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_capped(request, max_bytes)
    except TimeoutError:
        raise ApiError(408, f"request body not received within {timeout_s:g}s", code="body_timeout") from None


async def _read_capped(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > max_bytes:
                raise ApiError(413, f"request body of {declared} bytes is over the {max_bytes}-byte limit")
        except ValueError:
            raise ApiError(400, "invalid Content-Length header") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"request body is over the {max_bytes}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


STORED_REQUEST_FIELDS = frozenset({
    # what is rendered (every API shape)
    "model", "messages", "system", "tools", "tool_choice", "input", "instructions", "previous_response_id",
    # how it was sampled
    "max_tokens", "max_completion_tokens", "max_output_tokens", "temperature", "top_p", "top_k", "seed", "stop",
    "stop_sequences", "stream", "stream_options", "logprobs", "top_logprobs", "n", "parallel_tool_calls",
    "response_format", "reasoning", "reasoning_effort", "thinking", "user",
    # OpenClaw-RL's session fields
    "session_id", "turn_type", "session_done",
})
"""Top-level request fields the store keeps: what rendering, training and the judge read."""


def stored_request(raw: bytes, data: Any = None) -> str:
    """The request as recorded: `raw` without top-level fields outside `STORED_REQUEST_FIELDS`
    (their names are kept under `_dropped_fields`), so a client's large unknown fields cannot grow
    the store; `raw` itself when it is not a JSON object. `data`: `raw` already parsed and not
    yet modified, so it is not parsed a second time."""
    if data is None:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw.decode("utf-8", errors="replace")
    if not isinstance(data, dict):
        return raw.decode("utf-8", errors="replace")
    dropped = sorted(k for k in data if k not in STORED_REQUEST_FIELDS)
    if not dropped:
        return raw.decode("utf-8", errors="replace")
    kept: dict[str, Any] = {k: v for k, v in data.items() if k in STORED_REQUEST_FIELDS}
    kept["_dropped_fields"] = [k[:64] for k in dropped[:50]]
    return orjson.dumps(kept).decode()


def parse_json_object(body: bytes, max_messages: int = DEFAULT_MAX_MESSAGES) -> dict[str, Any]:
    """The body as a JSON object; 400 when it is not one, or has more than `max_messages` messages."""
    if not body:
        raise ApiError(400, "empty request body; expected a JSON object")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"malformed JSON in request body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > max_messages:
        raise ApiError(400, f"{len(messages)} messages is over the limit of {max_messages} (max_messages)",
                       param="messages", code="too_many_messages")
    return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """The fields of /v1/chat/completions that clawbridge reads."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    """Parsed once here (`clawbridge.chat.messages`); the renderer takes them as they are."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    """False: the answer ends where its first tool call closes."""
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def validate_chat_request(data: dict[str, Any]) -> ChatRequest:
    """`data` (an OpenAI-shaped chat request) as a `ChatRequest` with parsed messages: 422 naming
    the first bad field, 400 naming an option or content that cannot be served."""
    _refuse_non_text(data)
    req = validated(ChatRequest, data, code="invalid_field")
    _refuse_unsupported(req, data)
    return req


def _no(option: str, why: str) -> ApiError:
    return ApiError(400, f"unsupported option {option}: {why}", param=option, code="unsupported_option")


def _refuse_non_text(data: dict[str, Any]) -> None:
    """400 for a content part that is not text (an image, audio, a file), named as an unsupported
    option before validation, which would call it a malformed field."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") not in TEXT_PART_TYPES:
                    raise _no(f"messages.{i}.content", f"content part type {part.get('type')!r}; only text is served")


def _refuse_unsupported(req: ChatRequest, data: dict[str, Any]) -> None:
    no = _no

    if req.n not in (None, 1):
        raise no("n", "clawbridge samples one choice per call; send n separate calls")
    if req.presence_penalty or req.frequency_penalty:
        raise no("presence_penalty/frequency_penalty", "penalties would change the sampling distribution that is recorded")
    if req.logit_bias:
        raise no("logit_bias", "biases would make the recorded logprobs differ from the policy's")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise no("response_format", "structured output is not enforced by this server")
    if data.get("audio") or (data.get("modalities") not in (None, ["text"])):
        raise no("audio/modalities", "only text is served")
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    stops = req.stop_strings
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(400, "stop takes at most 4 non-empty strings", param="stop")
    if req.tools is not None:
        for i, tool in enumerate(req.tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
                raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                               param=f"tools.{i}")
