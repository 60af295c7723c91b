"""Sampled completion -> OpenAI assistant message (content, reasoning, tool calls), token exact.

Nothing here re-tokenizes: text comes from decoding the sampled ids, and the ids themselves are
what gets recorded. Only text is interpreted.

The one completion grammar (Hermes tool calls with an optional leading think block; every chat
format in `clawbridge.chat.chatformat` speaks it, natively or through its system prompt), after
trailing end-of-turn markers are stripped:

    [ws] <think> REASONING [</think>]  OUTSIDE
    OUTSIDE := (TEXT | <tool_call> JSON </tool_call>)*

- A think block counts only at the very start (after whitespace); unclosed, it runs to the end.
- A tool call block whose JSON is not an object with a string `name` (and `arguments` an object,
  a string, or absent), or that is never closed, stays in the content as its raw text.
- A forced call (`ForcedCall`: the prompt already ends with the opening of a call to one named
  function, `ForcedCall.prefill`) starts the completion inside that block. That first block is
  always a call to the forced function: its arguments are the JSON the model wrote, or, when what
  it wrote is not valid JSON (or the block never closes), the raw text it wrote for them, as
  OpenAI does (clients validate arguments).
- Content is the OUTSIDE text (tool call blocks removed), reasoning the think text; each has its
  leading and trailing newlines stripped and becomes None when only whitespace is left. This is
  the inverse of the chat template's rendering, so re-rendering a parsed turn gives the same text.

End-of-turn markers are defined here once (`END_OF_TURN_MARKERS`); a chat format keeps those its
vocabulary has (plus its eos token) as its stop markers, and passes them to the parser.

Invariants:
- `parse_completion` never raises on any text; it is `StreamParser` fed the whole text at once,
  so there is one parser of the grammar.
- `StreamParser` fed any split of a text emits, in total, the content, reasoning and tool calls
  (name and arguments) that `parse_completion` gives for the whole text, and holds back text
  only while it could still be part of a marker or of a whitespace run that may be stripped.
- `IncrementalDecoder` output, concatenated, equals decoding all ids at once.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
END_OF_TURN_MARKERS: tuple[str, ...] = (
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<end_of_turn>", "<|end|>",
)
"""Known end-of-turn token texts (ChatML, Llama 3, Gemma, Phi), in order of preference. A chat
format's stop markers are those of these its vocabulary has, then its eos token's text."""


def new_tool_call_id() -> str:
    """An OpenAI-style tool call id: `call_` + 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call, in OpenAI terms."""

    id: str
    """`call_<hex>`, unique per call."""
    name: str
    """The function name."""
    arguments: str
    """The arguments as a JSON string (OpenAI's wire format)."""
    type: Literal["function"] = "function"

    def to_openai(self) -> dict[str, Any]:
        """The `tool_calls[]` entry of an OpenAI chat completion message."""
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedMessage:
    """An assistant message parsed out of completion text."""

    content: str | None
    """Text outside think and tool call blocks; None when empty."""
    reasoning_content: str | None
    """Text of the leading think block; None when absent or empty."""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def from_deltas(cls, deltas: Sequence[Delta]) -> ParsedMessage:
        """The message a parser's deltas (all of them, in order) add up to."""
        content = "".join(d.text for d in deltas if d.kind == "content")
        reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
        return cls(
            content=content or None,
            reasoning_content=reasoning or None,
            tool_calls=[d.tool_call for d in deltas if d.tool_call is not None],
        )

    def to_openai(self) -> dict[str, Any]:
        """The `message` object of an OpenAI chat completion choice."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


def strip_stop_markers(text: str, markers: Sequence[str] = END_OF_TURN_MARKERS) -> str:
    """`text` without the end-of-turn `markers` at its end (any number of them)."""
    while True:
        for m in markers:
            if m and text.endswith(m):
                text = text[: -len(m)]
                break
        else:
            return text


def parse_tool_call_json(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON string) from the inside of a tool call block, or None if malformed."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None:
        return name, "{}"
    if isinstance(args, str):
        return name, args
    if isinstance(args, dict):
        return name, json.dumps(args, ensure_ascii=False)
    return None


def tool_call_text(name: str, arguments: Any) -> str:
    """One call written in the grammar: `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`.

    `arguments`: an object (written as JSON) or an already-serialized JSON string (written as is),
    the way the Qwen3 template writes a call; `ForcedCall.prefill` is this text's opening.
    """
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f"{ForcedCall(name).prefill} {args}}}\n{TOOL_CLOSE}"


@dataclass(frozen=True)
class ForcedCall:
    """A call the request forces (`tool_choice` naming a function): the prompt ends with `prefill`."""

    name: str
    """The function every answer calls first."""

    @property
    def prefill(self) -> str:
        """The call's opening, up to where the model writes the arguments (it writes the space:
        byte-level BPE tokenizers attach a space to the token after it)."""
        return f'{TOOL_OPEN}\n{{"name": {json.dumps(self.name, ensure_ascii=False)}, "arguments":'

    def call_from_block(self, body: str) -> ToolCall:
        """The forced call out of its block's inside (`prefill` without `<tool_call>`, then what was sampled)."""
        parsed = parse_tool_call_json(body)
        if parsed is not None:
            return ToolCall(id=new_tool_call_id(), name=self.name, arguments=parsed[1])
        raw = body[len(self.prefill) - len(TOOL_OPEN):].strip()
        if raw.endswith("}"):  # the closing brace of the call object, not of the arguments
            raw = raw[:-1].rstrip()
        return ToolCall(id=new_tool_call_id(), name=self.name, arguments=raw)


