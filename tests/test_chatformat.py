"""Chat formats: chosen from the template; tools in the system message for templates without them;
forced calls; one parser (streaming == whole) per format; nothing in a request dropped."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from clawbridge.chat.chatformat import (
    TOOLS_PROMPT_HEAD,
    TOOLS_PROMPT_TAIL,
    ChatFormat,
    NativeTools,
    SystemPromptTools,
    stop_markers_for,
    tool_style_for,
)
from clawbridge.chat.parse import ForcedCall, ParsedMessage, StreamParser
from clawbridge.chat.render import Renderer

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "exec", "description": "Run a command",
                                      "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}},
]
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Look at a.txt and list the folder."},
    {"role": "assistant", "content": "Sure.", "reasoning_content": "Two calls.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "exec", "arguments": {"cmd": "ls"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "hello"},
    {"role": "tool", "tool_call_id": "call_2", "content": "a.txt b.txt"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_3", "type": "function", "function": {"name": "exec", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_3", "content": "ok"},
    {"role": "user", "content": "Thanks."},
]


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir: Path) -> Renderer:
    return Renderer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def plain(tiny_chatml_dir: Path) -> Renderer:
    return Renderer.from_pretrained(str(tiny_chatml_dir))


@pytest.fixture(params=["qwen3", "plain"])
def fmt(request: pytest.FixtureRequest) -> Renderer:
    r = request.getfixturevalue(request.param)
    assert isinstance(r, Renderer)
    return r


def test_format_is_chosen_from_the_template(qwen3: Renderer, plain: Renderer) -> None:
    formats: list[ChatFormat] = [qwen3, plain]  # both satisfy the protocol the proxy holds
    assert [f.format_name for f in formats] == ["qwen3", "plain"]
    assert qwen3.capabilities.native_tools and qwen3.capabilities.reasoning
    assert not plain.capabilities.native_tools and not plain.capabilities.reasoning
    vocab = plain.tokenizer.get_vocab()
    assert plain.stop_markers == ("<|im_end|>", "<|endoftext|>")
    assert plain.stop_token_ids == (vocab["<|im_end|>"], vocab["<|endoftext|>"])
    assert "tools in the system message" in plain.describe() and "native tools" in qwen3.describe()


def test_tool_style_and_stop_markers_of_other_families() -> None:
    """Only a template that writes Hermes `<tool_call>` blocks gets tools natively; a Llama-3-style
    template with its own tool syntax gets them in the system message, in the grammar we parse."""
    llama_like = ("{% if tools %}Environment: ipython{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
                  "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}"
                  "<|eot_id|>{% endfor %}")
    assert isinstance(tool_style_for(llama_like), SystemPromptTools)
    assert isinstance(tool_style_for("{% for t in tools %}<tool_call>{% endfor %}"), NativeTools)
    assert stop_markers_for({"<|eot_id|>": 7, "<|end_of_text|>": 8, "x": 1}, "<|end_of_text|>") == (
        "<|eot_id|>", "<|end_of_text|>")
    assert stop_markers_for({"</s>": 2}, "</s>") == ("</s>",)
    assert stop_markers_for({"a": 1}, None) == ()


def test_plain_template_gets_tools_in_its_system_message(plain: Renderer) -> None:
    text = plain.render_text([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], TOOLS)
    tools_lines = "".join("\n" + json.dumps(t) for t in TOOLS)
    assert text == ("<|im_start|>system\nS\n\n" + TOOLS_PROMPT_HEAD + tools_lines + TOOLS_PROMPT_TAIL
                    + "<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    # Without a system message, the tools make one (in place of the template's default).
    text = plain.render_text([{"role": "user", "content": "U"}], TOOLS)
    assert text.startswith("<|im_start|>system\n" + TOOLS_PROMPT_HEAD) and "helpful assistant" not in text
    # Without tools the template is used as it is.
    assert plain.render_text([{"role": "user", "content": "U"}]).startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_plain_format_writes_what_the_qwen3_template_writes(qwen3: Renderer, plain: Renderer) -> None:
    """Tools, calls (two forms of arguments), results and reasoning: the documented text format is
    the Qwen3 template's own, so nothing of the request is dropped and one grammar parses both."""
    assert plain.render_text(HISTORY, TOOLS) == qwen3.render_text(HISTORY, TOOLS)
    forced = {"type": "function", "function": {"name": "exec"}}
    assert plain.render_text(HISTORY, TOOLS, forced) == qwen3.render_text(HISTORY, TOOLS, forced)


