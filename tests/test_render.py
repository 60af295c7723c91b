"""Renderer: chat template output, OpenAI normalization, errors, and exact segmented tokenization."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from clawbridge.chat.parse import parse_completion
from clawbridge.chat.render import Renderer, RenderError, SegmentCache, ToolChoiceError
from clawbridge.devtools.tinymodel import SPECIAL_TOKENS

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> Renderer:
    return Renderer.from_pretrained(str(tiny_model_dir))


def _tool(name: str, desc: str = "Does a thing.") -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }


def _full_ids(r: Renderer, text: str) -> list[int]:
    return list(r.tokenizer(text, add_special_tokens=False).input_ids)


# --------------------------------------------------------------------------------------------
# Template text


def test_system_user_generation_prompt(renderer: Renderer) -> None:
    text = renderer.render_text(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_no_system_message(renderer: Renderer) -> None:
    text = renderer.render_text([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_developer_renders_as_system(renderer: Renderer) -> None:
    dev = renderer.render_text(
        [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "Hi"}]
    )
    sys_ = renderer.render_text([{"role": "system", "content": "Rules."}, {"role": "user", "content": "Hi"}])
    assert dev == sys_
    later = renderer.render_text(
        [
            {"role": "user", "content": "Hi"},
            {"role": "developer", "content": "Note."},
            {"role": "user", "content": "x"},
        ]
    )
    assert "<|im_start|>system\nNote.<|im_end|>\n" in later
    assert "developer" not in later


def test_tools_section(renderer: Renderer) -> None:
    tools = [_tool("read_file"), _tool("exec")]
    text = renderer.render_text(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], tools=tools
    )
    tool_lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    assert text == (
        "<|im_start|>system\nS\n\n"
        + TOOLS_HEADER
        + tool_lines
        + TOOLS_FOOTER
        + "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )
    # Without a system message the tools still get a system turn.
    text2 = renderer.render_text([{"role": "user", "content": "U"}], tools=tools)
    assert text2.startswith("<|im_start|>system\n" + TOOLS_HEADER)


def test_tool_choice(renderer: Renderer) -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    tools = [_tool("read_file"), _tool("exec"), _tool("web_search")]
    assert renderer.render_text(msgs, tools, "none") == renderer.render_text(msgs)
    for choice in ("auto", None):
        assert renderer.render_text(msgs, tools, choice) == renderer.render_text(msgs, tools)
    # A named function: only that tool is shown, and the prompt ends with the opening of its call.
    named = renderer.render_prompt(msgs, tools, {"type": "function", "function": {"name": "exec"}})
    assert named.forced is not None and named.forced.name == "exec"
    assert named.text == renderer.render_text(msgs, [tools[1]]) + '<tool_call>\n{"name": "exec", "arguments":'
    assert named.ids == _full_ids(renderer, named.text)
    assert '"read_file"' not in named.text
    # "required" with one tool forces that tool.
    assert renderer.render_text(msgs, [tools[1]], "required") == named.text
    with pytest.raises(ToolChoiceError, match="not in 'tools'"):
        renderer.render(msgs, tools, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ToolChoiceError, match="cannot be enforced with 3 tools"):
        renderer.render(msgs, tools, "required")
    for bogus in ("sometimes", 3, ["auto"]):
        with pytest.raises(ToolChoiceError, match="tool_choice must be"):
            renderer.render(msgs, tools, bogus)  # type: ignore[arg-type]
        with pytest.raises(ToolChoiceError, match="tool_choice must be"):
            renderer.render(msgs, None, bogus)  # type: ignore[arg-type]
    with pytest.raises(ToolChoiceError, match="needs at least one tool"):
        renderer.render(msgs, None, "required")
    with pytest.raises(ToolChoiceError, match="not in 'tools'"):
        renderer.render(msgs, [], {"type": "function", "function": {"name": "exec"}})
    # allowed_tools: only the listed tools are shown; "required" over one of them forces it.
    def allowed(mode: str, *names: str) -> dict[str, Any]:
        return {"type": "allowed_tools",
                "allowed_tools": {"mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}

    assert renderer.render_text(msgs, tools, allowed("auto", "exec", "read_file")) == renderer.render_text(
        msgs, [tools[0], tools[1]])
    assert renderer.render_text(msgs, tools, allowed("required", "exec")) == named.text
    with pytest.raises(ToolChoiceError, match="cannot be enforced with 2 tools"):
        renderer.render(msgs, tools, allowed("required", "exec", "read_file"))
    with pytest.raises(ToolChoiceError, match=r"names \['nope'\], not in 'tools'"):
        renderer.render(msgs, tools, allowed("auto", "nope"))
    with pytest.raises(ToolChoiceError, match="mode must be"):
        renderer.render(msgs, tools, allowed("sometimes", "exec"))
    with pytest.raises(ToolChoiceError, match="'custom' is not supported"):
        renderer.render(msgs, tools, {"type": "custom", "custom": {"name": "exec"}})


def test_assistant_reasoning_and_tool_calls(renderer: Renderer) -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "List it"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "\nThe user wants a listing.\n",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "exec", "arguments": '{"cmd": "ls"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": {"path": "a.txt"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "hello"}]},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks"},
    ]
    text = renderer.render_text(msgs)
    assert text == (
        "<|im_start|>user\nList it<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nThe user wants a listing.\n</think>\n\nLet me look.\n"
        '<tool_call>\n{"name": "exec", "arguments": {"cmd": "ls"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n<tool_response>\nhello\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nDone.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tool_call_arguments_forms(renderer: Renderer) -> None:
    def one(args: Any, content: Any = None) -> str:
        msgs = [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}],
            },
        ]
        text = renderer.render_text(msgs)
        return text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]

    assert one({"a": 1}) == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert one('{"a":1}') == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    # Not JSON: passed through verbatim rather than rejected.
    assert one("not json") == '<tool_call>\n{"name": "f", "arguments": not json}\n</tool_call>'
    assert one("") == '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert one({"s": "ünï 中"}) == '<tool_call>\n{"name": "f", "arguments": {"s": "ünï 中"}}\n</tool_call>'
    assert (
        one({"a": 1}, content="Sure.")
        == 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )


def test_content_parts_and_null(renderer: Renderer) -> None:
    parts = renderer.render_text(
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert parts == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    null = renderer.render_text([{"role": "user", "content": "q"}, {"role": "assistant", "content": None}])
    assert null.endswith("<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n")


def test_input_not_mutated(renderer: Renderer) -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "developer", "content": [{"type": "text", "text": "d"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
    ]
    before = json.dumps(msgs)
    renderer.render(msgs, [_tool("f")], "none")
    assert json.dumps(msgs) == before


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "wizard", "content": "x"}], "unknown role"),
        ([{"content": "x"}], "unknown role"),
        (
            [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c"}],
            "tool message needs 'content'",
        ),
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], "must be an object"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "not supported"),
        ([{"role": "user", "content": 5}], "content must be"),
        (
            [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            "function name",
        ),
        ([{"role": "assistant", "content": "", "reasoning_content": 3}], "reasoning_content"),
    ],
)
def test_render_errors(renderer: Renderer, messages: Any, match: str) -> None:
    with pytest.raises(RenderError, match=match):
        renderer.render(messages)
    assert issubclass(RenderError, ValueError)


def test_template_error_becomes_render_error(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    tok.chat_template = "{{ raise_exception('no tools here') }}"
    r = Renderer(tok)
    with pytest.raises(RenderError, match="no tools here"):
        r.render([{"role": "user", "content": "x"}])
    tok.chat_template = "{% for m in messages %}{{ m.content + 1 }}{% endfor %}"
    with pytest.raises(RenderError, match="chat template failed"):
        Renderer(tok).render([{"role": "user", "content": "x"}])


def test_stop_tokens_and_decode(renderer: Renderer) -> None:
    vocab = renderer.tokenizer.get_vocab()
    assert renderer.stop_token_ids == (vocab["<|im_end|>"], vocab["<|endoftext|>"])
    ids = renderer.render([{"role": "user", "content": "héllo 🦀"}])
    assert renderer.decode(ids) == "<|im_start|>user\nhéllo 🦀<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == vocab["<|im_start|>"]


def test_next_turn_prompt_extends_previous_prompt_and_completion(renderer: Renderer) -> None:
    """Re-rendering a parsed completion reproduces its text: prompts grow append-only."""
    tools = [_tool("exec")]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "S"}, {"role": "user", "content": "go"}]
    completions = [
        '<think>\nplan it\n</think>\n\nRunning.\n<tool_call>\n{"name": "exec", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>',
        "<think>\nok\n</think>\n\nAll done.<|im_end|>",
        '<tool_call>\n{"name": "exec", "arguments": {"cmd": "pwd", "n": [1, 2]}}\n</tool_call><|im_end|>',
    ]
    for completion in completions:
        prompt = renderer.render_text(msgs, tools)
        parsed = parse_completion(completion).to_openai()
        msgs = [*msgs, parsed]
        if parsed.get("tool_calls"):
            msgs.append({"role": "tool", "tool_call_id": parsed["tool_calls"][0]["id"], "content": "out"})
        else:
            msgs.append({"role": "user", "content": "next"})
        nxt = renderer.render_text(msgs, tools)
        assert nxt.startswith(prompt + completion + "\n"), completion


# --------------------------------------------------------------------------------------------
# Segmented tokenization == whole-text tokenization


def _random_text(rng: random.Random) -> str:
    pieces = [
        *SPECIAL_TOKENS,
        "<|im_start|>assistant\n",
        "<",
        "|",
        "<|im_",
        "think>",
        "</",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "Hello",
        " world",
        "中文",
        "🦀",
        "é",
        "e\u0301",
        '{"a": 1}',
        "'s",
        "123",
        "  \n",
        "tool_call",
    ]
    out = []
    for _ in range(rng.randint(0, 40)):
        r = rng.random()
        if r < 0.6:
            out.append(rng.choice(pieces))
        else:
            out.append(
                "".join(
                    chr(
                        rng.choice(
                            [rng.randint(9, 126), rng.randint(0xA0, 0x3000), rng.randint(0x1F300, 0x1F9FF)]
                        )
                    )
                    for _ in range(rng.randint(1, 12))
                )
            )
    return "".join(out)


def test_segmented_equals_full_tokenization_random(renderer: Renderer) -> None:
    rng = random.Random(7)
    for _ in range(1500):
        text = _random_text(rng)
        assert renderer.encode(text) == _full_ids(renderer, text), repr(text)


def test_segmented_equals_full_tokenization_realistic(renderer: Renderer) -> None:
    system = openclaw_system_prompt(random.Random(3))
    tools = [_tool(f"tool_{i}", "Run something. " * 30) for i in range(12)]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}]
    rng = random.Random(11)
    for turn in range(8):
        msgs.append(
            {
                "role": "user",
                "content": f"Turn {turn}: "
                + " ".join(rng.choice(["fix", "the", "bug", "über", "😀", "中"]) for _ in range(30)),
            }
        )
        text = renderer.render_text(msgs, tools)
        ids = renderer.render(msgs, tools)
        assert ids == _full_ids(renderer, text)
        msgs.append(
            {
                "role": "assistant",
                "content": f"ok {turn}",
                "reasoning_content": "thinking " * turn,
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "tool_1", "arguments": json.dumps({"turn": turn})},
                    }
                ],
            }
        )
        msgs.append({"role": "tool", "tool_call_id": "c", "content": "line\n" * rng.randint(1, 50)})


def test_cache_is_used_and_bounded(tiny_model_dir: Path) -> None:
    r = Renderer.from_pretrained(str(tiny_model_dir))
    msgs = [{"role": "system", "content": "A long system prompt. " * 100}, {"role": "user", "content": "hi"}]
    first = r.render(msgs)
    misses = r.cache.misses
    assert r.render(msgs) == first
    assert r.cache.misses == misses  # everything came from the cache the second time
    small = Renderer(r.tokenizer, cache=SegmentCache(max_entries=3, max_chars=100))
    rng = random.Random(5)
    for _ in range(50):
        text = _random_text(rng)
        assert small.encode(text) == _full_ids(small, text)
        assert len(small.cache) <= 3
        assert small.cache._chars <= 100


# --------------------------------------------------------------------------------------------
# Size and speed of an OpenClaw-sized request


def openclaw_system_prompt(rng: random.Random, target_chars: int = 40_000) -> str:
    """A ~40 KB agent system prompt shaped like OpenClaw's (sections, tool notes, skills, files)."""
    words = [
        "the",
        "you",
        "your",
        "tool",
        "file",
        "workspace",
        "session",
        "memory",
        "must",
        "never",
        "always",
        "when",
        "user",
        "reply",
        "message",
        "channel",
        "skill",
        "run",
        "command",
        "read",
        "write",
        "edit",
        "search",
        "browser",
        "cron",
        "heartbeat",
        "safety",
        "follow",
        "instructions",
        "before",
        "after",
        "output",
        "error",
        "result",
        "path",
        "project",
        "context",
        "model",
        "agent",
    ]
    parts = ["You are a personal assistant running inside OpenClaw.\n"]
    sections = ["Tooling", "Safety", "Skills", "Memory", "Workspace", "Messaging", "Heartbeats", "Runtime"]
    i = 0
    while sum(map(len, parts)) < target_chars:
        parts.append(f"\n## {sections[i % len(sections)]} {i}\n")
        for _ in range(rng.randint(3, 8)):
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 20)))
            parts.append(f"- {sentence.capitalize()}.\n")
        if i % 3 == 0:
            parts.append(
                f"```json\n{json.dumps({'path': f'~/workspace/file_{i}.md', 'mode': 'read', 'limit': i})}\n```\n"
            )
        i += 1
    return "".join(parts)[:target_chars]


