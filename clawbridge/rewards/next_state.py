"""Next state: what came after a main turn in its session (pure functions).

The next state of main turn T is read from the request of the NEXT MAIN turn N of the same session
(agents resend the whole conversation each call): the messages in N's request that follow T's
own assistant message, up to the next assistant message. Those are
- the tool results that answered T's tool calls (ALL of them, in order), and/or
- the next user message.

Rules:
- Side turns (X-Turn-Type: side: titles, memory, summaries) are never a next state and never have
  one: they are skipped when looking for N.
- T's assistant message is located in N's messages at the position right after T's own request
  messages when N's history extends T's (the normal append-only case); otherwise (history edited,
  compacted) at the last assistant message whose tool call ids or text match T's answer, else the
  last assistant message. Nothing found: the messages after the common prefix.
- A main turn with no later main turn (the session ended) has NO next state. So does one whose
  following messages are empty.
- Recorded requests and answers of every API are read in the OpenAI shape
  (`clawbridge.shapes.recorded`), so `tool_result` blocks and `function_call_output` items are
  `tool` messages.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from clawbridge.chat.content import loose_text as text_of
from clawbridge.shapes.recorded import answer_message, openai_view

NextKind = Literal["user", "tool", "tool+user"]


@dataclass(frozen=True)
class TurnView:
    """One recorded turn in OpenAI shape."""

    turn_id: str
    seq: int
    turn_type: str
    """main | side"""
    messages: list[dict[str, Any]]
    """The request messages (OpenAI shape)."""
    answer: dict[str, Any]
    """The assistant message it produced: {role, content, reasoning_content?, tool_calls?}."""
    tools: list[dict[str, Any]] | None = None
    """The request's tools (OpenAI shape), None when it had none."""


@dataclass(frozen=True)
class NextState:
    """What followed a main turn."""

    kind: NextKind
    messages: list[dict[str, Any]]
    """Tool messages (role tool, in order) and/or the next user message."""
    from_turn_id: str
    """The later main turn whose request carried them."""


def tool_call_ids(message: Mapping[str, Any]) -> list[str]:
    return [str(c.get("id")) for c in message.get("tool_calls") or [] if isinstance(c, Mapping) and c.get("id")]


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return (
        a.get("role") == b.get("role")
        and text_of(a.get("content")).strip() == text_of(b.get("content")).strip()
        and tool_call_ids(a) == tool_call_ids(b)
    )


def _answer_matches(msg: Mapping[str, Any], answer: Mapping[str, Any]) -> bool:
    ids = set(tool_call_ids(answer))
    if ids and ids & set(tool_call_ids(msg)):
        return True
    text = text_of(answer.get("content")).strip()
    return bool(text) and text_of(msg.get("content")).strip() == text


def _locate_answer(turn: TurnView, later: Sequence[dict[str, Any]]) -> int:
    """Index in `later` right after T's assistant message (see module rules)."""
    n = len(turn.messages)
    prefix_ok = len(later) > n and all(_same(a, b) for a, b in zip(turn.messages, later[:n], strict=False))
    if prefix_ok and later[n].get("role") == "assistant":
        return n + 1
    assistants = [i for i, m in enumerate(later) if m.get("role") == "assistant"]
    for i in reversed(assistants):
        if _answer_matches(later[i], turn.answer):
            return i + 1
    if assistants:
        return assistants[-1] + 1
    common = 0
    while common < min(n, len(later)) and _same(turn.messages[common], later[common]):
        common += 1
    return common


def next_state_of(turn: TurnView, nxt: TurnView) -> NextState | None:
    """The next state of main turn `turn` given the next main turn `nxt`."""
    start = _locate_answer(turn, nxt.messages)
    tools: list[dict[str, Any]] = []
    users: list[dict[str, Any]] = []
    for m in nxt.messages[start:]:
        role = m.get("role")
        if role == "assistant":
            break
        if role == "tool":
            tools.append(dict(m))
        elif role == "user":
            users.append(dict(m))
    if not tools and not users:
        return None
    kind: NextKind = "tool+user" if tools and users else ("tool" if tools else "user")
    return NextState(kind, tools + users, nxt.turn_id)


def extract_next_states(turns: Sequence[TurnView]) -> dict[str, NextState]:
    """`turn_id -> NextState` for every main turn of a session (ordered by seq) that has one."""
    mains = sorted((t for t in turns if t.turn_type == "main"), key=lambda t: t.seq)
    out: dict[str, NextState] = {}
    for cur, nxt in itertools.pairwise(mains):
        state = next_state_of(cur, nxt)
        if state is not None:
            out[cur.turn_id] = state
    return out


# ------------------------------------------------------------------ from stored turns


def turn_view(turn_id: str, seq: int, turn_type: str, request: Mapping[str, Any],
              response: Mapping[str, Any] | None, api: str = "openai") -> TurnView:
    """A `TurnView` from what the store recorded for a turn."""
    view = openai_view(request, api)
    return TurnView(turn_id, seq, turn_type, view.messages, answer_message(response), view.tools)