def parse_completion(
    text: str, stop_markers: Sequence[str] = END_OF_TURN_MARKERS, forced: ForcedCall | None = None
) -> ParsedMessage:
    """Parse a whole completion (see the module docstring for the grammar). Never raises.

    `forced`: the call the prompt's prefill opened (`text` is what was sampled after it).
    """
    parser = StreamParser(stop_markers, forced=forced)
    return ParsedMessage.from_deltas(parser.feed(text) + parser.finish())


# --------------------------------------------------------------------------------------------
# Streaming

DeltaKind = Literal["content", "reasoning", "tool_call"]


@dataclass(frozen=True)
class Delta:
    """A piece of the assistant message that is certain and can be sent to the client."""

    kind: DeltaKind
    text: str = ""
    """New content or reasoning text (kinds "content" and "reasoning")."""
    index: int = -1
    """Position of the tool call among this message's tool calls (kind "tool_call")."""
    tool_call: ToolCall | None = None
    """The complete tool call (kind "tool_call")."""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _TrimmedEmitter:
    """Streams all text fed with its leading/trailing newlines dropped; nothing if only whitespace."""

    def __init__(self) -> None:
        self.started = False
        self.pending = ""

    def feed(self, text: str) -> str:
        self.pending += text
        if not self.started:
            if not self.pending.strip():
                return ""
            self.started = True
            self.pending = self.pending.lstrip("\n")
        keep = len(self.pending) - len(self.pending.rstrip("\n"))
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return out


class _StopMarkerFilter:
    """Passes text through, holding back a suffix that may be trailing end-of-turn markers."""

    def __init__(self, markers: Sequence[str]) -> None:
        self.markers = tuple(m for m in markers if m)
        self._firsts = sorted({m[0] for m in self.markers})
        self.held = ""

    def _held_start(self, text: str) -> int:
        """Smallest i such that text[i:] is complete markers followed by a partial marker."""
        i = 0
        while True:
            j = min((k for c in self._firsts if (k := text.find(c, i)) >= 0), default=-1)
            if j < 0:
                return len(text)
            k = j
            while True:
                for m in self.markers:
                    if text.startswith(m, k):
                        k += len(m)
                        break
                else:
                    break
            tail = text[k:]
            if not tail or any(m.startswith(tail) for m in self.markers):
                return j
            i = j + 1

    def feed(self, piece: str) -> str:
        text = self.held + piece
        cut = self._held_start(text)
        self.held = text[cut:]
        return text[:cut]

    def finish(self) -> str:
        out = strip_stop_markers(self.held, self.markers)
        self.held = ""
        return out