def test_openclaw_sized_prompt_token_count(renderer: Renderer) -> None:
    system = openclaw_system_prompt(random.Random(0))
    assert len(system.encode()) >= 39_000
    tools = [
        _tool(f"tool_{i}", "Run a command in the workspace and return its output. " * 8) for i in range(12)
    ]
    ids = renderer.render([{"role": "system", "content": system}, {"role": "user", "content": "hi"}], tools)
    print(f"\n40 KB system prompt + 12 tools -> {len(ids)} tokens")
    assert 2_000 < len(ids) < 20_000


def test_render_of_a_growing_session_tokenizes_only_new_text(tiny_model_dir: Path) -> None:
    """What keeps a 40 KB prompt cheap: each request of a session tokenizes only its new messages.

    The time this saves is measured by bench/proxy_overhead.py (not here: timings are not tests).
    """
    r = Renderer.from_pretrained(str(tiny_model_dir))
    system = openclaw_system_prompt(random.Random(0))
    tools = [
        _tool(f"tool_{i}", "Run a command in the workspace and return its output. " * 8) for i in range(12)
    ]
    session: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    r.render(session, tools)
    big = max(r.segments(r.render_text(session, tools)), key=len)
    assert len(big) > 30_000  # the system prompt and tools are one segment, cached after the first call
    from transformers import AutoTokenizer

    whole = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    for k in range(30):
        session = [
            *session,
            {"role": "assistant", "content": f"answer {k}"},
            {"role": "user", "content": f"question {k}"},
        ]
        misses, hits = r.cache.misses, r.cache.hits
        ids = r.render(session, tools)
        new_segments = r.cache.misses - misses
        assert 1 <= new_segments <= 6, f"request {k} tokenized {new_segments} segments"
        assert r.cache.hits - hits >= 2 * k + 2  # the system prompt and every older message
        if k % 10 == 9:  # the cached path gives exactly what tokenizing the whole text gives
            text = r.render_text(session, tools)
            assert ids == whole(text, add_special_tokens=False).input_ids
