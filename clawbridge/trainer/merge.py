"""A session's turns as one training sequence where each prompt extends the last (pure).

An agent sends its whole history with every call, so turn k+1's prompt usually starts with turn
k's prompt and completion. Sent as separate datums, a 20-turn session carries its context ~20
times; merged, once. This is the convention of tinker-cookbook's RL data processing (observations
that extend the sequence so far are appended with mask 0, actions with mask 1); written here for
clawbridge's recorded turns.

Invariants:
- WHICH TURNS MERGE: only turns of the same session in the same batch, in their session order
  (`seq`). A turn joins the datum being built when its recorded prompt ids start with that
  datum's whole token sequence (the previous merged turn's prompt + completion ids), compared
  token for token as recorded: nothing is re-tokenized or re-rendered. Otherwise the datum is
  closed and the turn starts a new one: a BREAK (a template that strips earlier reasoning, a
  client that edits or truncates history, a side branch of the session). A turn left out of the
  batch (dropped as stale or empty, trained earlier) gets no span; where its tokens lie inside a
  later prompt they are context with mask 0, like any other prompt token.
- WHAT A SPAN CARRIES (`clawbridge.backend.Span`): the target positions of one turn's completion,
  exactly its recorded completion ids, and per position that turn's sampler logprob (as
  recorded), its own per-token advantage (rules 1-5 of `clawbridge.trainer.advantages`, already
  scaled by rule 4), mask 1; plus the turn's policy version and id. Positions between spans (the
  next prompt's new tokens: tool results, user messages, the generation prompt) carry mask 0,
  advantage 0, logprob 0. The importance ratio exp(logp_train - logp_sampler) is per token, so
  each span is weighted against its own sampler; staleness is screened per turn before merging
  and the datum's `policy_version` is its oldest span's.
- SAME LOSS: every backend's loss is a plain sum over masked tokens
  (`clawbridge_local.losses`), each term depends only on that token's logprob given the tokens
  before it, and in a merged datum those tokens are exactly the turn's own prompt and completion
  prefix. Advantages are scaled per TURN before merging (rule 4 counts turns and their completion
  tokens, never datums), so merged and separate datums give the same loss and gradient up to
  float rounding.
- COUNTS (`MergeStats`): `turns` trained, `datums` sent, `merged` (turns that joined an earlier
  turn's datum), `breaks` (turns with an earlier turn of their session in the batch that could
  not join it), and tokens sent versus what separate datums would have sent. turns = datums +
  merged; the batch size and the waste accounting count turns (a merged datum trains them all).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields

from clawbridge.backend import Datum, Span

log = logging.getLogger("clawbridge.trainer")


@dataclass(frozen=True)
class TurnPiece:
    """One trainable turn as recorded, with its advantages: the input to `build_datums`."""

    turn_id: str
    session_id: str
    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float]
    """Sampler logprob per completion token, as recorded."""
    advantages: Sequence[float]
    """Per completion token, already scaled (advantages rule 4)."""
    policy_version: int


@dataclass(frozen=True)
class MergeStats:
    """What merging did to one batch (additive: `+` sums the counts)."""

    turns: int = 0
    datums: int = 0
    merged: int = 0
    """Turns that joined an earlier turn's datum."""
    breaks: int = 0
    """Turns whose prompt did not extend their session's datum so far."""
    tokens_sent: int = 0
    """Sum of len(tokens) over the datums sent."""
    tokens_unmerged: int = 0
    """Sum of len(tokens) had every turn been its own datum."""

    def __add__(self, other: MergeStats) -> MergeStats:
        return MergeStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def as_dict(self) -> dict[str, int]:
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}


class _Builder:
    """The datum being grown for one session."""

    def __init__(self, piece: TurnPiece) -> None:
        self.tokens: list[int] = list(piece.prompt_ids)
        self.prompt_len = len(piece.prompt_ids)
        n = len(self.tokens) - 1
        self.logprobs: list[float] = [0.0] * n
        self.advantages: list[float] = [0.0] * n
        self.mask: list[float] = [0.0] * n
        self.spans: list[Span] = []
        self.add(piece)

    def extends(self, piece: TurnPiece) -> bool:
        n = len(self.tokens)
        return len(piece.prompt_ids) >= n and list(piece.prompt_ids[:n]) == self.tokens

    def first_difference(self, piece: TurnPiece) -> int:
        """The first position where the piece's prompt leaves the sequence so far."""
        for i, (a, b) in enumerate(zip(self.tokens, piece.prompt_ids, strict=False)):
            if a != b:
                return i
        return min(len(self.tokens), len(piece.prompt_ids))

    def add(self, piece: TurnPiece) -> None:
        """Append the piece's new prompt tokens (mask 0) and its completion (one span)."""
        new_prompt = piece.prompt_ids[len(self.tokens):]
        pad = len(new_prompt)
        self.tokens.extend(new_prompt)
        self.logprobs.extend([0.0] * pad)
        self.advantages.extend([0.0] * pad)
        self.mask.extend([0.0] * pad)
        start = len(self.tokens) - 1
        k = len(piece.completion_ids)
        self.tokens.extend(piece.completion_ids)
        self.logprobs.extend(float(x) for x in piece.logprobs)
        self.advantages.extend(float(x) for x in piece.advantages)
        self.mask.extend([1.0] * k)
        self.spans.append(Span(start, start + k, piece.policy_version, piece.turn_id))

    def datum(self) -> Datum:
        return Datum(
            tokens=tuple(self.tokens),
            prompt_len=self.prompt_len,
            sampler_logprobs=tuple(self.logprobs),
            advantages=tuple(self.advantages),
            mask=tuple(self.mask),
            policy_version=min(s.policy_version for s in self.spans),
            turn_id=self.spans[0].turn_id,
            spans=tuple(self.spans),
        )


def _check(piece: TurnPiece) -> None:
    if not piece.prompt_ids or not piece.completion_ids:
        raise ValueError(f"turn {piece.turn_id!r}: a datum needs at least one prompt and one completion token")
    if not (len(piece.completion_ids) == len(piece.logprobs) == len(piece.advantages)):
        raise ValueError(f"turn {piece.turn_id!r}: completion ids, logprobs and advantages must have one entry each")


def build_datums(pieces: Sequence[TurnPiece], merge: bool = True) -> tuple[list[Datum], MergeStats]:
    """The datums for `pieces` (a session's turns in seq order; sessions in any order) and the
    counts. With `merge` False every turn is its own datum (the datums equal `Datum.from_turn`'s)
    and nothing counts as merged or broken.
    Datums come in the order of their first turn."""
    open_by_session: dict[str, int] = {}
    builders: list[_Builder] = []
    merged = breaks = separate = 0
    for piece in pieces:
        _check(piece)
        separate += len(piece.prompt_ids) + len(piece.completion_ids)
        i = open_by_session.get(piece.session_id)
        if merge and i is not None:
            if builders[i].extends(piece):
                builders[i].add(piece)
                merged += 1
                continue
            breaks += 1
            log.debug(
                "turn %s does not extend its session's sequence (prompt %d tokens, sequence so far %d, "
                "first difference at token %d): it starts a new datum",
                piece.turn_id, len(piece.prompt_ids), len(builders[i].tokens), builders[i].first_difference(piece),
            )
        open_by_session[piece.session_id] = len(builders)
        builders.append(_Builder(piece))
    datums = [b.datum() for b in builders]
    stats = MergeStats(
        turns=len(pieces),
        datums=len(datums),
        merged=merged,
        breaks=breaks,
        tokens_sent=sum(len(d.tokens) for d in datums),
        tokens_unmerged=separate,
    )
    return datums, stats