def test_next_turn_prompt_extends_previous_prompt_and_completion(fmt: Renderer) -> None:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "S"}, {"role": "user", "content": "go"}]
    completions = [
        'Running.\n<tool_call>\n{"name": "exec", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>',
        "<think>\nok\n</think>\n\nAll done.<|im_end|>",
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "x"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "exec", "arguments": {"cmd": "pwd"}}\n</tool_call><|im_end|>',
    ]
    for completion in completions:
        prompt = fmt.render_prompt(msgs, TOOLS)
        parsed = fmt.parse(completion, prompt).to_openai()
        msgs = [*msgs, parsed]
        for call in parsed.get("tool_calls", []):
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": "out"})
        if not parsed.get("tool_calls"):
            msgs.append({"role": "user", "content": "next"})
        assert fmt.render_text(msgs, TOOLS).startswith(prompt.text + completion + "\n"), completion


def test_forced_call_renders_its_opening_and_parses_back(fmt: Renderer) -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "list it"}]
    prompt = fmt.render_prompt(msgs, TOOLS, {"type": "function", "function": {"name": "exec"}})
    assert prompt.forced == ForcedCall("exec")
    assert prompt.text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "exec", "arguments":')
    assert prompt.ids == list(fmt.tokenizer(prompt.text, add_special_tokens=False).input_ids)
    assert '"read_file"' not in prompt.text  # only the forced tool is shown
    good = fmt.parse(' {"cmd": "ls -l"}}\n</tool_call> Done.<|im_end|>', prompt)
    assert [(c.name, json.loads(c.arguments)) for c in good.tool_calls] == [("exec", {"cmd": "ls -l"})]
    assert good.content == " Done."
    # Whatever the model writes, the answer is a call to the forced function; invalid JSON arguments
    # come back as the text written (as OpenAI does), a truncated call too.
    bad = fmt.parse(" {cmd: ls}}\n</tool_call><|im_end|>", prompt)
    assert [(c.name, c.arguments) for c in bad.tool_calls] == [("exec", "{cmd: ls}")] and bad.content is None
    cut = fmt.parse(' {"cmd": "l', prompt)
    assert [(c.name, c.arguments) for c in cut.tool_calls] == [("exec", '{"cmd": "l')]
    # The same call, re-rendered in the history, is the prompt + the completion.
    completion = ' {"cmd": "ls -l"}}\n</tool_call><|im_end|>'
    parsed = fmt.parse(completion, prompt).to_openai()
    nxt = fmt.render_text([*msgs, parsed, {"role": "tool", "tool_call_id": parsed["tool_calls"][0]["id"],
                                           "content": "x"}], [TOOLS[1]])
    assert nxt.startswith(prompt.text + completion + "\n")


def _stream(parser: StreamParser, pieces: list[str]) -> ParsedMessage:
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
    return ParsedMessage.from_deltas(deltas)


def _key(m: ParsedMessage) -> tuple[Any, ...]:
    return m.content, m.reasoning_content, [(c.name, c.arguments) for c in m.tool_calls]


@pytest.mark.parametrize("forced", [False, True])
def test_streaming_parse_equals_whole_parse_for_any_split(fmt: Renderer, forced: bool) -> None:
    choice = {"type": "function", "function": {"name": "exec"}} if forced else "auto"
    prompt = fmt.render_prompt([{"role": "user", "content": "go"}], TOOLS, choice)
    texts = [
        ' {"cmd": "ls"}}\n</tool_call>\nthen <tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call><|im_end|>',
        "<think>\nhmm\n</think>\n\nplain answer <tool_call> not closed<|im_end|><|endoftext|>",
        ' {"cmd": "x"\n</tool_call>',
        "",
        "<|im_end|>",
        "a <|im_end|> b",
    ]
    rng = random.Random(3)
    for text in texts:
        whole = fmt.parse(text, prompt)
        for _ in range(30):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(0, 6))))
            pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            assert _key(_stream(fmt.parser(prompt), pieces)) == _key(whole), (text, pieces)
        if forced:
            assert whole.tool_calls and whole.tool_calls[0].name == "exec"


def test_end_strings_stop_after_themselves_for_any_split() -> None:
    from clawbridge.proxy.stops import StopMatcher

    text = 'a <tool_call>\n{"name": "f"}\n</tool_call>\n<tool_call>more'
    rng = random.Random(5)
    for stops, want in (([], 'a <tool_call>\n{"name": "f"}\n</tool_call>'), (["f"], 'a <tool_call>\n{"name": "')):
        for _ in range(50):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, 8)))
            matcher, out, hit = StopMatcher(stops, ends=["</tool_call>"]), "", False
            for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True):
                piece, hit = matcher.push(text[i:j])
                out += piece
                if hit:
                    break
            assert hit and out == want, (stops, cuts)
