"""Reading an Anthropic Messages request and turning it into the OpenAI-shaped data the renderer takes.

It sits below the proxy (which answers its `ShapeError`s as 400 `invalid_request`) and the
rewards (which read recorded Anthropic requests through `clawbridge.shapes.recorded`).

Invariants:
- Every field that changes what the model sees or how it samples is either converted exactly
  (system, messages, tools, tool_choice, max_tokens, temperature, top_p, top_k, stop_sequences)
  or refused with a 400 naming it (images, documents, server tools, assistant prefill,
  structured output); nothing is silently dropped except what cannot change the prompt
  (metadata, cache_control, service_tier, output_config.effort, thinking signatures, redacted
  thinking).
- `thinking` is validated and ignored: the served model thinks as its chat template lets it, and
  its reasoning comes back as a `thinking` block either way.
- The conversion never mutates the request and gives what `Renderer.render` would get for the
  equivalent OpenAI messages: a tool_result is a `tool` message (tool_call_id = tool_use_id),
  an assistant's thinking is `reasoning_content`, a tool_use is a tool call whose arguments are
  the JSON text of its input.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from clawbridge.shapes.errors import invalid, validated

_REFUSED_FIELDS = {
    "output_format": "structured output is not enforced by this server",
    "mcp_servers": "MCP connectors are not served; pass tools instead",
    "container": "code-execution containers are not served",
}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class MessagesRequest(BaseModel):
    """The fields of /v1/messages that clawbridge reads; `max_tokens` is required except for counting."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: Thinking | None = None




def validate_messages_request(data: dict[str, Any], *, need_max_tokens: bool = True) -> MessagesRequest:
    """The validated request, or a 400 naming the first bad field."""
    req = validated(MessagesRequest, data, prefix="")
    if need_max_tokens and req.max_tokens is None:
        raise invalid("max_tokens: Field required", "max_tokens")
    for name, why in _REFUSED_FIELDS.items():
        if data.get(name) is not None:
            raise invalid(f"unsupported option {name}: {why}", name)
    output_config = data.get("output_config")
    if isinstance(output_config, dict) and output_config.get("format") is not None:
        raise invalid("unsupported option output_config.format: structured output is not enforced by this "
                      "server", "output_config.format")
    if req.stop_sequences is not None and any(not s for s in req.stop_sequences):
        raise invalid("stop_sequences: each stop sequence must be a non-empty string", "stop_sequences")
    if req.tool_choice is not None and req.tool_choice.type == "tool" and not req.tool_choice.name:
        raise invalid("tool_choice: type 'tool' needs a 'name'", "tool_choice")
    if req.messages[-1].role == "assistant":
        raise invalid("messages: the last message must be a user message (assistant prefill is not "
                      "supported by this server)", "messages")
    return req


def _text_parts(texts: list[str]) -> str | list[dict[str, Any]]:
    """One text as a string, several as OpenAI text parts (the renderer joins them with newlines)."""
    return texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]


def _tool_result_text(block: dict[str, Any], where: str) -> str | list[dict[str, Any]]:
    content = block.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content: must be a string or a list of text blocks", where)
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"{where}.content.{j}: block type {kind!r} is not supported in tool results "
                          "(text only)", where)
        texts.append(part["text"])
    return _text_parts(texts) if texts else ""


def _system_text(blocks: list[dict[str, Any]], where: str) -> str | list[dict[str, Any]]:
    texts = []
    for j, block in enumerate(blocks):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise invalid(f"{where}.content.{j}: system messages take text blocks only", where)
        texts.append(block["text"])
    if not texts:
        raise invalid(f"{where}.content: a system message needs at least one text block", where)
    return _text_parts(texts)


def _string(block: dict[str, Any], key: str, at: str) -> str:
    """`block[key]`, which must be a string (else a 400 naming `at.key`)."""
    value = block.get(key)
    if not isinstance(value, str):
        raise invalid(f"{at}.{key}: must be a string", at)
    return value


def _user_messages(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks, in order: tool results as `tool` messages, runs of text as `user` messages."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": _text_parts(list(texts))})
            texts.clear()

    for j, block in enumerate(blocks):
        kind = block.get("type")
        at = f"{where}.content.{j}"
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "tool_result":
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str) or not tool_use_id:
                raise invalid(f"{at}.tool_use_id: must be a non-empty string", at)
            flush()
            out.append({"role": "tool", "tool_call_id": tool_use_id, "content": _tool_result_text(block, at)})
        else:
            raise invalid(f"{at}: content block type {kind!r} is not supported in user messages "
                          "(text and tool_result only)", at)
    flush()
    if not out:
        raise invalid(f"{where}.content: a user message needs at least one block", where)
    return out


def _assistant_message(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        at = f"{where}.content.{j}"
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "thinking":
            thoughts.append(_string(block, "thinking", at))
        elif kind == "redacted_thinking":
            continue  # opaque data from another provider's model: nothing this model can read
        elif kind == "tool_use":
            name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(call_id, str) or not isinstance(args, dict):
                raise invalid(f"{at}: tool_use needs a string 'id', a string 'name' and an object 'input'", at)
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        else:
            raise invalid(f"{at}: content block type {kind!r} is not supported in assistant messages "
                          "(text, thinking and tool_use only)", at)
    msg: dict[str, Any] = {"role": "assistant", "content": _text_parts(texts) if texts else None}
    if thoughts:
        msg["reasoning_content"] = "\n".join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return msg


def openai_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """The request's system prompt and messages as OpenAI chat messages."""
    out: list[dict[str, Any]] = []
    if isinstance(req.system, str):
        if req.system:
            out.append({"role": "system", "content": req.system})
    elif req.system:
        out.append({"role": "system", "content": _system_text([b.model_dump() for b in req.system], "system")})
    for i, msg in enumerate(req.messages):
        where = f"messages.{i}"
        blocks = [{"type": "text", "text": msg.content}] if isinstance(msg.content, str) else msg.content
        if any(not isinstance(b, dict) for b in blocks):
            raise invalid(f"{where}.content: each content block must be an object", where)
        if msg.role == "system":
            out.append({"role": "system", "content": _system_text(blocks, where)})
        elif msg.role == "user":
            out.extend(_user_messages(blocks, where))
        else:
            out.append(_assistant_message(blocks, where))
    return out


def openai_tools(req: MessagesRequest) -> list[dict[str, Any]] | None:
    """Anthropic tools as OpenAI function tools (`input_schema` -> `parameters`)."""
    if req.tools is None:
        return None
    out = []
    for tool in req.tools:
        fn: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            fn["description"] = tool.description
        fn["parameters"] = tool.input_schema
        out.append({"type": "function", "function": fn})
    return out


def openai_tool_choice(req: MessagesRequest) -> str | dict[str, Any] | None:
    """auto -> "auto", any -> "required", none -> "none", tool -> the named function."""
    choice = req.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def openai_data(req: MessagesRequest) -> dict[str, Any]:
    """The OpenAI chat completion request equivalent to `req` (what `ChatCall` renders and samples)."""
    data: dict[str, Any] = {"model": req.model, "messages": openai_messages(req), "stream": req.stream}
    tools = openai_tools(req)
    if tools is not None:
        data["tools"] = tools
    choice = openai_tool_choice(req)
    if choice is not None:
        data["tool_choice"] = choice
    if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use:
        data["parallel_tool_calls"] = False
    for key, value in (("max_tokens", req.max_tokens), ("temperature", req.temperature),
                       ("top_p", req.top_p), ("top_k", req.top_k), ("stop", req.stop_sequences)):
        if value is not None:
            data[key] = value
    return data
