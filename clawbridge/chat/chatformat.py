"""Chat formats: one per model family, chosen from the tokenizer's chat template.

A chat format is what the proxy needs to talk to one model: render OpenAI-shaped messages and
tools to prompt ids, parse the sampled ids back (content, reasoning, tool calls; streaming too),
the stop markers that end a turn, and what the template supports. `ChatFormat` is that seam;
`clawbridge.chat.render.Renderer` implements it for any transformers tokenizer with a chat template,
with the family-specific part (how tools reach the model) given by a `ToolStyle`:

- `NativeTools` ("qwen3"): the template renders `tools`, tool calls and tool results itself, in
  the Hermes grammar of `clawbridge.chat.parse` (Qwen2.5/Qwen3, Hermes; think blocks when the template
  has them). Chosen when the template mentions `tools` and writes `<tool_call>`.
- `SystemPromptTools` ("plain"): any other template (ChatML such as SmolLM2's, Llama-style, ...),
  which is only ever given `system`/`user`/`assistant` messages with text content. Tools, calls
  and results are written into those messages in the same Hermes grammar, so the one parser
  reads the calls back. The documented format:

  * The tools go into the system message (after its own text and a blank line; a system message
    is added when there is none):

        # Tools

        You may call one or more functions to assist with the user query.

        You are provided with function signatures within <tools></tools> XML tags:
        <tools>
        {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
        </tools>

        For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
        <tool_call>
        {"name": <function-name>, "arguments": <args-json-object>}
        </tool_call>

    (one tool per line, as JSON). An assistant's tool calls follow its text, each as
    `<tool_call>\\n{"name": N, "arguments": ARGS}\\n</tool_call>` (separated by a newline);
    its `reasoning_content` precedes the text as `<think>\\nR\\n</think>\\n\\n`. A run of tool
    results becomes one user message of `<tool_response>\\nRESULT\\n</tool_response>` blocks
    joined by newlines. This is exactly what the Qwen3 template writes, so a model's call is
    parsed the same way under either style, and re-rendering a parsed turn gives its text back.

Forcing a call (`tool_choice` naming a function, or "required" with one tool) works the same for
every format: the prompt ends with the opening of that call (`clawbridge.chat.parse.ForcedCall`), so
the model can only write its arguments, and the proxy ends sampling where the call closes (the
call is the whole answer). "required" with several tools cannot be forced that way
and is refused (400), never silently treated as "auto".

Invariants:
- Nothing in a request is dropped: every message, tool, tool call, tool result and reasoning text
  reaches the prompt (natively or in the documented text form), or rendering fails with a
  `RenderError` (HTTP 400).
- Stop markers are `clawbridge.chat.parse.END_OF_TURN_MARKERS` present in the vocabulary, then the eos
  token; the sampler stops on their ids and the parser strips their texts (one list for both).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from clawbridge.chat.messages import Messages, RenderError
from clawbridge.chat.parse import (
    END_OF_TURN_MARKERS,
    THINK_CLOSE,
    THINK_OPEN,
    ForcedCall,
    ParsedMessage,
    StreamParser,
    tool_call_text,
)

TOOLS_PROMPT_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_PROMPT_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


class ToolChoiceError(RenderError):
    """`tool_choice` is invalid or cannot be honoured for these tools: HTTP 400 naming `tool_choice`."""


@dataclass(frozen=True)
class Capabilities:
    """What a chat format does natively (everything else it emulates in text, never drops)."""

    native_tools: bool
    """The template renders tools itself (else they go into the system message as text)."""
    reasoning: bool
    """The template knows think blocks (`<think>`), i.e. the model was trained to reason in them."""
    forced_tool_choice: bool = True
    """A named `tool_choice` is enforced (by prefilling the call's opening)."""


@dataclass(frozen=True)
class Prompt:
    """A rendered request: the ids the model is given and what the parser must know about them."""

    ids: list[int]
    """Prompt token ids, exactly `tokenizer(text)`."""
    text: str
    """The prompt text (template output, then any forced call's prefill)."""
    forced: ForcedCall | None = None
    """The call the prompt's end opens (`tool_choice` forced it); the completion continues it."""


class ChatFormat(Protocol):
    """One model's conversation format: what the proxy, judge and teacher use to talk to it.

    No fake: tests use real tokenizers (the tiny model, `clawbridge.devtools.tinymodel`, and
    SmolLM2's). Tested by tests/test_chatformat.py, tests/test_render.py, tests/test_parse.py."""

    @property
    def format_name(self) -> str:
        """"qwen3" or "plain" (see the module docstring)."""
        ...

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn (the sampler stops on them)."""
        ...

    @property
    def stop_markers(self) -> tuple[str, ...]:
        """Texts of `stop_token_ids` (the parser strips them from the end)."""
        ...

    def render_prompt(self, messages: Messages,
                      tools: list[dict[str, Any]] | None = None,
                      tool_choice: str | dict[str, Any] | None = None) -> Prompt:
        """Render an OpenAI chat request: `ChatMessage`s as they are, plain message objects parsed by
        `clawbridge.chat.messages.parse_messages` (raises `RenderError` / `ToolChoiceError`)."""
        ...

    def render(self, messages: Messages,
               tools: list[dict[str, Any]] | None = None,
               tool_choice: str | dict[str, Any] | None = None) -> list[int]:
        """`render_prompt(...).ids`."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included."""
        ...

    def parser(self, prompt: Prompt | None = None) -> StreamParser:
        """A streaming parser for a completion of `prompt`."""
        ...

    def parse(self, text: str, prompt: Prompt | None = None) -> ParsedMessage:
        """The whole completion `text` of `prompt` as an assistant message."""
        ...


# ------------------------------------------------------------------------------------------------
# tool_choice


@dataclass(frozen=True)
class ToolSelection:
    """What a request's `tools` + `tool_choice` mean for the prompt."""

    shown: list[dict[str, Any]] | None
    """The tools the model is shown (None: no tools section)."""
    forced: ForcedCall | None
    """The call the answer must start with."""


def tool_name(tool: Mapping[str, Any]) -> Any:
    """The function name of an OpenAI tool (`{"function": {"name"}}`, or a flat `{"name"}`)."""
    fn = tool.get("function")
    return fn.get("name") if isinstance(fn, Mapping) else tool.get("name")


def select_tools(tools: Any, tool_choice: Any) -> ToolSelection:
    """Validate `tools` and `tool_choice` and decide what the model sees and must do.

    "auto"/None: all tools; "none": no tools; a function object: only that tool, forced;
    "required": its one tool, forced (several tools: `ToolChoiceError`, it cannot be forced);
    allowed_tools: only the listed tools, with its mode ("auto" or "required") applied to them.
    """
    if tools == []:
        tools = None
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
            raise RenderError("'tools' must be a list of objects")
        for j, t in enumerate(tools):
            if not isinstance(tool_name(t), str):
                raise RenderError(f"tools[{j}]: a tool needs a function name")
    shown = [dict(t) for t in tools] if tools is not None else None
    if tool_choice is None or tool_choice == "auto":
        return ToolSelection(shown, None)
    if tool_choice == "none":
        return ToolSelection(None, None)
    if tool_choice == "required":
        if not shown:
            raise ToolChoiceError("tool_choice 'required' needs at least one tool in 'tools'")
        if len(shown) > 1:
            raise ToolChoiceError(
                f"tool_choice 'required' cannot be enforced with {len(shown)} tools: clawbridge forces a call "
                "by writing its opening, which needs one function; name it "
                "({\"type\": \"function\", \"function\": {\"name\": ...}}) or use 'auto'")
        return ToolSelection(shown, ForcedCall(str(tool_name(shown[0]))))
    if isinstance(tool_choice, Mapping):
        kind = tool_choice.get("type", "function")
        if kind == "allowed_tools":
            return _allowed_tools(shown, tool_choice.get("allowed_tools"))
        if kind != "function":
            raise ToolChoiceError(f"tool_choice type {kind!r} is not supported (use 'function' or 'allowed_tools')")
        name = tool_name(tool_choice)
        if not isinstance(name, str) or not name:
            raise ToolChoiceError("tool_choice object must name a function: {\"type\": \"function\", "
                                  "\"function\": {\"name\": ...}}")
        chosen = [t for t in shown or [] if tool_name(t) == name]
        if not chosen:
            raise ToolChoiceError(f"tool_choice names {name!r}, which is not in 'tools'")
        return ToolSelection(chosen, ForcedCall(name))
    raise ToolChoiceError(
        f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
        f"{{\"name\": ...}}}}; got {json.dumps(tool_choice)[:80]}")


def _allowed_tools(shown: list[dict[str, Any]] | None, spec: Any) -> ToolSelection:
    """`{"type": "allowed_tools", "allowed_tools": {"mode": "auto"|"required", "tools": [...]}}`:
    only the listed tools are shown, then `mode` applies to them as a `tool_choice` would."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("tools"), list):
        raise ToolChoiceError("tool_choice allowed_tools needs {\"mode\": \"auto\"|\"required\", \"tools\": [...]}")
    mode = spec.get("mode", "auto")
    if mode not in ("auto", "required"):
        raise ToolChoiceError(f"tool_choice allowed_tools mode must be 'auto' or 'required'; got {mode!r}")
    names = [tool_name(t) if isinstance(t, Mapping) else None for t in spec["tools"]]
    known = {tool_name(t) for t in shown or []}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ToolChoiceError(f"tool_choice allowed_tools names {unknown or 'no tool'}, not in 'tools'")
    return select_tools([t for t in shown or [] if tool_name(t) in names], mode)


# ------------------------------------------------------------------------------------------------
# Tool styles


class ToolStyle(Protocol):
    """How one template family gets tools, tool calls and tool results (see the module docstring).
    Tested by tests/test_chatformat.py (both styles, real templates)."""

    name: str
    native_tools: bool

    def prepare(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) to hand to the template, from normalized messages and shown tools."""
        ...


class NativeTools:
    """The template renders tools itself (Hermes grammar): messages pass through unchanged."""

    name = "qwen3"
    native_tools = True

    def prepare(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        return messages, tools


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """The documented tools section of the system message."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_PROMPT_HEAD + lines + TOOLS_PROMPT_TAIL


def assistant_text(message: Mapping[str, Any]) -> str:
    """An assistant message as the text the model would have written (think, content, calls)."""
    content = str(message.get("content") or "")
    reasoning = message.get("reasoning_content")
    text = content
    if isinstance(reasoning, str) and reasoning.strip("\n"):
        content = content.lstrip("\n")
        text = f"{THINK_OPEN}\n{reasoning.strip(chr(10))}\n{THINK_CLOSE}\n\n{content}"
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        if i > 0 or content:
            text += "\n"
        text += tool_call_text(fn["name"], fn.get("arguments"))
    return text


class SystemPromptTools:
    """The template knows no tools: write them into plain system/user/assistant messages."""

    name = "plain"
    native_tools = False

    def prepare(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        out: list[dict[str, Any]] = []
        rest = messages
        if tools:
            system = tools_system_text(tools)
            if messages and messages[0]["role"] == "system":
                system = messages[0]["content"] + "\n\n" + system
                rest = messages[1:]
            out.append({"role": "system", "content": system})
        results: list[str] = []
        for msg in rest:
            role = msg["role"]
            if role == "tool":
                results.append(f"<tool_response>\n{msg['content']}\n</tool_response>")
                continue
            if results:
                out.append({"role": "user", "content": "\n".join(results)})
                results = []
            text = assistant_text(msg) if role == "assistant" else msg["content"]
            out.append({"role": role, "content": text})
        if results:
            out.append({"role": "user", "content": "\n".join(results)})
        return out, None


def tool_style_for(template: str) -> ToolStyle:
    """`NativeTools` when the template renders `tools` as Hermes `<tool_call>` blocks, else `SystemPromptTools`."""
    if "tools" in template and "<tool_call>" in template:
        return NativeTools()
    return SystemPromptTools()


def stop_markers_for(vocab: Mapping[str, int], eos_token: str | None) -> tuple[str, ...]:
    """`END_OF_TURN_MARKERS` in `vocab`, then `eos_token` (once)."""
    markers = [m for m in END_OF_TURN_MARKERS if m in vocab]
    if eos_token and eos_token in vocab and eos_token not in markers:
        markers.append(eos_token)
    return tuple(markers)
