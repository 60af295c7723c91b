"""Tokens sent to the trainer for one 20-turn OpenClaw-like session: one datum per turn (before)
versus one datum per session where each prompt extends the last (after, `clawbridge.trainer.merge`).

The session: a ~40 KB system prompt (an agent's instructions and workspace files), four tools,
three user requests and 20 model calls, most of them tool calls whose results come back as tool
messages. Every prompt is rendered by the product's `Renderer` with the tiny model's tokenizer and
chat template (built offline, `clawbridge.devtools.tinymodel`); each completion is the text the template
gives that assistant message, ending in the stop token as the proxy records it, and the client
sends back the message the proxy's parser returned (`Renderer.parse(...).to_openai()`), exactly
as an OpenAI client appends a reply to its history. Datums are then built from those ids by the
trainer's own `build_datums`, and the tokens counted are every position of every datum sent.

Scenarios (the same session):
- `echoes history`: the client sends each reply back as it got it (reasoning included).
- `drops reasoning`: the client leaves out `reasoning_content` (many OpenAI clients do), so every
  prompt differs from the previous prompt + completion where the reasoning was: a break per turn.
- `compacts at turn 11`: the client shortens its history once (OpenClaw compaction): one break.

Run (a few seconds):
    . .venv/bin/activate && python bench/session_merge.py
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clawbridge.chat.render import Renderer  # noqa: E402
from clawbridge.devtools.tinymodel import build_tiny_model  # noqa: E402
from clawbridge.trainer.merge import MergeStats, TurnPiece, build_datums  # noqa: E402

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": {arg: {"type": "string", "description": f"the {arg}"}},
                       "required": [arg]}}}
    for name, desc, arg in [
        ("read", "Read a file from the workspace.", "path"),
        ("write", "Write a file in the workspace.", "path"),
        ("exec", "Run a shell command in the workspace and return its output.", "command"),
        ("web_search", "Search the web and return the top results.", "query"),
    ]
]

USER_REQUESTS = [
    "The build of the blog is failing since this morning; find out why and fix it.",
    "Thanks. Now add a short post about the fix to the blog's drafts.",
    "Finally, check that the site still builds and tell me what changed.",
]


def system_prompt(target_bytes: int = 40_000) -> str:
    """An agent's instructions plus workspace files (AGENTS.md, TOOLS.md, MEMORY.md), ~target_bytes."""
    parts = ["You are a personal assistant running inside OpenClaw. Be concise, act through tools, and "
             "report what you changed.\n"]
    i = 0
    while sum(len(p) for p in parts) < target_bytes:
        i += 1
        parts.append(
            f"\n## Rule {i}: workspace conventions\n"
            f"- Files under notes/{i:03d}/ are the user's; never delete them without asking.\n"
            f"- Before running a command that changes the system, say what it will do (case {i}).\n"
            f"- Memory entry {i}: the user prefers short answers, ISO dates and metric units; the blog lives "
            f"in ~/site and builds with `make`; drafts go to ~/site/drafts/{i:03d}-title.md.\n"
        )
    return "".join(parts)


def assistant_text(k: int, request: int, final: bool) -> str:
    """The completion text for model call k (the template's form of an assistant message)."""
    reasoning = f"<think>\nCall {k}: step for request {request + 1}; next I use a tool.\n</think>\n\n"
    if final:
        return reasoning + f"Done with request {request + 1}: the build passes again after call {k}.<|im_end|>"
    name, arg = [("read", "path"), ("exec", "command"), ("write", "path"), ("web_search", "query")][k % 4]
    args = json.dumps({arg: f"~/site/step-{k}.txt" if arg == "path" else f"make -C ~/site check-{k}"})
    return reasoning + f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call><|im_end|>'


def tool_result(k: int) -> str:
    lines = [f"line {j}: output of step {k} (ok)" for j in range(12)]
    return "\n".join(lines)


def session_pieces(renderer: Renderer, scenario: str, turns: int = 20) -> list[TurnPiece]:
    """Render the session's model calls under `scenario`; one `TurnPiece` per call."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt()}]
    starts = {0: 0, 8: 1, 15: 2}  # call index -> the user request it starts with
    pieces: list[TurnPiece] = []
    request = 0
    for k in range(turns):
        if k in starts:
            request = starts[k]
            messages.append({"role": "user", "content": USER_REQUESTS[request]})
        if scenario == "compacts at turn 11" and k == 10:
            # compaction: the earlier exchanges become one summary message
            summary = {"role": "user", "content": "Summary so far: the build was fixed."}
            messages = [messages[0], summary, *messages[-2:]]
        prompt = renderer.render_prompt(messages, TOOLS)
        final = k + 1 in starts or k == turns - 1
        text = assistant_text(k, request, final)
        completion = renderer.encode(text)
        pieces.append(TurnPiece(f"turn_{k}", "session", prompt.ids, completion, [-1.0] * len(completion),
                                [0.1] * len(completion), 0))
        reply = renderer.parse(text, prompt).to_openai()
        if scenario == "drops reasoning":
            reply.pop("reasoning_content", None)
        messages.append(reply)
        for call in reply.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result(k)})
    return pieces


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--turns", type=int, default=20, help="model calls in the session (default 20)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        renderer = Renderer.from_pretrained(str(build_tiny_model(Path(tmp) / "tiny")))
        scenarios = ["echoes history", "drops reasoning", "compacts at turn 11"]
        print(f"one {args.turns}-call OpenClaw-like session, tiny model's tokenizer and chat template; "
              f"system prompt {len(system_prompt())} bytes")
        print(f"{'scenario':<22}{'datums':>8}{'merged':>8}{'breaks':>8}{'tokens before':>15}{'after':>10}{'ratio':>8}")
        for scenario in scenarios:
            pieces = session_pieces(renderer, scenario, args.turns)
            before_datums, before = build_datums(pieces, merge=False)
            after_datums, after = build_datums(pieces, merge=True)
            assert before.tokens_sent == after.tokens_unmerged
            assert sum(sum(d.mask) for d in before_datums) == sum(sum(d.mask) for d in after_datums)
            print(_row(scenario, before, after))
    return 0


def _row(scenario: str, before: MergeStats, after: MergeStats) -> str:
    ratio = before.tokens_sent / after.tokens_sent
    return (f"{scenario:<22}{after.datums:>8}{after.merged:>8}{after.breaks:>8}"
            f"{before.tokens_sent:>15}{after.tokens_sent:>10}{ratio:>7.1f}x")


if __name__ == "__main__":
    raise SystemExit(main())
