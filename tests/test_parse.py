"""parse_completion, StreamParser (split-invariant) and IncrementalDecoder (UTF-8 safe, exact)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from clawbridge.chat.parse import Delta, IncrementalDecoder, ParsedMessage, StreamParser, parse_completion
from clawbridge.chat.render import Renderer

CALL = '<tool_call>\n{"name": "exec", "arguments": {"cmd": "ls -la", "n": 2}}\n</tool_call>'


def test_plain_content_and_stop_markers() -> None:
    assert parse_completion("Hello there.<|im_end|>") == ParsedMessage("Hello there.", None, [])
    assert parse_completion("Hi<|im_end|><|endoftext|>").content == "Hi"
    assert parse_completion("<|im_end|>").content is None
    # Only trailing markers are end-of-turn; one in the middle stays text.
    assert parse_completion("a<|im_end|>b").content == "a<|im_end|>b"


def test_think_and_content() -> None:
    p = parse_completion("<think>\nI should greet.\n</think>\n\nHello!<|im_end|>")
    assert p.reasoning_content == "I should greet."
    assert p.content == "Hello!"
    assert p.tool_calls == []
    # Unclosed think (ran out of tokens): all reasoning.
    p = parse_completion("<think>\nstill thinking")
    assert p.reasoning_content == "still thinking" and p.content is None
    # Empty think block.
    p = parse_completion("<think>\n\n</think>\n\nAnswer")
    assert p.reasoning_content is None and p.content == "Answer"
    # A think tag later in the text is just text.
    assert parse_completion("x <think>y</think>").content == "x <think>y</think>"


def test_tool_calls() -> None:
    text = (
        "<think>\nneed ls\n</think>\n\nLet me check.\n"
        + CALL
        + "\n"
        + CALL.replace("exec", "read_file")
        + "<|im_end|>"
    )
    p = parse_completion(text)
    assert p.reasoning_content == "need ls"
    assert p.content == "Let me check."
    assert [c.name for c in p.tool_calls] == ["exec", "read_file"]
    assert json.loads(p.tool_calls[0].arguments) == {"cmd": "ls -la", "n": 2}
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in p.tool_calls)
    assert len({c.id for c in p.tool_calls}) == 2
    msg = p.to_openai()
    assert msg["role"] == "assistant"
    assert msg["tool_calls"][0] == {
        "id": p.tool_calls[0].id,
        "type": "function",
        "function": {"name": "exec", "arguments": p.tool_calls[0].arguments},
    }
    only = parse_completion(CALL + "<|im_end|>")
    assert only.content is None and len(only.tool_calls) == 1
    assert only.to_openai()["content"] is None


def test_tool_call_argument_forms() -> None:
    def args(body: str) -> str:
        (call,) = parse_completion(f"<tool_call>{body}</tool_call>").tool_calls
        return call.arguments

    assert args('{"name": "f"}') == "{}"
    assert args('{"name": "f", "arguments": "{\\"a\\": 1}"}') == '{"a": 1}'
    assert args('{"name": "f", "parameters": {"a": "中"}}') == '{"a": "中"}'
    assert args('\n  {"name":"f","arguments":{}}  \n') == "{}"


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>',
        '<tool_call>\n["exec"]\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": "exec", "arguments": {"cmd": "ls"}}',
        "<tool_call>",
    ],
)
def test_malformed_tool_call_is_content(bad: str) -> None:
    p = parse_completion("Before " + bad + "<|im_end|>")
    assert p.tool_calls == []
    assert p.content == "Before " + bad


def test_malformed_between_good_calls() -> None:
    bad = "<tool_call>{oops}</tool_call>"
    p = parse_completion(CALL + bad + CALL)
    assert len(p.tool_calls) == 2
    assert p.content == bad


# --------------------------------------------------------------------------------------------
# StreamParser == parse_completion for any split


def _stream(pieces: list[str]) -> tuple[str | None, str | None, list[tuple[int, str, str]], list[Delta]]:
    sp = StreamParser()
    deltas: list[Delta] = []
    for piece in pieces:
        deltas += sp.feed(piece)
    deltas += sp.finish()
    content = "".join(d.text for d in deltas if d.kind == "content") or None
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning") or None
    calls = [
        (d.index, d.tool_call.name, d.tool_call.arguments)
        for d in deltas
        if d.kind == "tool_call" and d.tool_call
    ]
    return content, reasoning, calls, deltas


def _random_splits(text: str, rng: random.Random) -> list[str]:
    mode = rng.random()
    if mode < 0.3:
        return list(text)
    cuts = (
        sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
        if len(text) > 1
        else []
    )
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _random_completion(rng: random.Random) -> str:
    atoms = [
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<|im_end|>",
        "<|endoftext|>",
        "<",
        "</",
        "<|im_",
        "\n",
        "\n\n",
        " ",
        "  ",
        "Hello",
        "world.",
        "中文",
        "🦀",
        CALL,
        '{"name": "x"}',
        "{bad",
        "thi",
        "nk>",
        '<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}</tool_call>',
    ]
    parts = []
    if rng.random() < 0.5:
        parts.append(rng.choice(["", "\n", " "]) + "<think>\n")
    parts += [rng.choice(atoms) for _ in range(rng.randint(0, 14))]
    if rng.random() < 0.6:
        parts.append(rng.choice(["<|im_end|>", "<|endoftext|>", "<|im_end|><|endoftext|>"]))
    return "".join(parts)


REALISTIC = [
    "<think>\nThe user wants files.\n</think>\n\nSure, listing.\n" + CALL + "<|im_end|>",
    "<think>\n\n</think>\n\nJust text, with <b>html</b> and a < sign.<|im_end|>",
    CALL + "\n" + CALL + "<|im_end|>",
    "No end marker, cut by max_tokens <tool_ca",
    "  \n<think>\nabc</think>x<|im_end|>",
    "text <|im_end|> more text<|im_end|>",
    "Before <tool_call>{broken</tool_call> after<|im_end|>",
    "<think>\nunclosed reasoning <|im_end|>",
    "emoji 🦀 and 中文\n\n<|im_end|>",
]


def test_stream_matches_parse_for_random_splits() -> None:
    rng = random.Random(1234)
    texts = REALISTIC + [_random_completion(rng) for _ in range(400)]
    for text in texts:
        expected = parse_completion(text)
        exp_calls = [(i, c.name, c.arguments) for i, c in enumerate(expected.tool_calls)]
        for _ in range(15):
            content, reasoning, calls, _ = _stream(_random_splits(text, rng))
            assert (content, reasoning, calls) == (expected.content, expected.reasoning_content, exp_calls), (
                repr(text)
            )


def test_stream_emits_early_and_holds_markers() -> None:
    sp = StreamParser()
    assert sp.feed("<thi") == []  # could still be <think>
    assert sp.feed("nk>\nplan") == [Delta("reasoning", "plan")]
    assert sp.feed("ning\n</th") == [Delta("reasoning", "ning")]  # "\n" and "</th" held
    assert sp.feed("ink>\n\nHi") == [Delta("content", "Hi")]
    assert sp.feed(" there<tool") == [Delta("content", " there")]
    assert sp.feed("_call>") == []
    out = sp.feed('{"name": "f", "arguments": {}}</tool_call>')
    assert len(out) == 1 and out[0].kind == "tool_call" and out[0].index == 0
    assert out[0].tool_call is not None and out[0].tool_call.name == "f"
    assert sp.feed("<|im_") == []
    assert sp.feed("end|>") == []
    assert sp.finish() == []
    with pytest.raises(RuntimeError):
        sp.feed("x")


def test_stream_releases_false_markers() -> None:
    sp = StreamParser()
    assert sp.feed("a <|im_e") == [Delta("content", "a ")]
    assert sp.feed("x") == [Delta("content", "<|im_ex")]
    assert sp.finish() == []


# --------------------------------------------------------------------------------------------
# IncrementalDecoder


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> Renderer:
    return Renderer.from_pretrained(str(tiny_model_dir))


TEXTS = [
    "Hello, world!",
    "emoji 🦀🧠👍🏽👨‍👩‍👧 mixed with CJK 中文字符测试 and 한국어 and ελληνικά",
    '<think>\n推理 🤔\n</think>\n\n答案<tool_call>\n{"name": "f"}\n</tool_call><|im_end|>',
    "\ufffd literal replacement char in the text \ufffd",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 astral plane",
]


def test_incremental_decoder_is_exact(renderer: Renderer) -> None:
    tok = renderer.tokenizer
    rng = random.Random(3)
    texts = TEXTS + [
        "".join(
            chr(
                rng.choice([rng.randint(0x4E00, 0x9FFF), rng.randint(0x1F300, 0x1FAFF), rng.randint(32, 126)])
            )
            for _ in range(60)
        )
        for _ in range(30)
    ]
    for text in texts:
        ids = tok(text, add_special_tokens=False).input_ids
        dec = IncrementalDecoder(renderer.decode)
        pieces = [dec.push(i) for i in ids]
        pieces.append(dec.flush())
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=False) == text
        assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_incremental_decoder_holds_split_characters(renderer: Renderer) -> None:
    tok = renderer.tokenizer
    # "🦀" is 4 UTF-8 bytes; the tiny vocab has no token for it, so it spans several byte tokens.
    ids = tok("🦀", add_special_tokens=False).input_ids
    assert len(ids) > 1
    dec = IncrementalDecoder(renderer.decode)
    outs = [dec.push(i) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1)
    assert outs[-1] == "🦀"
    assert dec.flush() == ""
    # An incomplete character at the end comes out (as U+FFFD) only on flush.
    dec2 = IncrementalDecoder(renderer.decode)
    assert dec2.push(ids[0]) == ""
    assert dec2.flush() == renderer.decode(ids[:1])


def test_incremental_decoder_window_stays_small(renderer: Renderer) -> None:
    ids = renderer.tokenizer("word " * 2000, add_special_tokens=False).input_ids
    calls: list[int] = []

    def decode(window: list[int]) -> str:
        calls.append(len(window))
        return renderer.decode(window)

    dec = IncrementalDecoder(decode)
    text = "".join(dec.push(t) for t in ids) + dec.flush()
    assert text == "word " * 2000
    assert max(calls) <= 4  # never re-decodes the whole sequence
