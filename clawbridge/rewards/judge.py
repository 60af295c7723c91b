"""The judge: a process reward for a main turn from (task, answer, next state), and a hindsight hint.

Rules:
- Score: +1 progress / accepted, -1 correction / redo / error, 0 unclear. The judge answers in
  free text ending with `SCORE: +1|0|-1` (the LAST such line counts; `\\boxed{1}` is accepted too)
  and optionally `HINT: <one sentence>`, what the user wanted as an instruction to the assistant,
  or `HINT: none`.
- Voting: m samples (`votes`, default 3) at `temperature`. A failed vote (transport error after
  its retries, or no parseable score) counts as a 0 vote. The verdict is the value with STRICTLY
  the most votes; a tie for the most gives 0. Every vote and its text are stored.
- If EVERY vote failed with an error (the endpoint is down), there is no verdict: the turn is
  judged again later (`JudgementFailed`), never silently scored 0.
- Hint: the longest hint among the votes (at least `MIN_HINT_CHARS`), so OPD has the most
  specific description of what the user wanted; none when no vote gave one.
- Rewrite: on a correction that says how the user wanted the answer, a vote may write the answer
  that way after a line `REWRITE:`, up to a line `END REWRITE` (or a `SAME:`/`SCORE:` line). The
  prompt asks for it (when rewrites train) after the SCORE line, so a vote cut by `max_tokens`
  keeps its score; a rewrite with no end (cut) is dropped, never trained half-written. The
  verdict's rewrite is the first one (by vote order) among the votes that gave the verdict's
  score, and only a verdict of -1 has one: it becomes a demonstration
  (`clawbridge.rewards.rewrites`). At most `MAX_REWRITE_CHARS`; longer ones are dropped.
- Same preference: when the prompt lists what the user asked for before (their active notes,
  numbered from 1), a vote may add `SAME: <n>` to say the user's reaction asks for note n again.
  The verdict's `same` is the number most votes gave (ties: the lowest); None when none did. A
  number outside the list counts as none.

`JudgeModel` is the seam: `OpenAIJudge` talks to any OpenAI-compatible endpoint with its own key;
`BaseModelJudge` samples the serving backend's base model (no adapters) through a `Sampler`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import httpx

from clawbridge.config import default_of
from clawbridge.rewards.next_state import text_of
from clawbridge.store.rewards import VoteRow

MIN_HINT_CHARS = 8
MAX_FIELD_CHARS = 4000
"""Each section of the judge prompt is cut to this many characters (head and tail kept)."""

SYSTEM_PROMPT = """You are a process reward judge for an AI assistant. You see the user's task, one \
assistant turn (its answer and tool calls) and what happened NEXT: the tool results that answered \
its tool calls and/or the user's next message. Decide whether this turn made progress.
+1: the user accepted it or moved on satisfied, or the tool calls succeeded and moved the task forward.
-1: the user corrected it, asked for a redo, complained, or a tool call failed with an error.
0: unclear: no reaction, an unrelated new request, or mixed signals you cannot resolve.
If the next state reveals what the user actually wanted, write it as a short instruction hint: \
addressed to the assistant, saying what to do (e.g. `Reply in French.` or `Put commands in a code block.`), \
not the user's complaint (the assistant may be shown it on the user's later requests).
Answer with a one-sentence reason, then a line `HINT: <the instruction>` (or `HINT: none`), \
then a line `SCORE: +1`, `SCORE: 0` or `SCORE: -1`."""
REWRITE_PROMPT = """
When the user corrected the answer and said how they wanted it, then also write the assistant's answer \
the way they wanted it: a line `REWRITE:`, the whole answer rewritten (keep its content; change what \
they asked to change), and a last line `END REWRITE`."""
"""Added to `SYSTEM_PROMPT` when rewrites train (`rewrite_coef > 0`, `judge_messages(rewrite=True)`)."""

