"""On-policy distillation (OPD) from hindsight hints: teacher inputs and per-token advantages.

Rules:
- The teacher is the base model (no adapters) given the SAME conversation with the hint added to
  it: the hint is appended to the last user message as `\\n\\n[Hint: <hint>]` (a user message is
  added when there is none). The hinted messages are rendered with the served chat template to
  prompt ids; the RECORDED completion ids are appended unchanged. Completion text is never
  re-tokenized, so teacher and sampler logprobs are over the very same token ids.
- Per completion token t: `opd_advantage[t] = coef * (teacher_logprob[t] - sampler_logprob[t])`.
  Positive where the hinted teacher finds the sampled token likelier than the policy did.
- A turn served with notes (`clawbridge.rewards.notes`) was sampled with the note, which is the
  hint in the same words, already in its context: its sampled logprobs carry the hint, and teacher
  minus sampler measures the note against itself (slightly negative on such turns: a push AWAY
  from the answers the note brought; docs/training.md, "OPD against the plain prompt"). Such a
  turn trains on its plain prompt, so its reference is the base model on that plain prompt
  (`reference_input`, scored by the same scorer as the teacher):
  `opd_advantage[t] = coef * (teacher_logprob[t] - reference_logprob[t])`, what the hint changes
  in the model's reading of the answer.
- A turn gets OPD only when the judge extracted a hint and the backend can score
  (`clawbridge.backend.LogprobScorer`); the trainer combines it with the RL part per
  `clawbridge.trainer.advantages` rule 5.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clawbridge.shapes.recorded import openai_view

HINT_TEMPLATE = "\n\n[Hint: {hint}]"


def hinted_messages(messages: Sequence[Mapping[str, Any]], hint: str) -> list[dict[str, Any]]:
    """A copy of `messages` with the hint appended to the last user message (see rules)."""
    out = [copy.deepcopy(dict(m)) for m in messages]
    suffix = HINT_TEMPLATE.format(hint=hint.strip())
    for m in reversed(out):
        if m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = [*content, {"type": "text", "text": suffix.lstrip()}]
        else:
            m["content"] = f"{content or ''}{suffix}"
        return out
    out.append({"role": "user", "content": suffix.lstrip()})
    return out


@dataclass(frozen=True)
class TeacherInput:
    """One sequence for the teacher to score."""

    tokens: list[int]
    """Hinted prompt ids + the recorded completion ids."""
    prompt_len: int
    """How many of `tokens` are the hinted prompt; logprobs are wanted for the rest."""


def teacher_input(
    renderer: Any, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None,
    tool_choice: Any, hint: str, completion_ids: Sequence[int],
) -> TeacherInput:
    """Render the hinted conversation and append the recorded completion ids (never re-tokenized)."""
    prompt = renderer.render(hinted_messages(messages, hint), tools, tool_choice)
    return TeacherInput(list(prompt) + [int(t) for t in completion_ids], len(prompt))


def reference_input(train_prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> TeacherInput:
    """The plain-prompt reference of a turn served with notes: the prompt it trains on (no notes,
    no hint) + its recorded completion ids, for the same scorer as the teacher (rules above)."""
    return TeacherInput([int(t) for t in train_prompt_ids] + [int(t) for t in completion_ids], len(train_prompt_ids))


def request_tools(request: Mapping[str, Any], api: str) -> tuple[list[dict[str, Any]] | None, Any]:
    """(tools, tool_choice) of a recorded request, in OpenAI shape (`clawbridge.shapes.recorded`)."""
    view = openai_view(request, api)
    return view.tools, view.tool_choice


def opd_advantages(teacher: Sequence[float], sampler: Sequence[float], coef: float,
                   reference: Sequence[float] | None = None) -> list[float]:
    """`coef * (teacher - sampler)` per completion token, or `coef * (teacher - reference)` for a
    turn served with notes (`reference` given; rules above)."""
    against = sampler if reference is None else reference
    if len(teacher) != len(sampler) or len(against) != len(sampler):
        raise ValueError(f"teacher has {len(teacher)} logprobs, the reference {len(against)}, "
                         f"the sampler {len(sampler)}")
    return [coef * (float(t) - float(s)) for t, s in zip(teacher, against, strict=True)]
