"""Smaller steps after rejected versions: the learning-rate scale of the trainer's next step.

A candidate the gate rejects was a step too far, or in a wrong direction, from the serving version,
and training resumes from the serving version's weights (`clawbridge.trainer.loop`, rollback). The
same size of step from the same place is likely to be rejected again: under the likelihood guard,
one talk run rejected 14 candidates in a row, each one full step from a serving version that stood
at the bar, and its weights froze for the rest of the run (docs/training.md, "Kept: the likelihood
guard"). So, as a trust region does, the step shrinks after a rejection and grows back after a
promotion.

Invariants:
- The scale is a function of the automatic decisions alone (`promotion_decisions`, oldest to
  newest, after the newest admin decision and within the newest `WINDOW`): it starts at 1; each
  rejection multiplies it by `factor`, never below `floor`; each promotion divides it by `factor`,
  never above 1. A restart computes the same scale from the same store.
- An admin decision (`clawbridge promote` / `rollback`) starts it again at 1: a person chose what
  serves, and the anchor moved with it.
- `factor` 1 (`step_backoff = 1`): always 1, the configured learning rate.
- The scale multiplies the configured learning rate of the next step only (`LossConfig.lr_scale`,
  honoured by every backend); it never changes a setting, a checkpoint or the optimizer's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from clawbridge.store.promotion import DecisionSource, Verdict

WINDOW = 64
"""Decisions read, newest first, on every call (so a restart reads the same ones). Older ones rarely
matter: with the defaults, three moves the same way reach a bound and forget what came before."""


@dataclass(frozen=True)
class StepScale:
    """The next step's learning-rate multiplier and the streak behind it (for logs and status)."""

    scale: float = 1.0
    rejected_in_a_row: int = 0
    """Automatic rejections since the last promotion or admin decision."""

    def words(self) -> str:
        """'0.25 x the learning rate (2 candidates rejected in a row)', for a log line."""
        if self.scale == 1.0:
            return "the full learning rate"
        why = (f"{self.rejected_in_a_row} candidate(s) rejected in a row" if self.rejected_in_a_row
               else "climbing back after rejected candidates")
        return f"{self.scale:.3g} x the learning rate ({why})"


FULL = StepScale()
"""Scale 1: the configured learning rate."""


def step_scale(newest_first: Sequence[tuple[Verdict, DecisionSource]], factor: float, floor: float) -> StepScale:
    """The scale after the decisions `newest_first` ((verdict, source) pairs, newest first:
    `PromotionStore.verdicts`; module invariants)."""
    if factor >= 1.0:
        return FULL
    history: list[Verdict] = []
    for verdict, source in newest_first[:WINDOW]:
        if source == "admin":
            break
        history.append(verdict)
    scale, streak = 1.0, 0
    for verdict in reversed(history):
        if verdict == "rejected":
            scale, streak = max(floor, scale * factor), streak + 1
        else:
            scale, streak = min(1.0, scale / factor), 0
    return StepScale(scale, streak)
