"""A tokenizer's chat template rendered as `apply_chat_template(..., tokenize=False)` renders it,
without the per-call deep copy of every message and tool that transformers makes.

transformers rebuilds everything a template sees out of plain JSON types on every call (its guard
against rich objects such as images inside messages). The renderer's messages and tools are
already plain JSON data (parsed from a request body, then `ChatMessage.template_dict`), so that
copy is pure cost: for an agent's 40 KB, 12-tool request it was over a third of the render.

An agent sends the same tools on every call, and the template serializes each of them (`tojson`)
on every render: a third of what was left. Tool lists are interned (`ToolsMemo`): the first time
a list is seen, a private deep copy of it is kept, and the template's `tojson` of that copy's
objects is computed once.

Invariants:
- Same text: `ChatTemplate.render` returns exactly what `tokenizer.apply_chat_template(messages,
  tools=tools, tokenize=False, add_generation_prompt=True)` returns. It renders transformers' own
  compiled template (same sandbox, filters and globals) with the same inputs: top-level None keys
  dropped, reasoning fields aliased as the installed transformers aliases them, the tokenizer's
  special tokens as variables.
- Checked, not assumed: at construction both ways render a set of probe conversations (tools,
  tool calls, reasoning, a tool result); if any text differs, or transformers lacks the pieces
  used, every render goes through `apply_chat_template` itself (`fast` is False, logged once).
- Inputs are never mutated (the sandbox is immutable; aliasing builds new dicts).
- The `tojson` memo answers only for objects of an interned copy (matched by identity), which
  nothing outside this module holds and the sandbox cannot change, so a memoized text is the
  text `tojson` gives that object. A list is interned under its orjson bytes (which tell 1, 1.0
  and true apart) and taken from the memo only when it also compares equal (which tells NaN from
  null); a list orjson cannot write is rendered as it is. At most `max_lists` lists are kept.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import orjson

log = logging.getLogger(__name__)

_PROBE_TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "Which file."}},
                   "required": ["path"]}}}]
_PROBES: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "user", "content": "Hello"}], None),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}], None),
    ([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Show a.txt"},
      {"role": "assistant", "content": "", "reasoning_content": "I should read it.",
       "tool_calls": [{"type": "function", "id": "c1", "function": {"name": "read_file",
                                                                    "arguments": {"path": "a.txt"}}}]},
      {"role": "tool", "content": "line one", "tool_call_id": "c1"},
      {"role": "assistant", "content": "It says: line one."}, {"role": "user", "content": "Thanks"}], _PROBE_TOOLS),
]


Alias = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
"""transformers' reasoning-field aliasing of a conversation."""


def _transformers_parts() -> tuple[Callable[[str], Any], Alias] | None:
    """transformers' template compiler and its reasoning aliasing (identity where this version has none)."""
    try:
        from transformers.utils import chat_template_utils as ctu
    except ImportError:
        return None
    compile_template = getattr(ctu, "_compile_jinja_template", None)
    if compile_template is None:
        return None
    alias: Alias = getattr(
        ctu, "_alias_reasoning_fields", lambda chat: chat)
    return compile_template, alias


class ToolsMemo:
    """Interned tool lists and the `tojson` text of their objects (module invariants)."""

    def __init__(self, tojson: Callable[..., str], max_lists: int = 64) -> None:
        self._tojson = tojson
        self.max_lists = max_lists
        self._lists: OrderedDict[bytes, list[Any]] = OrderedDict()
        self._texts: dict[int, tuple[Any, dict[Any, str]]] = {}
        """id of an interned object -> (the object, its tojson text per argument set)."""
        self._lock = threading.Lock()

    def intern(self, tools: list[Any]) -> list[Any]:
        """The interned copy equal to `tools` (made on first sight), or `tools` itself when it
        cannot be keyed exactly."""
        try:
            key = orjson.dumps(tools)
        except TypeError:  # a value orjson does not write (say an int past 64 bits): no memo
            return tools
        with self._lock:
            kept = self._lists.get(key)
            if kept is not None:
                self._lists.move_to_end(key)
        if kept is not None and kept == tools:
            return kept
        if kept is not None:  # same bytes, not equal (a NaN): render it as it is
            return tools
        kept = copy.deepcopy(tools)
        with self._lock:
            self._lists[key] = kept
            for obj in (kept, *kept):
                self._texts[id(obj)] = (obj, {})
            while len(self._lists) > self.max_lists:
                _, old = self._lists.popitem(last=False)
                for obj in (old, *old):
                    self._texts.pop(id(obj), None)
        return kept

    def tojson(self, x: Any, *args: Any, **kwargs: Any) -> str:
        """The template's `tojson` filter, memoized for interned objects."""
        held = self._texts.get(id(x))
        if held is None or held[0] is not x:
            return self._tojson(x, *args, **kwargs)
        how = (args, tuple(sorted(kwargs.items())))
        text = held[1].get(how)
        if text is None:
            text = held[1][how] = self._tojson(x, *args, **kwargs)
        return text


class ChatTemplate:
    """The chat template of one tokenizer, rendered with a generation prompt (module invariants)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._special: dict[str, Any] = dict(tokenizer.special_tokens_map)
        parts = _transformers_parts()
        self._compile: Callable[[str], Any] | None = parts[0] if parts is not None else None
        self._alias: Alias | None = parts[1] if parts is not None else None
        self._compiled: dict[str, Any] = {}
        self._memo: ToolsMemo | None = None
        self.fast: bool = parts is not None
        """Whether renders skip `apply_chat_template` (its probe renders matched)."""
        if self.fast:
            mismatch = self._probe()
            if mismatch is not None:
                self.fast = False
                log.warning("chat template: rendering through apply_chat_template on every call (%s)", mismatch)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Any:
        """The prompt text for `messages` and `tools`, generation prompt added. Raises what the
        template raises (jinja2 errors, `raise_exception`)."""
        if not self.fast:
            return self._tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                       add_generation_prompt=True)
        compiled = self._template(self._tokenizer.get_chat_template(None, tools))
        assert self._alias is not None and self._memo is not None
        if tools:
            tools = self._memo.intern(tools)
        chat = self._alias([{k: v for k, v in m.items() if v is not None} for m in messages])
        return compiled.render(messages=chat, tools=tools, documents=None, add_generation_prompt=True,
                               **self._special)

    def _template(self, source: str) -> Any:
        """transformers' compiled template for `source`, in an overlay of its environment whose
        `tojson` is memoized (`ToolsMemo`); everything else (sandbox, globals) is transformers'."""
        compiled = self._compiled.get(source)
        if compiled is None:
            assert self._compile is not None
            env = self._compile(source).environment.overlay()
            env.filters = dict(env.filters)
            if self._memo is None:
                self._memo = ToolsMemo(env.filters["tojson"])
            env.filters["tojson"] = self._memo.tojson
            compiled = self._compiled[source] = env.from_string(source)
        return compiled

    def _probe(self) -> str | None:
        """None when every probe renders the same both ways; else what differed."""
        for i, (messages, tools) in enumerate(_PROBES):
            try:
                want: Any = self._tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                                add_generation_prompt=True)
            except Exception as e:  # the template refuses this probe (say, no tool role): so must we
                want = f"raised {type(e).__name__}"
            try:
                got: Any = self.render(messages, tools)
            except Exception as e:
                got = f"raised {type(e).__name__}"
            if got != want:
                return f"probe {i} rendered differently"
        return None
