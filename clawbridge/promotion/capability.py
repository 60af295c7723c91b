"""The built-in capability probe: the check every new version must pass when nobody wrote one.

A person who teaches their agent by talking about one thing ("too long", "call me Sam") rewards
that one thing; left alone, training buys it at any price (measured: SmolLM2 taught only by a
user's words learned the preference, 0.17 -> 1.00, and lost its facts, 5 of 6 -> 0 of 6). So,
unless the user turns it off, every candidate version must still answer the probe about as well as
the version serving now and the anchor (the base, or what the admin last chose): short factual
questions any assistant answers in a few words (capitals, arithmetic, the calendar, science), each
with a regular expression its greedy answer must match (`clawbridge.promotion.evalset`'s `expect`).

Rules:
- The items ship with clawbridge (`capability_probe.jsonl` beside this module), so every backend
  and every model get the same probe and its figures are comparable across versions and runs. They
  are disjoint from the questions `clawbridge demo` and `bench/learn_from_talk.py` use for their own
  capability check (the gate never sees those: `tests/test_capability_probe.py`).
- A version's probe score is the share of items it passes. A candidate passes the probe when its
  score is at least the serving version's and the anchor's minus `slack` items
  (`capability_probe_slack`, default 1): one item of slack, because a small model's greedy answer
  to one question flips back and forth as its style changes (docs/promotion.md, "The real model").
- A model that passes no item (a random tiny model) has nothing to lose: every candidate passes.
- Greedy answers are cut at `capability_probe_max_tokens` (32), and stop as soon as they match
  (`clawbridge.promotion.runner`): a sentence that names the fact is enough, and an evaluation of a
  version costs 40 short answers.
"""

from __future__ import annotations

from dataclasses import replace
from importlib import resources

from clawbridge.promotion.evalset import EvalSet, digest_of, parse_eval_set

PROBE_FILE = "capability_probe.jsonl"
PROBE_SOURCE = "the built-in capability probe"
"""How decisions and status name the probe (`EvalSet.source`)."""


def capability_probe(max_tokens: int) -> EvalSet:
    """The built-in probe as an `EvalSet` (its digest covers the items and `max_tokens`)."""
    text = resources.files("clawbridge.promotion").joinpath(PROBE_FILE).read_text(encoding="utf-8")
    probe = parse_eval_set(text, PROBE_SOURCE, max_tokens)
    # answers were cut at eval_max_tokens until 2026-11-28: figures cached before then are not reused
    return replace(probe, digest=digest_of(["answers cut at max_tokens", probe.digest]))


def probe_tolerance(probe: EvalSet, slack_items: int) -> float:
    """`slack_items` items of the probe as a score tolerance (a hair above, so that exactly that
    many items lost still passes despite float rounding)."""
    if not probe.items or slack_items <= 0:
        return 0.0
    return slack_items / len(probe.items) + 1e-9
