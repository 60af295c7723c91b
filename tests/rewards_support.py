"""OpenClaw-shaped sessions recorded straight into a Store, for the rewards tests.

The shapes follow what OpenClaw sends through the proxy: the whole conversation every call, tools
declared, assistant tool calls with ids, one `tool` message per call, and side turns (titles)
with their own unrelated messages, marked `X-Turn-Type: side`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from clawbridge.store import Store, TurnRecord

SYSTEM = {"role": "system", "content": "You are OpenClaw, a personal agent. Use tools when useful."}
TOOLS = [
    {"type": "function", "function": {"name": "exec", "description": "run a shell command",
                                      "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "read", "description": "read a file",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
]


def call(cid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def assistant(content: str = "", calls: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = list(calls)
    return msg


def tool(cid: str, content: str, name: str = "") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": cid, "content": content, **({"name": name} if name else {})}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def record(store: Store, sid: str, messages: list[dict[str, Any]], answer: dict[str, Any], turn_type: str = "main",
           prompt: Sequence[int] = (1, 2, 3), completion: Sequence[int] = (4, 5, 6),
           logprobs: Sequence[float] | None = None, task_id: str | None = None,
           train_prompt: Sequence[int] | None = None) -> str:
    now = time.time()
    body = {"model": "tiny", "messages": messages, "tools": TOOLS}
    response = {"id": "chatcmpl-x", "object": "chat.completion", "model": "tiny",
                "choices": [{"index": 0, "message": answer,
                             "finish_reason": "tool_calls" if answer.get("tool_calls") else "stop"}]}
    turn = TurnRecord(
        session_id=sid, turn_type=turn_type, status="ok", model="tiny", prompt_token_ids=list(prompt),
        completion_token_ids=list(completion),
        completion_logprobs=list(logprobs) if logprobs is not None else [-0.5] * len(completion),
        policy_version=0, finish_reason="stop", request_json=json.dumps(body), response_json=json.dumps(response),
        created_at=now, completed_at=now, train_prompt_token_ids=None if train_prompt is None else list(train_prompt),
    )
    return store.record_turn(turn, "header")


def openclaw_session(store: Store, sid: str, end: bool = True, noted: bool = False) -> dict[str, str]:
    """main(tool calls x2) -> side(title) -> main(answer from both results) -> main(after a
    correction) -> side; the last main turn has no next state. Returns turn ids by name.
    `noted`: the answer turn was served with a note (prompt [1, 2, 3, 99], trains on [1, 2, 3])."""
    task = user("List the files in /tmp and show me notes.txt")
    calls = [call("call_ls", "exec", {"cmd": "ls /tmp"}), call("call_cat", "read", {"path": "/tmp/notes.txt"})]
    a1 = assistant("Let me look.", calls)
    h1 = [SYSTEM, task]
    ids = {"tools": record(store, sid, h1, a1)}
    ids["title"] = record(store, sid, [user("Write a 3-word title for: list files")], assistant("Listing tmp files"),
                          turn_type="side")
    results = [tool("call_ls", "notes.txt\na.log", "exec"), tool("call_cat", "buy milk", "read")]
    h2 = [*h1, a1, *results]
    a2 = assistant("/tmp has notes.txt and a.log; notes.txt says: buy milk.")
    ids["answer"] = record(store, sid, h2, a2, prompt=(1, 2, 3, 99), train_prompt=(1, 2, 3)) if noted else \
        record(store, sid, h2, a2)
    h3 = [*h2, a2, user("No, I only wanted the .txt files, sorted by name.")]
    a3 = assistant("Only .txt files: notes.txt")
    ids["fixed"] = record(store, sid, h3, a3)
    ids["memory"] = record(store, sid, [user("Summarize for memory")], assistant("user wants txt files"),
                           turn_type="side")
    if end:
        store.end_session(sid, "end_session")
    return ids
