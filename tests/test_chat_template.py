"""`clawbridge.chat.chat_template`: the fast render equals `apply_chat_template` text for text, and
falls back to it when it cannot be sure."""

from __future__ import annotations

import copy
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from clawbridge.chat import chat_template
from clawbridge.chat.chat_template import ChatTemplate
from clawbridge.chat.render import Renderer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from proxy_overhead import session_requests

THINKING_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{%- if m.thinking %}<think>{{ m.thinking }}</think>{% endif -%}"
    "{{ m.content }}<|im_end|>\n{%- endfor -%}"
    "{%- if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ eos_token }}"
)
"""Reads `thinking` (the name transformers aliases `reasoning_content` to) and a special token variable."""


def conversations() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """Requests as the renderer hands them to the template: the bench's 40 KB agent session, tool
    calls with nested nulls, reasoning, unicode, a developer turn."""
    out: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = []
    for body in session_requests(4, big=True)[::3]:
        out.append((body["messages"], body["tools"]))
    out.append(([{"role": "user", "content": "héllo ✓ \u2028 <|im_start|> {{ not jinja }}"}], None))
    out.append(([
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "find x"},
        {"role": "assistant", "content": "", "reasoning_content": "search first",
         "tool_calls": [{"type": "function", "id": "a", "function": {"name": "search",
                                                                     "arguments": {"q": "x", "limit": None}}}]},
        {"role": "tool", "content": json.dumps({"hits": []}), "tool_call_id": "a"},
        {"role": "user", "content": "and y?"},
    ], [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]))
    return out


def tokenizers(tiny_model_dir: Path, tiny_chatml_dir: Path) -> list[Any]:
    from transformers import AutoTokenizer

    toks = [AutoTokenizer.from_pretrained(str(d)) for d in (tiny_model_dir, tiny_chatml_dir)]
    thinking = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    thinking.chat_template = THINKING_TEMPLATE
    return [*toks, thinking]


def test_fast_render_equals_apply_chat_template(tiny_model_dir: Path, tiny_chatml_dir: Path) -> None:
    for tok in tokenizers(tiny_model_dir, tiny_chatml_dir):
        template = ChatTemplate(tok)
        assert template.fast, "the probes matched, so renders skip apply_chat_template"
        for messages, tools in conversations():
            before = copy.deepcopy((messages, tools))
            try:
                want = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # the template refuses (say, a developer role): the fast path must too
                with pytest.raises(type(e)):
                    template.render(messages, tools)
                continue
            assert template.render(messages, tools) == want
            assert (messages, tools) == before, "rendering never mutates its inputs"


def test_fast_render_equals_apply_chat_template_smollm2(smollm2_dir: Path) -> None:
    """The real model's template (SmolLM2-135M-Instruct's, tools written into the system message)."""
    r = Renderer.from_pretrained(str(smollm2_dir))
    assert r.template.fast
    for messages, tools in conversations():
        shown, template_tools = r.tool_style.prepare(
            [dict(m) for m in messages], tools)
        want = r.tokenizer.apply_chat_template(shown, tools=template_tools, tokenize=False, add_generation_prompt=True)
        assert r.template.render(shown, template_tools) == want


def test_thinking_is_aliased_like_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = THINKING_TEMPLATE
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"},
                {"role": "user", "content": "q2"}]
    text = ChatTemplate(tok).render(messages, None)
    assert text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    aliases = hasattr(importlib.import_module("transformers.utils.chat_template_utils"), "_alias_reasoning_fields")
    assert ("<think>r</think>" in text) == aliases


def test_a_mismatch_falls_back_to_apply_chat_template(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """When a probe renders differently (here: an aliasing that breaks the tool call turn), every
    render goes through apply_chat_template, and the log says so."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    parts = chat_template._transformers_parts()
    assert parts is not None
    compile_template, _ = parts

    def wrong_alias(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**m, "content": m.get("content", "") + "!"} for m in chat]

    monkeypatch.setattr(chat_template, "_transformers_parts", lambda: (compile_template, wrong_alias))
    template = ChatTemplate(tok)
    assert not template.fast
    assert "rendering through apply_chat_template" in caplog.text
    messages, tools = conversations()[-1]
    assert template.render(messages, tools) == tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True)


def test_renderer_ids_still_equal_whole_text_tokenization(tiny_model_dir: Path) -> None:
    r = Renderer.from_pretrained(str(tiny_model_dir))
    assert r.template.fast
    for messages, tools in conversations():
        prompt = r.render_prompt(messages, tools)
        assert prompt.ids == r.tokenizer(prompt.text, add_special_tokens=False).input_ids


def test_tools_memo_is_exact_for_values_that_look_alike(tiny_model_dir: Path) -> None:
    """The interned tools and their memoized `tojson` text: renders that hit the memo, tool lists
    that differ only in 1 / 1.0 / true, NaN / null, an int orjson cannot write, and a caller's list
    changed after it was rendered all render exactly as apply_chat_template renders them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    template = ChatTemplate(tok)
    messages = [{"role": "user", "content": "go"}]

    def tool(default: Any) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "default": default}}}]

    variants: list[list[dict[str, Any]]] = [tool(v) for v in (1, 1.0, True, None, float("nan"), 2**70, "1")]
    for _ in range(2):  # the second pass is served from the memo
        for tools in variants:
            assert template.render(messages, tools) == tok.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True)
    texts = {template.render(messages, t) for t in variants}
    assert len(texts) == len(variants), "every variant renders its own text"
    mutable = tool(3)
    first = template.render(messages, mutable)
    mutable[0]["function"]["name"] = "g"
    second = template.render(messages, mutable)
    assert first != second and '"name": "g"' in second
    assert second == tok.apply_chat_template(messages, tools=mutable, tokenize=False, add_generation_prompt=True)


def test_tools_memo_is_bounded(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from clawbridge.chat.chat_template import ToolsMemo

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    template = ChatTemplate(tok)
    for i in range(200):
        template.render([{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": f"t{i}"}}])
    memo = template._memo
    assert isinstance(memo, ToolsMemo)
    assert len(memo._lists) == memo.max_lists and len(memo._texts) == 2 * memo.max_lists
