"""A candidate's checks and the one decision they make (`Promoter._evaluate`, its canary floor).

Invariants:
- A decision promotes only when every check passed; a check that could not fail (nothing to lose,
  `Check.score` None) passes.
- The first check is the main one: its figures stay at the top of the decision's `figures` (the
  shape status and the dashboard read); every check's figures are under `figures["checks"]` when
  there is more than one, so a decision keeps what each check saw.
- A rejection's reason names only the checks that failed; a promotion's names them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clawbridge.store.promotion import Decision, Verdict


@dataclass(frozen=True)
class Check:
    """A candidate against the serving version (and the anchor) on one evaluation set."""

    source: str
    """The set's `EvalSet.source`."""
    passed: bool
    reason: str
    """In words, with the figures it compared (shown in decisions, status and `clawbridge doctor`)."""
    score: float | None
    """The candidate's score (None: not evaluated, the check could not fail)."""
    incumbent_score: float
    figures: dict[str, Any]
    """What it compared (the serving version's, the anchor's and the candidate's evaluations)."""


def decision_of(candidate: int, serving: int, checks: list[Check]) -> Decision:
    """One decision of `candidate` against `serving` from `checks` (module invariants)."""
    main = checks[0]
    verdict: Verdict = "promoted" if all(c.passed for c in checks) else "rejected"
    figures = dict(main.figures)
    if len(checks) > 1:
        figures["checks"] = [{"source": c.source, "passed": c.passed, "reason": c.reason, **c.figures}
                             for c in checks]
    shown = [c for c in checks if not c.passed] if verdict == "rejected" else checks
    reason = "; and ".join(c.reason for c in shown)
    return Decision(candidate, verdict, "eval", reason, serving, main.score, main.incumbent_score, figures)
