"""The probe's likelihood guard: is a candidate still likely to SAY what the anchor answered right?

Why: the capability probe is greedy, and a person's agent samples. Measured on SmolLM2 taught by
talk (docs/training.md, "Tried: the probe's bar at the base alone"): after about 30 steps the greedy probe
and a greedy fact check still said "fine" while the same facts answered 8 times each at temperature
1 fell from 0.33 to 0.12-0.21, late versions saying gibberish where the base said the fact. What
moved is probability mass, and a forward pass sees it where a greedy answer cannot.

So, with `capability_probe_nats` > 0 and a sampler that scores given tokens (`SequenceScorer`: the
local torch engine, Tinker), every candidate also faces a reference set built once per anchor: the
anchor's own greedy answers to the probe questions it passes (token exact, cut where they name the
fact), with the anchor's logprobs of them. Each is a held-out-style item of verdict +1, scored by
`clawbridge.promotion.runner` as sigmoid(HELD_OUT_SCALE x margin), margin = the version's mean
per-token logprob of that answer minus the anchor's. The anchor scores 0.5; a candidate that lost
d nats per token on every answer scores sigmoid(-HELD_OUT_SCALE x d). `nats_tolerance(n)` is the
score tolerance that admits exactly d <= n, so the promoter's ordinary check (`Promoter._check`:
against the serving version and the anchor) holds a candidate within n nats per token of the
anchor's answers: a trust region measured where the user's capability lives.

Invariants:
- The reference set depends only on the anchor version and the probe (greedy answers, untempered
  scores), so its digest, and every version's cached figures on it, survive a restart.
- Off (None) where it cannot be measured: `capability_probe_nats` 0, a sampler that cannot score
  given tokens (Fireworks, SGLang), an anchor without a checkpoint, or an anchor that passes
  no more probe items than the slack (a random tiny model has nothing to lose, and is not asked
  40 answers for nothing). The promoter says which, once, in its log.
- Reference answers are cut at `capability_probe_max_tokens`: an answer that names its fact later
  is left out, so building the set costs at most one probe's worth of short greedy answers.
- One mechanism, three guards (`GUARDS`): `FACTS` on the probe's correct answers, `EVERYDAY` on the
  anchor's answers to everyday questions, `IN_CONTEXT` on its answers to the same questions in an
  agent's context, a profile and a note (`clawbridge.promotion.everyday`). Each has its own
  reference set and figure in status (the two everyday guards share their bar's setting); all are
  off where this one is.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from clawbridge.promotion.evalset import EvalItem, EvalSet, digest_of
from clawbridge.promotion.runner import HELD_OUT_SCALE

if TYPE_CHECKING:
    from clawbridge.config import Settings

log = logging.getLogger("clawbridge.promotion")

LIKELIHOOD_SOURCE = "the capability probe's likelihood"
"""How decisions and status name the reference set (`EvalSet.source`)."""


@dataclass(frozen=True)
class Guard:
    """One likelihood guard: whose answers it holds candidates to, and the setting of its bar."""

    key: str
    """Its figures' key in status (`capability_probe.<key>`) and its reference sets' digest tag."""
    setting: str
    """The `Settings` field with its bar in nats per token (0: off)."""
    source: str
    """Its reference set's `EvalSet.source`."""
    answers: str
    """What its reference answers are, for decisions and status ("correct probe answers")."""

    def bar(self, settings: Settings) -> float:
        """Its bar in nats per token (0: off)."""
        return float(getattr(settings, self.setting))


FACTS = Guard("likelihood", "capability_probe_nats", LIKELIHOOD_SOURCE, "correct probe answers")
EVERYDAY = Guard("everyday", "everyday_guard_nats", "the everyday answers' likelihood", "everyday answers")
IN_CONTEXT = Guard("in_context", "everyday_guard_nats", "the everyday answers' likelihood in context",
                   "everyday answers in an agent's context")
GUARDS = (FACTS, EVERYDAY, IN_CONTEXT)
"""In the order a decision checks them."""

GUARD_REASON = "likelihood of anchor"
"""How a decision's reason starts when a guard failed it (`clawbridge doctor` reads it)."""


@runtime_checkable
class ReferenceMaker(Protocol):
    """An evaluator that can write the reference set (`Evaluator`; `FakeEvaluator` beside it)."""

    async def references(self, version: int, eval_set: EvalSet, max_tokens: int) -> list[EvalItem] | None:
        """`version`'s greedy answers to the expect items it passes within `max_tokens`, as
        verdict +1 held-out items with its own logprobs of them; None when its sampler cannot
        score given tokens."""
        ...


