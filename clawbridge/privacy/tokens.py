"""The privacy filter on a training datum: found prompt text replaced in the tokens, sampled text dropped.

A datum is token ids with per-position values (`clawbridge.backend.Datum`). Its text is found
with the model's own tokenizer (`TextCodec`, e.g. the `Renderer`): decoded token by token
(`clawbridge.chat.parse.IncrementalDecoder`, which never splits a UTF-8 character) to map each
token to the characters it produced, and the filter runs on the whole text.

Invariants:
- A finding that touches a sampled token (a position inside one of the datum's spans) drops that
  span's turn: the sampler's logprobs belong to exactly the tokens it sampled, so a sampled token
  is never rewritten. The dropped span's positions become prompt (mask 0, advantage 0, logprob 0)
  and its text is masked like any prompt text.
- Every other finding is replaced, in the tokens sent, by its placeholder encoded with the same
  tokenizer; the replaced tokens are whole tokens (the text of a boundary token outside the finding
  is re-encoded with the placeholder, so nothing around it is lost).
- The kept spans' tokens, logprobs, advantages and mask values are unchanged and stay aligned:
  position p of the result predicts tokens[p + 1], as in every datum (checked by `check_datum`).
- A datum whose text cannot be mapped to its tokens (decoding token by token does not give the
  whole decoding) is not sent at all (fail closed): every turn in it is dropped.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from clawbridge.backend import Datum, Span, check_datum
from clawbridge.chat.parse import IncrementalDecoder
from clawbridge.privacy.detect import Finding, PrivacyFilter, mask_text

log = logging.getLogger("clawbridge.privacy")


class TextCodec(Protocol):
    """The model's tokenizer, as the filter needs it (`clawbridge.chat.render.Renderer` is one)."""

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, special-token texts as their ids, nothing added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included."""
        ...


class OffsetError(ValueError):
    """Decoding token by token does not give the text of the whole sequence."""


@dataclass(frozen=True)
class TokenText:
    """A token sequence's text and, per token, the characters [start, end) it produced. Tokens that
    produce part of a character share the span of the token that completes it."""

    text: str
    spans: tuple[tuple[int, int], ...]


def token_text(ids: Sequence[int], codec: TextCodec) -> TokenText:
    """Map `ids` to their text, token by token (raises `OffsetError`, module invariants)."""
    decoder = IncrementalDecoder(codec.decode)
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    held = 0
    pos = 0
    for tid in ids:
        piece = decoder.push(tid)
        if not piece:
            held += 1
            spans.append((pos, pos))
            continue
        spans[len(spans) - held:] = [(pos, pos + len(piece))] * held
        spans.append((pos, pos + len(piece)))
        held = 0
        pieces.append(piece)
        pos += len(piece)
    rest = decoder.flush()
    if rest:
        spans[len(spans) - held:] = [(pos, pos + len(rest))] * held
        pieces.append(rest)
    text = "".join(pieces)
    if text != codec.decode(ids):
        raise OffsetError("token-by-token decoding differs from decoding the whole sequence")
    return TokenText(text, tuple(spans))


@dataclass(frozen=True)
class Redaction:
    """What the filter made of one datum."""

    datum: Datum | None
    """The datum to send, or None when nothing of it may be trained (every span dropped)."""
    dropped_turns: tuple[str, ...] = ()
    """Turns whose sampled tokens held a finding (or the whole datum, unmapped): `dropped: private`."""
    masked: Counter[str] = field(default_factory=Counter)
    """Findings replaced by a placeholder in the tokens sent, by kind (none when nothing is sent)."""


def redact_datum(datum: Datum, codec: TextCodec, pfilter: PrivacyFilter) -> Redaction:
    """Apply the filter to one datum (module invariants)."""
    findings = pfilter.find(codec.decode(datum.tokens))
    if not findings:
        return Redaction(datum)
    try:
        mapped = token_text(datum.tokens, codec)
    except OffsetError:
        log.warning("privacy: a datum of turn(s) %s could not be mapped to its text; it is not sent",
                    ", ".join(datum.turn_ids))
        return Redaction(None, datum.turn_ids)
    # mapped.text is the whole decoding (checked by token_text): the findings hold for it
    n = len(datum.tokens)
    spans = datum.sampled_spans
    # Per token j >= 1: the values of position j - 1 (the one that predicts it) and its span's index.
    lp = [0.0, *datum.sampler_logprobs]
    adv = [0.0, *datum.advantages]
    mask = [0.0, *datum.mask]
    owner = [-1] * n
    for k, sp in enumerate(spans):
        for j in range(sp.start + 1, sp.end + 1):
            owner[j] = k
    ranges = [_token_range(mapped.spans, f) for f in findings]
    dropped: set[int] = set()
    for a, b in ranges:
        dropped.update(owner[j] for j in range(a, b) if owner[j] >= 0)
    for j in range(n):
        if owner[j] in dropped:
            owner[j], lp[j], adv[j], mask[j] = -1, 0.0, 0.0, 0.0
    kept = [k for k in range(len(spans)) if k not in dropped]
    dropped_turns = tuple(spans[k].turn_id for k in sorted(dropped))
    masked = Counter(f.kind for f in findings)
    if not kept:
        return Redaction(None, dropped_turns)  # nothing of it is sent, so nothing was masked
    tokens: list[int] = []
    new_lp: list[float] = []
    new_adv: list[float] = []
    new_mask: list[float] = []
    new_owner: list[int] = []
    pos = 0
    for (a, b), group in _units(ranges, findings):
        for j in range(pos, a):
            tokens.append(datum.tokens[j])
            new_lp.append(lp[j])
            new_adv.append(adv[j])
            new_mask.append(mask[j])
            new_owner.append(owner[j])
        lo, hi = mapped.spans[a][0], mapped.spans[b - 1][1]
        local = [Finding(f.start - lo, f.end - lo, f.kind) for f in group]
        fresh = codec.encode(mask_text(mapped.text[lo:hi], local))
        tokens += fresh
        new_lp += [0.0] * len(fresh)
        new_adv += [0.0] * len(fresh)
        new_mask += [0.0] * len(fresh)
        new_owner += [-1] * len(fresh)
        pos = b
    for j in range(pos, n):
        tokens.append(datum.tokens[j])
        new_lp.append(lp[j])
        new_adv.append(adv[j])
        new_mask.append(mask[j])
        new_owner.append(owner[j])
    new_spans: list[Span] = []
    for k in kept:
        js = [j for j, o in enumerate(new_owner) if o == k]
        new_spans.append(Span(js[0] - 1, js[-1], spans[k].policy_version, spans[k].turn_id))
    out = Datum(
        tokens=tuple(tokens),
        prompt_len=new_spans[0].start + 1,
        sampler_logprobs=tuple(new_lp[1:]),
        advantages=tuple(new_adv[1:]),
        mask=tuple(new_mask[1:]),
        policy_version=min(s.policy_version for s in new_spans),
        turn_id=new_spans[0].turn_id,
        spans=tuple(new_spans),
    )
    check_datum(out)
    return Redaction(out, dropped_turns, masked)


def _token_range(spans: Sequence[tuple[int, int]], f: Finding) -> tuple[int, int]:
    """The tokens [a, b) whose characters overlap the finding."""
    hits = [j for j, (lo, hi) in enumerate(spans) if lo < f.end and hi > f.start]
    return hits[0], hits[-1] + 1


def _units(ranges: Sequence[tuple[int, int]], findings: Sequence[Finding]) -> list[tuple[tuple[int, int], list[Finding]]]:
    """Findings grouped by overlapping or adjacent token ranges: each group is re-encoded at once."""
    units: list[tuple[tuple[int, int], list[Finding]]] = []
    for (a, b), f in sorted(zip(ranges, findings, strict=True)):
        if units and a <= units[-1][0][1]:
            (ua, ub), group = units[-1]
            units[-1] = ((ua, max(ub, b)), [*group, f])
        else:
            units.append(((a, b), [f]))
    return units
