"""Rehearsal: a few of the anchor's own correct answers, trained beside every step's turns.

Why: each step that taught a preference by talk moved the anchor's correct probe answers down,
about 0.006 nats per token per step on SmolLM2, until the likelihood guard (`likelihood`) held
every later candidate and training froze (docs/training.md). A KL term toward the base on the
trained turns themselves held the drift and the preference with it: it pulls back exactly the
tokens the preference changes. Rehearsal pulls on other questions instead, the way replay and
pretraining-mix terms keep a fine-tuned model's general answers: short factual questions the
preference has no say in, answered as the anchor answered them.

Invariants:
- The pool ships with clawbridge (`rehearsal_set.jsonl` beside this module): short factual
  questions, each with a regular expression like the capability probe's. Its questions and
  answers are disjoint from the probe's and from the questions and facts of `clawbridge demo`
  and `bench/learn_from_talk.py` (tests/test_rehearsal.py), so the gate and the bench's own
  capability check still measure what rehearsal never trained.
- A `Rehearsal` holds the anchor's greedy answers to the pool questions it answers right (token
  exact, cut where they name the fact, with the anchor's logprobs: `Evaluator.references`, as the
  likelihood guard builds its set). It is built once per anchor, so it changes only when an
  admin's decision moves the anchor, and it is off (None) with `rehearsal_coef` 0, with promotion
  off, where the sampler cannot score given tokens (Fireworks, SGLang), when the anchor answers
  none of the pool, and, with the capability probe on, when the anchor passes no more probe items
  than the slack (a random tiny model: its few lucky matches are not knowledge to keep, as for
  the likelihood guard); the promoter says which, once, in its log. With the probe on, nothing is
  built or rehearsed until the anchor's probe figures are in the store (the serving version's
  baseline evaluation, or the first decision, brings them): the gate's timing stays its own.
  The set is asked for (`VersionGate.rehearsal`) only by a step that has turns to train, never
  by the gate's settle, so a server that only serves never generates for it. A build that raises
  (a busy or restarting engine) gives that step none and the next step tries again; after
  `REHEARSAL_TRIES` (3) such failures against one anchor it is off for that anchor, said once.
- A step trains `rehearsal_items` of them (`Rehearsal.pick`: a rotation by the step's number, so
  every answer comes back every len/k steps), each as one datum: its prompt + answer, every
  answer token with advantage `rehearsal_coef` x the batch's mean token scale (`mean_token_scale`)
  and the anchor's logprobs as the sampler's, so the importance ratio is the policy's over the
  anchor's. The datums carry no turn id, are counted in the step's `rehearsal_datums` and
  `rehearsal_tokens` (never in `turns` or `tokens`), and are added only to a batch that steps
  anyway: rehearsal never makes a step by itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from importlib import resources

from clawbridge.backend import Datum
from clawbridge.config import NormalizationRule
from clawbridge.promotion.evalset import EvalItem, EvalSet, parse_eval_set

log = logging.getLogger("clawbridge.promotion")

POOL_FILE = "rehearsal_set.jsonl"
POOL_SOURCE = "the built-in rehearsal set"


def rehearsal_pool(max_tokens: int) -> EvalSet:
    """The pool of rehearsal questions as an `EvalSet` of expect items."""
    text = resources.files("clawbridge.promotion").joinpath(POOL_FILE).read_text(encoding="utf-8")
    return parse_eval_set(text, POOL_SOURCE, max_tokens)


def mean_token_scale(rule: NormalizationRule, batch_tokens: int) -> float:
    """The mean, over a batch's `batch_tokens` loss tokens, of the factor its advantages are
    scaled by (`advantages.token_scales`): 1 for `sum`; 1 / tokens for `token_mean` and for
    `sequence_mean` alike (each turn's factor 1 / (length x turns), summed over its tokens)."""
    if rule == "sum":
        return 1.0
    return 1.0 / batch_tokens if batch_tokens > 0 else 0.0


@dataclass(frozen=True)
class Rehearsal:
    """The anchor's correct answers to the pool (module invariants)."""

    anchor: int
    """The version that answered (the gate's anchor when the set was built)."""
    items: tuple[EvalItem, ...]
    """Held-out items: prompt ids, the anchor's greedy answer ids, its logprobs of them."""

    def pick(self, step: int, k: int) -> tuple[EvalItem, ...]:
        """The `k` answers step number `step` rehearses: a window that moves by `k` each step and
        wraps around, so all of them come back in turn (no more than there are)."""
        n = len(self.items)
        if n == 0 or k <= 0:
            return ()
        start = (step * k) % n
        return tuple(self.items[(start + i) % n] for i in range(min(k, n)))

    def datums(self, step: int, k: int, advantage: float) -> list[Datum]:
        """The `pick`ed answers as datums, every answer token with `advantage`."""
        return [Datum.from_turn(i.prompt_ids, i.completion_ids, i.completion_logprobs,
                                [advantage] * len(i.completion_ids), self.anchor)
                for i in self.pick(step, k)]


async def build_rehearsal(maker: object, anchor: int, max_tokens: int) -> tuple[Rehearsal | None, str]:
    """`anchor`'s rehearsal set from `maker` (an evaluator that can write reference answers), or
    None with the reason it is off (module invariants)."""
    from clawbridge.promotion.likelihood import ReferenceMaker
    from clawbridge.serving.versions import VersionNotFound

    if not isinstance(maker, ReferenceMaker):
        return None, "the evaluator cannot write reference answers"
    try:
        items = await maker.references(anchor, rehearsal_pool(max_tokens), max_tokens)
    except VersionNotFound as exc:
        return None, f"v{anchor} cannot answer ({exc})"
    if items is None:
        return None, "its sampler cannot score given tokens"
    if not items:
        return None, f"v{anchor} answers none of the {POOL_SOURCE}'s questions"
    ordered = tuple(sorted(items, key=lambda i: i.id))
    return Rehearsal(anchor, ordered), f"{len(ordered)} of v{anchor}'s correct answers"


REHEARSAL_TRIES = 3
"""Builds of one anchor's rehearsal set that may raise before rehearsal is off against it."""


class RehearsalSets:
    """The rehearsal set per anchor, built once (module invariants): None where it is off against
    that anchor, said once in the log."""

    def __init__(self, maker: object, max_tokens: int, per_step: int) -> None:
        self.maker = maker
        """The evaluator that answers (`build_rehearsal`)."""
        self.max_tokens = max_tokens
        """The answers' cut (`capability_probe_max_tokens`)."""
        self.per_step = per_step
        """`rehearsal_items`, for the log."""
        self._sets: dict[int, Rehearsal | None] = {}
        self._failures: dict[int, int] = {}
        self.build_seconds: dict[int, float] = {}
        """How long building each anchor's set took (it runs inside the first step that asks)."""

    def decided(self, anchor: int) -> bool:
        """Whether `anchor`'s set was built, or found off."""
        return anchor in self._sets

    def built(self, anchor: int) -> Rehearsal | None:
        """`anchor`'s set if built (None: not yet, or off)."""
        return self._sets.get(anchor)

    async def get(self, anchor: int, nothing_to_keep: str | None) -> Rehearsal | None:
        """`anchor`'s set, built at the first call. `nothing_to_keep`: why the anchor knows too
        little to rehearse (its probe figures), which turns it off. A build that raises gives None
        and the next call tries again, up to `REHEARSAL_TRIES`."""
        if anchor in self._sets:
            return self._sets[anchor]
        built: Rehearsal | None = None
        if nothing_to_keep is not None:
            why = nothing_to_keep
        else:
            started = time.monotonic()
            try:
                built, why = await build_rehearsal(self.maker, anchor, self.max_tokens)
            except Exception as exc:  # rehearsal is an extra: the step trains without it, the next asks again
                failed = self._failures[anchor] = self._failures.get(anchor, 0) + 1
                if failed < REHEARSAL_TRIES:
                    log.warning("rehearsal: not built against anchor v%d (%s: %s); this step trains without it, "
                                "the next one tries again", anchor, type(exc).__name__, exc)
                    return None
                why = (f"{failed} builds failed, the last with {type(exc).__name__}: {exc} "
                       "(a restart or a new anchor tries again)")
            else:
                if built is not None:
                    self.build_seconds[anchor] = time.monotonic() - started
                    why += f", built in {self.build_seconds[anchor]:.1f} s"
        self._sets[anchor] = built
        if built is None:
            log.warning("rehearsal: off against anchor v%d: %s", anchor, why)
        else:
            log.info("rehearsal: %s, %d beside each step", why, self.per_step)
        return built