def nats_tolerance(nats: float) -> float:
    """The score tolerance that admits a candidate whose answers lost at most `nats` per token
    against the reference (module doc): 0.5 - sigmoid(-HELD_OUT_SCALE x nats); 0 when off."""
    if nats <= 0:
        return 0.0
    return 0.5 - 1.0 / (1.0 + math.exp(HELD_OUT_SCALE * nats)) + 1e-9


def nats_of(score: float) -> float:
    """The per-token margin a reference-set score stands for (the inverse of the sigmoid; exact
    when every item moved alike), for the words of a decision."""
    s = min(1.0 - 1e-12, max(1e-12, score))
    return math.log(s / (1.0 - s)) / HELD_OUT_SCALE


def reference_set(guard: Guard, anchor: int, asked: EvalSet, items: list[EvalItem]) -> EvalSet:
    """`guard`'s reference set of `anchor`'s answers (`items`) to `asked` (the probe, or the
    everyday questions), with a digest of everything that decides a score."""
    parts = [[i.id, list(i.completion_ids)] for i in items]
    tag = "probe_likelihood" if guard == FACTS else guard.key  # FACTS' digests predate the second guard
    return EvalSet(tuple(items), guard.source, digest_of([tag, anchor, asked.digest, *parts]))


class GuardReferences:
    """Each guard's reference set per anchor, built once from the anchor's answers (module
    invariants); None where a guard is off against that anchor, said once in the log."""

    def __init__(self, maker: object, sets: dict[Guard, EvalSet], default_max_tokens: int) -> None:
        self.maker = maker
        """The evaluator that answers (a `ReferenceMaker`, else every guard is off)."""
        self.sets = sets
        """The questions each guard asks (the probe, the everyday set); a guard without one is off."""
        self.default_max_tokens = default_max_tokens
        """The cut of a question set that names none (`eval_max_tokens`)."""
        self._built: dict[tuple[str, int], EvalSet | None] = {}
        self._building = asyncio.Lock()
        """One build at a time: the baseline's and a first decision's ask for the same set."""

    def on(self, guard: Guard) -> bool:
        """Whether `guard` can be measured at all (its questions, an evaluator that can answer)."""
        return guard in self.sets and isinstance(self.maker, ReferenceMaker)

    def decided(self, guard: Guard, anchor: int) -> bool:
        """Whether `guard`'s set against `anchor` was built, or found off."""
        return (guard.key, anchor) in self._built

    def built(self, guard: Guard, anchor: int) -> EvalSet | None:
        """`guard`'s reference set against `anchor` if built (None: not yet, or off)."""
        return self._built.get((guard.key, anchor))

    async def get(self, guard: Guard, anchor: int, nothing_to_lose: str | None) -> EvalSet | None:
        """`guard`'s reference set against `anchor`, built at the first call. `nothing_to_lose`:
        why the anchor knows too little to guard (its probe figures), which turns it off."""
        async with self._building:
            return await self._get(guard, anchor, nothing_to_lose)

    async def _get(self, guard: Guard, anchor: int, nothing_to_lose: str | None) -> EvalSet | None:
        from clawbridge.serving.versions import VersionNotFound

        if (guard.key, anchor) in self._built:
            return self._built[guard.key, anchor]
        asked = self.sets[guard]
        items: list[EvalItem] | None = None
        if nothing_to_lose is not None:
            why = nothing_to_lose
        elif not isinstance(self.maker, ReferenceMaker):
            why = "the evaluator cannot write reference answers"
        else:
            try:  # each question set carries its own cut (capability_probe_max_tokens, EVERYDAY_MAX_TOKENS)
                items = await self.maker.references(anchor, asked, asked.max_tokens or self.default_max_tokens)
            except VersionNotFound as exc:
                why = f"v{anchor} cannot answer ({exc})"
            else:
                why = ("its sampler cannot score given tokens" if items is None
                       else f"it has no {guard.answers} to hold candidates to")
        built = self._built[guard.key, anchor] = reference_set(guard, anchor, asked, items) if items else None
        if built is None:
            log.warning("promotion: the likelihood guard on %s is off against anchor v%d: %s", guard.answers,
                        anchor, why)
        return built
