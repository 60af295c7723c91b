"""Evaluation sets: what a policy version is scored on before it may serve.

Two sources, one shape (`EvalSet`, a list of items and a digest):
- A JSONL file the user points at (`eval_set`): each non-blank line is
  `{"messages": [...], "expect": "REGEX"}` (passes when the greedy answer matches the regular
  expression anywhere, case-insensitive) or `{"messages": [...], "rubric": "..."}` (the configured
  judge scores the greedy answer against the rubric: +1 / 0 / -1). `id` (a string) is optional.
- Without a file: the held-out share of the user's own recorded sessions (`held_out`): a session
  whose id hashes below `held_out_share` is never trained (its samples are dropped as `held_out`),
  and each of its main turns that has a verdict (an explicit reward, else the judge's score) is an
  item: the recorded prompt and answer, token exact, with the logprobs the answer was sampled
  with. A version scores it by how its own likelihood of that answer moved from the sampling
  policy's, toward the verdict (`clawbridge.promotion.runner`).

Invariants:
- A bad line is refused with `EvalSetError` naming the file and the line (1-based) and what is
  wrong; nothing is evaluated on a half-read set.
- `digest` changes when anything that decides a score changes (items, their order, max_tokens),
  so cached figures (`clawbridge.store.promotion`) are reused only for the same set.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from clawbridge.chat.messages import ChatMessage, RenderError, parse_messages
from clawbridge.store import Store

HELD_OUT_REASON = "held_out"
"""`samples.dropped_reason` of the turns of held-out sessions."""

MAX_ITEMS = 10_000
"""An eval set with more lines is refused (each line is a greedy answer per version evaluated)."""


class EvalSetError(ValueError):
    """An evaluation set that cannot be used, with where and why."""


@dataclass(frozen=True)
class EvalItem:
    """One thing a version is scored on."""

    kind: Literal["expect", "rubric", "held_out", "open", "topic"]
    """open: a question with no right answer; only a reference answer to it is scored
    (`clawbridge.promotion.everyday`), never the item itself. topic: passed when the greedy answer
    talks about `question` (`clawbridge.promotion.content`)."""
    id: str
    messages: tuple[dict[str, Any], ...] = ()
    """expect / rubric / open: the chat the version answers, as written (the digest's input)."""
    chat: tuple[ChatMessage, ...] = ()
    """`messages` parsed once by the proxy's rules (`clawbridge.chat.messages`): what is rendered."""
    expect: str = ""
    """expect: the regular expression the greedy answer must match (case-insensitive)."""
    rubric: str = ""
    prompt_ids: tuple[int, ...] = ()
    """held_out: the recorded prompt, token exact."""
    completion_ids: tuple[int, ...] = ()
    """held_out: the recorded answer (its stop token included)."""
    completion_logprobs: tuple[float, ...] = ()
    """held_out: the logprobs it was sampled with (the reference the runner's margin starts from)."""
    verdict: int = 0
    """held_out: +1 the user accepted the recorded answer, -1 they did not."""
    question: str = ""
    """topic: the question alone (without the notes the call carries), which the answer must talk about."""


@dataclass(frozen=True)
class EvalSet:
    """Items and what identifies them."""

    items: tuple[EvalItem, ...]
    source: str
    """The file, or 'held-out sessions'."""
    digest: str
    max_tokens: int | None = None
    """The longest greedy answer per expect / rubric item (None: the evaluator's own)."""

    @property
    def needs_judge(self) -> bool:
        return any(i.kind == "rubric" for i in self.items)

    @property
    def regex_only(self) -> bool:
        return bool(self.items) and all(i.kind == "expect" for i in self.items)


def held_out(session_id: str, share: float) -> bool:
    """Whether `session_id` is in the held-out share (a stable hash, the same in every process)."""
    if share <= 0:
        return False
    digest = hashlib.blake2b(f"held-out:{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < share


def digest_of(parts: Sequence[Any]) -> str:
    """A short stable hash of JSON-able `parts` (an `EvalSet.digest`)."""
    return hashlib.sha256(json.dumps(list(parts), sort_keys=True, default=list).encode()).hexdigest()[:16]


def parse_eval_set(text: str, source: str, max_tokens: int) -> EvalSet:
    """The items of JSONL `text` (read from `source`, named in errors); raises `EvalSetError`."""
    items: list[EvalItem] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if len(items) >= MAX_ITEMS:
            raise EvalSetError(f"{source}: more than {MAX_ITEMS} items")
        items.append(_item(line, n, source))
    if not items:
        raise EvalSetError(f"{source}: no items (each line is {{\"messages\": [...], \"expect\": \"REGEX\"}} or "
                           "{\"messages\": [...], \"rubric\": \"...\"})")
    parts = [[i.kind, i.id, list(i.messages), i.expect, i.rubric] for i in items]
    return EvalSet(tuple(items), source, digest_of([max_tokens, *parts]), max_tokens)


def load_eval_set(path: str | Path, max_tokens: int) -> EvalSet:
    """`parse_eval_set` of the file at `path`; `EvalSetError` when it cannot be read."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalSetError(f"eval set {p}: cannot read it ({exc})") from None
    return parse_eval_set(text, str(p), max_tokens)


def _item(line: str, n: int, source: str) -> EvalItem:
    where = f"{source} line {n}"
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise EvalSetError(f"{where}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise EvalSetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - {"messages", "expect", "rubric", "id"})
    if unknown:
        raise EvalSetError(f"{where}: unknown field(s) {', '.join(unknown)} (known: messages, expect, rubric, id)")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EvalSetError(f"{where}: \"messages\" must be a non-empty list of chat messages")
    try:
        chat = tuple(parse_messages(messages))
    except RenderError as exc:
        raise EvalSetError(f"{where}: {exc}") from None
    has_expect, has_rubric = "expect" in obj, "rubric" in obj
    if has_expect == has_rubric:
        raise EvalSetError(f"{where}: give exactly one of \"expect\" (a regular expression) or \"rubric\" (text)")
    item_id = obj.get("id", f"line-{n}")
    if not isinstance(item_id, str):
        raise EvalSetError(f"{where}: \"id\" must be a string")
    if has_expect:
        expect = obj["expect"]
        if not isinstance(expect, str) or not expect:
            raise EvalSetError(f"{where}: \"expect\" must be a non-empty string")
        try:
            re.compile(expect, re.IGNORECASE)
        except re.error as exc:
            raise EvalSetError(f"{where}: \"expect\" is not a valid regular expression ({exc})") from None
        return EvalItem("expect", item_id, tuple(messages), chat, expect=expect)
    rubric = obj["rubric"]
    if not isinstance(rubric, str) or not rubric.strip():
        raise EvalSetError(f"{where}: \"rubric\" must be a non-empty string")
    return EvalItem("rubric", item_id, tuple(messages), chat, rubric=rubric)


def held_out_set(store: Store, max_items: int, max_tokens: int) -> EvalSet:
    """The newest `max_items` main turns of held-out sessions that have a verdict (module doc).
    An explicit reward wins over the judge's verdict (rewards with source `judge`), as in training
    under `explicit_reward_rule = "override"`."""
    from clawbridge.store.codec import decode_floats, decode_ids

    with store.read() as c:
        rows = c.execute(
            "SELECT t.turn_id, t.prompt_token_ids, t.completion_token_ids, t.completion_logprobs, "
            "(SELECT r.value FROM rewards r WHERE r.turn_id = t.turn_id "
            "ORDER BY r.source = 'judge', r.reward_id DESC LIMIT 1) AS rv "
            "FROM samples sa JOIN turns t ON t.turn_id = sa.turn_id WHERE sa.dropped_reason = ? "
            "ORDER BY t.completed_at DESC, t.turn_id LIMIT ?",
            (HELD_OUT_REASON, max_items * 4),
        ).fetchall()
    items: list[EvalItem] = []
    for r in rows:
        value = r["rv"]
        if value is None or float(value) == 0.0:
            continue
        items.append(EvalItem("held_out", str(r["turn_id"]), prompt_ids=tuple(decode_ids(r["prompt_token_ids"])),
                              completion_ids=tuple(decode_ids(r["completion_token_ids"])),
                              completion_logprobs=tuple(decode_floats(r["completion_logprobs"])),
                              verdict=1 if float(value) > 0 else -1))
        if len(items) >= max_items:
            break
    items.reverse()
    parts = [[i.id, i.verdict] for i in items]
    return EvalSet(tuple(items), "held-out sessions", digest_of([max_tokens, "held_out_likelihood", *parts]))
