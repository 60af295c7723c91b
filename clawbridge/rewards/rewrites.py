"""Corrections as demonstrations: the judge's rewrite of a corrected answer, as training ids.

A user who says how they wanted an answer ("one line first, then the details") asks for something
the model may never sample. Rewards and the hinted teacher (`clawbridge.rewards.opd`) can only
reweight what was sampled; a preference the sampler never produces is never learned from them. A
capable judge can write the answer the way the user asked (`clawbridge.rewards.judge`, `REWRITE:`),
and that answer is trained as a demonstration beside the recorded turn.

Rules:
- Only a verdict of -1 with a rewrite makes one, only for a main turn that answered in text (no
  tool calls: a rewrite of a tool call is not a demonstration of anything the user saw).
- The recorded turn is never changed: it trains as before, with its own (negative) reward. The
  demonstration is a separate datum: the turn's TRAINED prompt ids (the prompt without notes, as
  recorded, never re-rendered) + the rewrite's ids, which are `Renderer.encode(rewrite)` followed
  by the stop token the recorded completion ended with (none when it ended without one).
- Its "sampler" logprobs are the base model's logprobs of those ids on that prompt (the backend's
  `LogprobScorer`), so the loss's importance ratio is the policy against the base, bounded by the
  loss's clipping like any stale sample. Every token gets advantage `rewrite_coef` (then the
  batch's normalization): a weighted likelihood term on the demonstration.
- The rewrite's text is whatever the judge wrote: with a privacy guard on training, its datum
  passes the same filter as the turn's (it carries the turn's id, so a finding drops both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clawbridge.rewards.opd import TeacherInput


def rewrite_input(renderer: Any, trained_prompt_ids: Sequence[int], rewrite: str,
                  recorded_completion_ids: Sequence[int]) -> TeacherInput | None:
    """The demonstration sequence of a rewrite (module rules), for the scorer; None when the
    rewrite encodes to no token."""
    ids = [int(t) for t in renderer.encode(rewrite.strip())]
    if not ids:
        return None
    stops = {int(t) for t in renderer.stop_token_ids}
    if recorded_completion_ids and int(recorded_completion_ids[-1]) in stops:
        ids.append(int(recorded_completion_ids[-1]))
    prompt = [int(t) for t in trained_prompt_ids]
    return TeacherInput(prompt + ids, len(prompt))


def rewrite_ids(inp: TeacherInput) -> list[int]:
    """The completion part of a rewrite's sequence."""
    return inp.tokens[inp.prompt_len:]