class StreamParser:
    """The grammar's one parser: `feed` decoded text pieces, then `finish` once.

    `stop_markers`: the chat format's end-of-turn texts, stripped from the end. `forced`: the
    call the prompt's prefill opened; parsing starts inside that block.
    """

    def __init__(self, stop_markers: Sequence[str] = END_OF_TURN_MARKERS, *, forced: ForcedCall | None = None) -> None:
        self._stop = _StopMarkerFilter(stop_markers)
        self._mode: Literal["start", "think", "content", "tool"] = "start"
        self._buf = ""
        self._content = _TrimmedEmitter()
        self._reasoning = _TrimmedEmitter()
        self._n_calls = 0
        self._finished = False
        self._forced = forced
        if forced is not None:
            self._mode = "tool"
            self._buf = forced.prefill[len(TOOL_OPEN):]

    def feed(self, piece: str) -> list[Delta]:
        """New certain deltas after `piece` (may be empty)."""
        if self._finished:
            raise RuntimeError("StreamParser.feed after finish")
        return self._step(self._stop.feed(piece), final=False)

    def finish(self) -> list[Delta]:
        """The deltas held back until the end of the completion."""
        if self._finished:
            return []
        self._finished = True
        return self._step(self._stop.finish(), final=True)

    # ----------------------------------------------------------------------------------------

    def _emit(self, out: list[Delta], kind: Literal["content", "reasoning"], text: str) -> None:
        emitter = self._content if kind == "content" else self._reasoning
        new = emitter.feed(text)
        if new:
            if out and out[-1].kind == kind:
                out[-1] = Delta(kind, out[-1].text + new)
            else:
                out.append(Delta(kind, new))

    def _call(self, out: list[Delta], call: ToolCall) -> None:
        out.append(Delta("tool_call", index=self._n_calls, tool_call=call))
        self._n_calls += 1

    def _step(self, text: str, *, final: bool) -> list[Delta]:
        out: list[Delta] = []
        self._buf += text
        while True:
            buf = self._buf
            if self._mode == "start":
                lead = buf.lstrip()
                if lead.startswith(THINK_OPEN):
                    self._buf = lead[len(THINK_OPEN) :]
                    self._mode = "think"
                elif (not lead or THINK_OPEN.startswith(lead)) and not final:
                    return out
                else:
                    self._mode = "content"
            elif self._mode == "think":
                end = buf.find(THINK_CLOSE)
                if end >= 0:
                    self._emit(out, "reasoning", buf[:end])
                    self._buf = buf[end + len(THINK_CLOSE) :]
                    self._mode = "content"
                    continue
                keep = 0 if final else _partial_suffix(buf, THINK_CLOSE)
                self._emit(out, "reasoning", buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return out
            elif self._mode == "content":
                start = buf.find(TOOL_OPEN)
                if start >= 0:
                    self._emit(out, "content", buf[:start])
                    self._buf = buf[start + len(TOOL_OPEN) :]
                    self._mode = "tool"
                    continue
                keep = 0 if final else _partial_suffix(buf, TOOL_OPEN)
                self._emit(out, "content", buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return out
            else:  # tool
                forced, end = self._forced, buf.find(TOOL_CLOSE)
                if end < 0:
                    if final:
                        if forced is not None:
                            self._forced = None
                            self._call(out, forced.call_from_block(buf))
                        else:
                            self._emit(out, "content", TOOL_OPEN + buf)
                        self._buf = ""
                    return out
                body = buf[:end]
                self._buf = buf[end + len(TOOL_CLOSE) :]
                self._mode = "content"
                if forced is not None:
                    self._forced = None
                    self._call(out, forced.call_from_block(body))
                    continue
                parsed = parse_tool_call_json(body)
                if parsed is None:
                    self._emit(out, "content", TOOL_OPEN + body + TOOL_CLOSE)
                else:
                    self._call(out, ToolCall(id=new_tool_call_id(), name=parsed[0], arguments=parsed[1]))


# --------------------------------------------------------------------------------------------
# Incremental detokenization


class IncrementalDecoder:
    """Token ids -> text, one id at a time, never emitting half a UTF-8 character.

    Keeps a small window of ids: `prefix` ids already emitted (context for tokenizers whose
    decoding depends on neighbours) and the pending ids not yet emitted. Each `push` decodes only
    that window, and the window is cut after every emission, so the work per token is O(1)
    amortized. Text is held back while the window's decoding ends in U+FFFD (an incomplete
    character); `flush` emits whatever is left.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        """`decode`: ids -> text, special tokens kept (e.g. `Renderer.decode`)."""
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_len = 0
        """How many of `_ids` were already emitted (kept as decoding context)."""
        self._prefix_text = ""
        """Decoding of `_ids[:_prefix_len]`."""

    def push(self, token_id: int) -> str:
        """The new text that `token_id` completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if text.endswith("\ufffd") or len(text) <= len(self._prefix_text):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Everything still held back (incomplete characters come out as U+FFFD); resets the state."""
        out = ""
        if len(self._ids) > self._prefix_len:
            text = self._decode(self._ids)
            out = text[len(self._prefix_text) :] if text.startswith(self._prefix_text) else text
        self._ids, self._prefix_len, self._prefix_text = [], 0, ""
        return out

    def _advance(self, text: str) -> str:
        new = text[len(self._prefix_text) :]
        # Keep only the ids just emitted, as context for the next ones.
        self._ids = self._ids[self._prefix_len :]
        self._prefix_len = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new