_SCORE_RE = re.compile(r"score\s*[:=]\s*\**\s*([+-]?\s*\d+)", re.IGNORECASE)
_BOXED_RE = re.compile(r"\\boxed\{\s*([+-]?\d+)\s*\}")
_HINT_RE = re.compile(r"^\s*\**hint\**\s*[:=]\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_NO_HINT = {"none", "n/a", "na", "-", "no", "nothing", "null", "(none)"}
_SAME_RE = re.compile(r"^\s*\**same\**\s*[:=]\s*\[?\s*(\d+)", re.IGNORECASE | re.MULTILINE)
_REWRITE_RE = re.compile(
    r"^[ \t]*\**rewrite\**[ \t]*[:=][ \t]*(.*?)^[ \t]*(?:\**(?:same|score)\**[ \t]*[:=]|end rewrite[ \t]*$)",
    re.IGNORECASE | re.MULTILINE | re.DOTALL,
)
MAX_REWRITE_CHARS = 4000
"""A rewrite longer than this is dropped (a runaway answer, not a rewrite)."""
NOTES_SECTION = "What this user asked for before"
"""The judge prompt's section listing the user's active notes (`judge_messages(notes=...)`)."""


class JudgementFailed(RuntimeError):
    """Every vote failed with an error: no verdict now; judge the turn again later."""


@runtime_checkable
class JudgeModel(Protocol):
    """Something that answers chat messages with text.

    Fake: `ScriptedJudge` below (and `clawbridge.devtools.judge_server` for the endpoint judge
    over HTTP). Tested by tests/test_rewards.py and tests/test_rewards_trainer.py."""

    name: str
    """Recorded with every judgement (`judgements.judge_model`)."""

    async def complete(self, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int,
                       seed: int | None = None) -> str:
        """The model's answer text. Raises on transport or server errors."""
        ...


# ------------------------------------------------------------------ prompt, parsing, voting


def cut_text(text: str, limit: int = MAX_FIELD_CHARS) -> str:
    """`text`, or its head and tail when longer than `limit` characters (one section of a judge prompt)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters cut ...]\n{text[-half:]}"


def describe_answer(answer: Mapping[str, Any]) -> str:
    lines = [text_of(answer.get("content")).strip() or "(no text)"]
    for call in answer.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, Mapping) else {}
        lines.append(f"TOOL CALL {fn.get('name')}({fn.get('arguments')})")
    return "\n".join(lines)


def describe_next_state(messages: Sequence[Mapping[str, Any]]) -> str:
    lines = []
    for m in messages:
        if m.get("role") == "tool":
            name = m.get("name") or m.get("tool_call_id") or "tool"
            lines.append(f"[tool result {name}] {text_of(m.get('content'))}")
        else:
            lines.append(f"[user] {text_of(m.get('content'))}")
    return "\n".join(lines) or "(nothing)"


def last_user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            return text_of(m.get("content"))
    return ""


def notes_listing(notes: Sequence[str]) -> str:
    """A user's notes as a judge prompt lists them (`NOTES_SECTION`): `[n] text`, numbered from 1."""
    return "\n".join(f"[{i}] {cut_text(n.strip(), 400)}" for i, n in enumerate(notes, 1))


def judge_messages(task: str, answer: Mapping[str, Any], next_state: Sequence[Mapping[str, Any]],
                   notes: Sequence[str] = (), rewrite: bool = False) -> list[dict[str, Any]]:
    """The chat messages the judge sees for one turn; `notes` (the user's active notes, oldest
    first) add a section that lets the judge say a correction asks for one of them again;
    `rewrite` asks it for the corrected answer too (`REWRITE_PROMPT`)."""
    user = (
        f"## Task (the user's last message)\n{cut_text(task) or '(none)'}\n\n"
        f"## Assistant turn\n{cut_text(describe_answer(answer))}\n\n"
        f"## What happened next\n{cut_text(describe_next_state(next_state))}"
    )
    if notes:
        user += (f"\n\n## {NOTES_SECTION}\n{notes_listing(notes)}\n(If the user's reaction asks again for one of these, "
                 "add a line `SAME: <its number>` after the HINT line.)")
    system = SYSTEM_PROMPT + (REWRITE_PROMPT if rewrite else "")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def parse_vote(text: str) -> tuple[int | None, str | None]:
    """(score in {-1, 0, 1} or None when unparseable, hint or None) from a judge answer."""
    found = [m.group(1) for m in _SCORE_RE.finditer(text)] or [m.group(1) for m in _BOXED_RE.finditer(text)]
    score: int | None = None
    if found:
        value = int(found[-1].replace(" ", ""))
        score = value if value in (-1, 0, 1) else None
    hints = [h.strip().strip("\"'`*") for h in _HINT_RE.findall(text)]
    hint = next((h for h in hints if h.lower().strip(".") not in _NO_HINT and len(h) >= MIN_HINT_CHARS), None)
    return score, hint


def parse_rewrite(text: str | None) -> str | None:
    """The answer a vote rewrote after `REWRITE:` (module rules), or None (none, empty, cut, too long)."""
    found = [m.group(1).strip() for m in _REWRITE_RE.finditer(text or "")]
    rewrite = found[-1].strip("`").strip() if found else ""
    if not rewrite or rewrite.lower().strip(".") in _NO_HINT or len(rewrite) > MAX_REWRITE_CHARS:
        return None
    return rewrite


def best_rewrite(votes: Sequence[VoteRow], score: int) -> str | None:
    """The verdict's rewrite: the first among the votes that gave `score`, and only for -1."""
    if score != -1:
        return None
    return next((r for v in votes if v.score == score and (r := parse_rewrite(v.text))), None)


def parse_same(text: str | None, n_notes: int) -> int | None:
    """The note number (1..n_notes) a vote's `SAME:` line names, or None."""
    found = [int(m) for m in _SAME_RE.findall(text or "")]
    return found[-1] if found and 1 <= found[-1] <= n_notes else None


def same_note(votes: Sequence[VoteRow], n_notes: int) -> int | None:
    """The note number most votes named with `SAME:` (ties: the lowest), or None (module rules)."""
    counts: dict[int, int] = {}
    for v in votes:
        k = parse_same(v.text, n_notes)
        if k is not None:
            counts[k] = counts.get(k, 0) + 1
    return min(counts, key=lambda k: (-counts[k], k)) if counts else None


def majority(scores: Sequence[int | None]) -> int:
    """The voting rule (module docstring): failed votes count as 0; strict plurality else 0."""
    counts = {-1: 0, 0: 0, 1: 0}
    for s in scores:
        counts[0 if s is None else s] += 1
    best = max(counts.values())
    winners = [v for v, c in counts.items() if c == best]
    return winners[0] if len(winners) == 1 else 0


def mean_vote(scores: Sequence[int | None]) -> float:
    return sum(0 if s is None else s for s in scores) / len(scores) if scores else 0.0


def best_hint(votes: Sequence[VoteRow]) -> str | None:
    hints = [v.hint for v in votes if v.hint]
    return max(hints, key=len) if hints else None


@dataclass(frozen=True)
class Verdict:
    """The outcome of judging one turn."""

    score: int
    mean_vote: float
    hint: str | None
    votes: list[VoteRow]
    same: int | None = None
    """The listed note (1-based) the correction asks for again, by the votes (module rules)."""
    rewrite: str | None = None
    """The answer as the user wanted it, written by the judge (a -1 verdict only; module rules)."""


@dataclass(frozen=True)
class VoteConfig:
    """How one turn is judged."""

    votes: int = default_of("judge_votes")
    temperature: float = default_of("judge_temperature")
    max_tokens: int = default_of("judge_max_tokens")
    retries: int = default_of("judge_retries")
    """Retries of one vote after a transport/server error (backoff doubles from `backoff_s`)."""
    backoff_s: float = 0.5


async def judge_turn(
    judge: JudgeModel, messages: list[dict[str, Any]], cfg: VoteConfig, slots: asyncio.Semaphore | None = None,
    seed: int | None = None, n_notes: int = 0,
) -> Verdict:
    """Sample `cfg.votes` judgements (each holding one of `slots` while in flight) and vote;
    `n_notes` is how many notes `messages` lists (`judge_messages(notes=...)`)."""

    async def one(idx: int) -> VoteRow:
        err: str | None = None
        for attempt in range(cfg.retries + 1):
            try:
                if slots is not None:
                    async with slots:
                        text = await judge.complete(messages, temperature=cfg.temperature,
                                                    max_tokens=cfg.max_tokens,
                                                    seed=None if seed is None else seed + idx)
                else:
                    text = await judge.complete(messages, temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                                                seed=None if seed is None else seed + idx)
            except Exception as exc:
                err = f"{type(exc).__name__}: {exc}"
                if attempt < cfg.retries:
                    await asyncio.sleep(cfg.backoff_s * 2**attempt)
                continue
            score, hint = parse_vote(text)
            return VoteRow(idx, score, hint, text, None if score is not None else "no parseable SCORE line")
        return VoteRow(idx, None, None, None, err)

    votes = list(await asyncio.gather(*(one(i) for i in range(cfg.votes))))
    if all(v.text is None for v in votes):
        raise JudgementFailedWithVotes(votes)
    scores = [v.score for v in votes]
    score = majority(scores)
    return Verdict(score, mean_vote(scores), best_hint(votes), votes, same_note(votes, n_notes),
                   best_rewrite(votes, score))


class JudgementFailedWithVotes(JudgementFailed):
    """`JudgementFailed` carrying the failed votes (stored for the audit trail)."""

    def __init__(self, votes: list[VoteRow]) -> None:
        super().__init__(f"all {len(votes)} judge votes failed: {votes[0].error if votes else ''}")
        self.votes = votes


# ------------------------------------------------------------------ judge models


class OpenAIJudge:
    """Any OpenAI-compatible `/chat/completions` endpoint, with its own key."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 60.0,
                 client: httpx.AsyncClient | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = f"{model}@{self.base_url}"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.AsyncClient(timeout=timeout_s)

    async def complete(self, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int,
                       seed: int | None = None) -> str:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": temperature,
                                "max_tokens": max_tokens}
        if seed is not None:
            body["seed"] = seed
        r = await self._client.post(f"{self.base_url}/chat/completions", json=body, headers=self._headers)
        if r.status_code >= 400:
            raise RuntimeError(f"judge endpoint answered {r.status_code}: {r.text[:300]}")
        data = r.json()
        msg = data["choices"][0]["message"]
        return str(msg.get("content") or msg.get("reasoning_content") or "")

    async def aclose(self) -> None:
        await self._client.aclose()


class BaseModelJudge:
    """The serving backend's base model (no adapters) as the judge, through its `Sampler`.

    `sampler` is the backend's base-model sampler (e.g. `LocalBackend.base_sampler()`); prompts are
    rendered with the served model's chat template, and the sampled ids decoded to text."""

    def __init__(self, sampler: Any, renderer: Any, name: str = "base-model") -> None:
        self.sampler = sampler
        self.renderer = renderer
        self.name = name

    async def complete(self, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int,
                       seed: int | None = None) -> str:
        from clawbridge.serving.sampler import SamplingParams

        prompt = await asyncio.to_thread(self.renderer.render, messages)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                stop_token_ids=tuple(self.renderer.stop_token_ids))
        stream = await self.sampler.sample(prompt, params)
        ids = [t.token_id async for t in stream]
        ids = [i for i in ids if i not in self.renderer.stop_token_ids]
        return str(self.renderer.decode(ids))


class ScriptedJudge:
    """A fake `JudgeModel`: answers from a list (cycled) or a function of the messages."""

    def __init__(self, answers: Sequence[str] | Any, name: str = "scripted") -> None:
        self.answers = answers
        self.name = name
        self.calls: list[list[dict[str, Any]]] = []

    async def complete(self, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int,
                       seed: int | None = None) -> str:
        self.calls.append(messages)
        if callable(self.answers):
            out = self.answers(messages)
        else:
            out = self.answers[(len(self.calls) - 1) % len(self.answers)]
        if isinstance(out, BaseException):
            raise out
        return str(out)
