"""Renderer: the `ChatFormat` of a transformers tokenizer with a chat template.

Parsed chat messages (`clawbridge.chat.messages.ChatMessage`, what a validated request holds; plain
OpenAI-shaped message objects are parsed by the same rules first) -> prompt token ids through the
chat template, with tools handled as the template's family needs (`clawbridge.chat.chatformat`:
natively, or written into the system message), a forced `tool_choice` prefilled; sampled text ->
assistant message by the one grammar of `clawbridge.chat.parse`, with this vocabulary's stop markers.

Invariants:
- Token exact: `render` returns exactly `tokenizer(text, add_special_tokens=False).input_ids` for
  the prompt text (`render_text`: the template's text, exactly what `apply_chat_template` gives
  (`clawbridge.chat.chat_template`), then any forced call's prefill). The speed-up (per-segment caching) never changes the ids:
  text is split only at added tokens the tokenizer itself splits at first (no lstrip/rstrip/
  single_word, not normalized), so each segment tokenizes independently of its neighbours.
- Bounded memory: the segment cache holds at most `max_entries` segments and `max_chars` text.
- Bad input raises `RenderError` (a `ValueError`) with a message fit for an HTTP 400 body; the
  caller's messages are never mutated.
- Thread safe: the cache is guarded by a lock; the tokenizer and template are read-only.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from clawbridge.chat.chat_template import ChatTemplate
from clawbridge.chat.chatformat import (
    Capabilities,
    Prompt,
    RenderError,
    ToolChoiceError,
    ToolStyle,
    select_tools,
    stop_markers_for,
    tool_style_for,
)
from clawbridge.chat.messages import ROLES, Messages, parse_messages
from clawbridge.chat.parse import ParsedMessage, StreamParser, parse_completion
from clawbridge.sources import resolve_source

__all__ = ["ROLES", "RenderError", "Renderer", "SegmentCache", "ToolChoiceError"]

_BATCH_MIN_CHARS = 64 * 1024
"""Below this much uncached text, segments are tokenized one by one instead of in a batch."""


@dataclass
class SegmentCache:
    """LRU map from segment text to its token ids, bounded in entries and total characters."""

    max_entries: int = 4096
    """At most this many segments are kept."""
    max_chars: int = 32 * 1024 * 1024
    """At most this many characters of segment text are kept (ids are ~4x smaller in count)."""
    hits: int = 0
    misses: int = 0
    _data: OrderedDict[str, tuple[int, ...]] = field(default_factory=OrderedDict, repr=False)
    _chars: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def get(self, text: str) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._data.get(text)
            if ids is None:
                self.misses += 1
                return None
            self._data.move_to_end(text)
            self.hits += 1
            return ids

    def put(self, text: str, ids: tuple[int, ...]) -> None:
        if len(text) > self.max_chars:
            return
        with self._lock:
            if text in self._data:
                self._data.move_to_end(text)
                return
            self._data[text] = ids
            self._chars += len(text)
            while len(self._data) > self.max_entries or self._chars > self.max_chars:
                old, _ = self._data.popitem(last=False)
                self._chars -= len(old)

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._chars = 0


class Renderer:
    """Chat template + tokenizer of one model, with a segment cache for fast repeated prompts."""

    def __init__(self, tokenizer: Any, *, cache: SegmentCache | None = None) -> None:
        """`tokenizer`: a transformers fast tokenizer with a chat template."""
        if not getattr(tokenizer, "chat_template", None):
            raise RenderError("the tokenizer has no chat template")
        self.tokenizer: Any = tokenizer
        """The transformers tokenizer (read-only)."""
        self.cache: SegmentCache = cache if cache is not None else SegmentCache()
        """Segment text -> ids; shared by every render of this renderer."""
        self._backend: Any = tokenizer.backend_tokenizer
        self.template: ChatTemplate = ChatTemplate(tokenizer)
        """The chat template, rendered as `apply_chat_template` renders it (`clawbridge.chat.chat_template`)."""
        template = str(tokenizer.chat_template)
        self.developer_role_supported: bool = "developer" in template
        """Whether the template renders `developer` messages itself (else they become `system`)."""
        added = getattr(tokenizer, "added_tokens_decoder", {})
        splittable = {
            tok.content: tid
            for tid, tok in added.items()
            if not (tok.lstrip or tok.rstrip or tok.single_word or tok.normalized)
        }
        self._special_ids: dict[str, int] = splittable
        self._split_re: re.Pattern[str] | None = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(splittable, key=len, reverse=True)) + ")")
            if splittable
            else None
        )
        self.tool_style: ToolStyle = tool_style_for(template)
        """How tools reach this template (natively, or written into the system message)."""
        self.capabilities: Capabilities = Capabilities(
            native_tools=self.tool_style.native_tools, reasoning="<think>" in template
        )
        vocab = tokenizer.get_vocab()
        eos = getattr(tokenizer, "eos_token", None)
        self.stop_markers: tuple[str, ...] = stop_markers_for(vocab, eos if isinstance(eos, str) else None)
        """End-of-turn texts in this vocabulary (`<|im_end|>`, `<|endoftext|>`, ..., eos), in that order."""
        self.stop_token_ids: tuple[int, ...] = tuple(vocab[m] for m in self.stop_markers)
        """Ids of `stop_markers`: the sampler stops on them."""

    @classmethod
    def from_pretrained(cls, path_or_id: str) -> Renderer:
        """Load the tokenizer (offline when `path_or_id` is a local folder)."""
        from transformers import AutoTokenizer

        try:
            source, local = resolve_source(path_or_id, "tokenizer")
        except ValueError as e:
            raise RenderError(str(e)) from None
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
        if not getattr(tokenizer, "is_fast", False):
            raise RenderError(f"{path_or_id}: a fast (tokenizers-backed) tokenizer is required")
        return cls(tokenizer)

    # ----------------------------------------------------------------------------------------

    @property
    def format_name(self) -> str:
        """The chat format's family: "qwen3" (native Hermes tools) or "plain" (tools in the system message)."""
        return self.tool_style.name

    def describe(self) -> str:
        """One line for the start-up log: the format and what it does natively."""
        caps = self.capabilities
        tools = "native tools" if caps.native_tools else "tools in the system message"
        return (f"chat format {self.format_name}: {tools}, reasoning {'yes' if caps.reasoning else 'no'}, "
                f"stop markers {', '.join(self.stop_markers) or 'none'}")

    def render_prompt(
        self,
        messages: Messages,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> Prompt:
        """An OpenAI chat request as prompt text and ids: the parsed messages (`ChatMessage`s are
        taken as they are, plain objects parsed by `clawbridge.chat.messages.parse_messages`) and the
        tools shown, through the chat format and template, generation prompt added, then a forced
        call's opening."""
        dev_as_system = not self.developer_role_supported
        norm = [m.template_dict(developer_as_system=dev_as_system) for m in parse_messages(messages)]
        selection = select_tools(tools, tool_choice)
        shown_messages, template_tools = self.tool_style.prepare(norm, selection.shown)
        try:
            text = self.template.render(shown_messages, template_tools)
        except RenderError:
            raise
        except Exception as e:  # jinja2.TemplateError, raise_exception(), bad types inside the template
            raise RenderError(f"chat template failed: {e}") from e
        if not isinstance(text, str):
            raise RenderError("chat template did not produce text")
        if selection.forced is not None:
            text += selection.forced.prefill
        return Prompt(ids=self.encode(text), text=text, forced=selection.forced)

    def render_text(
        self,
        messages: Messages,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> str:
        """The prompt text (`render_prompt(...).text`)."""
        return self.render_prompt(messages, tools, tool_choice).text

    def render(
        self,
        messages: Messages,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> list[int]:
        """Prompt token ids for an OpenAI chat request (`render_prompt(...).ids`)."""
        return self.render_prompt(messages, tools, tool_choice).ids

    def parser(self, prompt: Prompt | None = None) -> StreamParser:
        """A streaming parser for a completion of `prompt` (this format's stop markers)."""
        return StreamParser(self.stop_markers, forced=prompt.forced if prompt is not None else None)

    def parse(self, text: str, prompt: Prompt | None = None) -> ParsedMessage:
        """A whole completion of `prompt` as an assistant message."""
        return parse_completion(text, self.stop_markers, prompt.forced if prompt is not None else None)

    def segments(self, text: str) -> list[str]:
        """`text` split at added tokens (kept as their own items); empty pieces dropped."""
        if self._split_re is None:
            return [text] if text else []
        return [s for s in self._split_re.split(text) if s]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS/EOS added), equal to tokenizing it whole; cached by segment."""
        ids: list[int] = []
        missing: dict[str, None] = {}
        parts = self.segments(text)
        found: list[tuple[int, ...] | None] = []
        for seg in parts:
            sid = self._special_ids.get(seg)
            if sid is not None:
                found.append((sid,))
                continue
            cached = self.cache.get(seg)
            found.append(cached)
            if cached is None:
                missing[seg] = None
        if missing:
            todo = list(missing)
            if sum(map(len, todo)) >= _BATCH_MIN_CHARS:
                # Large new text (a first request, a big tool result): tokenize in parallel.
                encs = self._backend.encode_batch(todo, add_special_tokens=False)
            else:  # a few short new segments: a thread pool would cost more than it saves
                encs = [self._backend.encode(seg, add_special_tokens=False) for seg in todo]
            fresh = {seg: tuple(enc.ids) for seg, enc in zip(todo, encs, strict=True)}
            for seg, seg_ids in fresh.items():
                self.cache.put(seg, seg_ids)
            found = [f if f is not None else fresh[seg] for seg, f in zip(parts, found, strict=True)]
        for f in found:
            assert f is not None
            ids.extend(f)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included, no clean-up (inverse of `encode` for byte-level BPE)."""
        return str(self._backend.decode(list(ids), skip_special_tokens=False))
