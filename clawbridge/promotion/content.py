"""The content check: do a candidate's answers, in the agent's own context, still talk about what was asked?

Why: every other check of the gate reads facts or likelihoods, and none reads an answer in the
context a person is served in: their agent's profile (the system prompt) and their notes. Measured
on SmolLM2 taught by talk (`bench/content_check.py`; docs/training.md, "Kept: the gate's content
check"): Sam's run kept its facts and passed both everyday guards while, under his own profile and
note, its greedy answers to the everyday questions went from 8 of 12 on topic (the base) to 6 at
v16 and v24 ("I'm Sam. I'm here to help you with your creative endeavors.", "You are Sam."); the
gate's own profile and note (`clawbridge.promotion.everyday.in_context_set`) read 9 of 12 at v16.
So every candidate also answers `EVERYDAY_QUESTIONS` greedily in the context of the latest call
that trains the shared policy (`agent_context`): its system prompt, and that caller's active
notes where `notes_place` puts them, as served. An answer passes when it talks about its question
(`clawbridge.chat.topic.on_topic`, a lexical floor), and a candidate must pass at least as many
as the serving version and the anchor, less `content_check_slack` items (`Promoter._check`).

Invariants:
- The questions are the everyday guard's: disjoint from the personas' and the demos' (the gate is
  never tuned on what a benchmark measures). The context is whatever the agent sends; nothing a
  benchmark knows about a persona is read.
- The set's digest covers the context, so a version's figures are cached per context: when the
  profile or the notes change, the serving version and the anchor answer again (12 answers each),
  and a candidate is always compared with them under one context.
- Only calls that train the shared policy give the context: with `per_user_adapters`, calls
  without a user; else any call. Side turns (the judge's, checks) never do.
- Item ids start with the turn id the context came from (`turn_id/everyday-N`), so forgetting that
  user scrubs the answers given in her context from every stored figure
  (`clawbridge.store.promotion.scrub_items`). Nothing leaves the machine: the check is lexical.
- Off with the probe (like the guards), with `content_check` off, where the anchor knows no probe
  fact (a random tiny model: nothing to keep), and on a backend that serves one version at a time
  (Fireworks' deployment, SGLang with full weights): a new context needs the serving version's
  answers, which such a backend cannot give once a candidate is published. Before any recorded
  call there is no context, and nothing trained yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from clawbridge.chat.content import loose_text
from clawbridge.chat.messages import parse_messages
from clawbridge.config import NotesPlace
from clawbridge.promotion.evalset import EvalItem, EvalSet, digest_of
from clawbridge.promotion.everyday import EVERYDAY_MAX_TOKENS, EVERYDAY_QUESTIONS
from clawbridge.rewards.notes import note_hint, noted_messages
from clawbridge.store import Store
from clawbridge.store.notes import NoteStore

CONTENT_SOURCE = "everyday answers in the agent's context, on topic"
"""How decisions and status name the check (`EvalSet.source`)."""

CONTENT_ITEM = "everyday-"
"""Item ids are `<turn id>/everyday-<n>` (module invariants)."""


@dataclass(frozen=True)
class AgentContext:
    """What the agent's latest call that trains the shared policy carried besides its question."""

    turn_id: str
    """The recorded turn it was read from (the items' id prefix)."""
    system: str
    """Its system (or developer) message's text; '' when it had none."""
    notes: str
    """Its caller's active notes as one hint (`note_hint`); '' when none."""


def agent_context(store: Store, unnamed_only: bool, with_notes: bool) -> AgentContext | None:
    """The context of the newest main turn that trains the shared policy (module invariants), or
    None before any. `unnamed_only`: only calls without a user (`per_user_adapters`); `with_notes`:
    the caller's active notes are served (`notes` on)."""
    where = "AND (s.user_id IS NULL OR s.user_id = '')" if unnamed_only else ""
    with store.read() as c:
        row = c.execute(
            "SELECT t.turn_id, t.request_json, s.user_id FROM turns t JOIN sessions s ON s.session_id = t.session_id "
            f"WHERE t.turn_type = 'main' {where} ORDER BY t.created_at DESC, t.rowid DESC LIMIT 1").fetchone()
    if row is None:
        return None
    notes = NoteStore(store).active().get(str(row[2] or ""), []) if with_notes else []
    return AgentContext(str(row[0]), system_text(str(row[1])), note_hint(notes))


def system_text(request_json: str) -> str:
    """The system prompt of a recorded request, OpenAI (`messages`' system or developer message) or
    Anthropic (`system`); '' when it has none or cannot be read."""
    try:
        request = json.loads(request_json)
    except ValueError:
        return ""
    if not isinstance(request, dict):
        return ""
    if request.get("system") is not None:
        return loose_text(request["system"]).strip()
    for m in request.get("messages") or []:
        if isinstance(m, dict) and m.get("role") in ("system", "developer"):
            return loose_text(m.get("content")).strip()
    return ""


def content_set(context: AgentContext, place: NotesPlace = "user") -> EvalSet:
    """`EVERYDAY_QUESTIONS` as the agent's latest call would carry them: its system prompt, each
    question as the user's message, and its caller's notes where `place` puts them; `topic` items."""
    items = []
    for n, question in enumerate(EVERYDAY_QUESTIONS, start=1):
        plain = ([{"role": "system", "content": context.system}] if context.system else []) + [
            {"role": "user", "content": question}]
        chat = parse_messages(plain)
        if context.notes:
            chat = noted_messages(chat, context.notes, place)
        messages = tuple({"role": m.role, "content": m.content} for m in chat)
        items.append(EvalItem("topic", f"{context.turn_id}/{CONTENT_ITEM}{n}", messages, tuple(chat),
                              question=question))
    digest = digest_of(["content", EVERYDAY_MAX_TOKENS, context.system, context.notes, place, *EVERYDAY_QUESTIONS])
    return EvalSet(tuple(items), CONTENT_SOURCE, digest, EVERYDAY_MAX_TOKENS)
