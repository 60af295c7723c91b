"""The trainer loop's gate: promotion (`clawbridge.promotion.promoter.Promoter`) as the loop sees it.

The loop asks the gate before every step (under its lock) whether the newest committed version is
settled; see the `VersionGate` invariants in `clawbridge.trainer.loop`. A fake beside it, for tests.

A user's lane (`clawbridge.trainer.lanes`) has no gate of its own: its versions serve its user once
committed. `RehearsalOnly` is its gate: it never holds, holds out nothing, and hands the lane's steps
the shared gate's rehearsal set, so a user's adapter taught by talk rehearses the same facts as the
shared policy does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from clawbridge.promotion.backoff import FULL, StepScale
from clawbridge.promotion.rehearsal import Rehearsal


class GateDecision(Protocol):
    """What `VersionGate.settle` answers (`clawbridge.promotion.promoter.Settled`)."""

    @property
    def hold(self) -> str | None: ...

    @property
    def resume_from(self) -> int | None: ...

    @property
    def step(self) -> StepScale: ...


class VersionGate(Protocol):
    """Promotion as the trainer loop sees it (module invariants).

    Fake: `FakeGate` below. Tested by tests/test_promotion.py."""

    async def settle(self) -> GateDecision:
        """Decide the newest committed version if it is pending; called under the loop's lock."""
        ...

    def held_out(self, session_id: str) -> bool:
        """This session's turns are kept out of training (they evaluate versions)."""
        ...

    async def rehearsal(self) -> Rehearsal | None:
        """The anchor's answers to rehearse beside a step that trains (`clawbridge.promotion.rehearsal`);
        asked only by a step that has turns to train, so an idle server builds nothing."""
        ...


class RehearsalSource(Protocol):
    """Where `RehearsalOnly` gets its set: the shared gate (`VersionGate.rehearsal`)."""

    async def rehearsal(self) -> Rehearsal | None: ...


@dataclass(frozen=True)
class Decided:
    """A `GateDecision`; the defaults go ahead: nothing held, nothing to resume from, a full step."""

    hold: str | None = None
    resume_from: int | None = None
    step: StepScale = FULL


class RehearsalOnly:
    """The gate of a user's lane (module doc): goes ahead always, and rehearses `source`'s set."""

    def __init__(self, source: RehearsalSource) -> None:
        self.source = source

    async def settle(self) -> GateDecision:
        return Decided()

    def held_out(self, session_id: str) -> bool:
        return False

    async def rehearsal(self) -> Rehearsal | None:
        return await self.source.rehearsal()


class FakeGate:
    """Answers `settle` from a list (then holds nothing); holds out the sessions in `held`; answers
    `rehearsal` from `rehearsals` (then None)."""

    def __init__(self, answers: list[Decided] | None = None, held: set[str] | None = None,
                 rehearsals: list[Rehearsal | None] | None = None) -> None:
        self.answers = list(answers or [])
        self.held = held or set()
        self.rehearsals = list(rehearsals or [])
        self.calls = 0
        self.rehearsal_calls = 0

    async def settle(self) -> GateDecision:
        self.calls += 1
        return self.answers.pop(0) if self.answers else Decided()

    def held_out(self, session_id: str) -> bool:
        return session_id in self.held

    async def rehearsal(self) -> Rehearsal | None:
        self.rehearsal_calls += 1
        return self.rehearsals.pop(0) if self.rehearsals else None
