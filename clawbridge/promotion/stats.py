"""The statistics promotion decides with: a Wilson interval for pass rates, and the canary's
sequential test (a beta-binomial posterior with a stopping rule). Pure functions, no I/O.

The canary test (documented in docs/promotion.md):
- Each finished, rewarded session is a success when its reward is > 0 (explicit rewards, else the
  judge's verdicts: the same rewards training uses). Each side (candidate, incumbent) has a share
  p of successes, with a uniform Beta(1, 1) prior, so after s successes in n sessions its
  posterior is Beta(1 + s, 1 + n - s).
- `p_not_worse` = P(p_candidate >= p_incumbent - tolerance) under the two posteriors, computed
  on a grid of `GRID` points (deterministic: the same counts give the same figure everywhere).
- Stopping rule, checked whenever the counts change: nothing before both sides have
  `min_sessions`; then promote when p_not_worse >= confidence, roll back when p_not_worse <=
  1 - confidence; once both sides have `max_sessions`, decide on p_not_worse >= 0.5. A Bayesian
  posterior may be looked at after every session without the peeking penalty a fixed-sample
  test pays; `min_sessions` keeps the first few sessions from deciding alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

GRID = 2000
"""Grid points on [0, 1] for the posterior integrals."""

Z95 = 1.959963984540054


def wilson(passed: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of a pass rate `passed / n`; (0, 1) for n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = passed / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _beta_masses(successes: int, failures: int) -> list[float]:
    """Posterior Beta(1 + successes, 1 + failures) as masses on the grid's cell midpoints."""
    a, b = 1 + successes, 1 + failures
    logs = []
    for i in range(GRID):
        x = (i + 0.5) / GRID
        logs.append((a - 1) * math.log(x) + (b - 1) * math.log(1 - x))
    top = max(logs)
    w = [math.exp(v - top) for v in logs]
    total = sum(w)
    return [v / total for v in w]


def p_not_worse(cand_successes: int, cand_n: int, inc_successes: int, inc_n: int, tolerance: float) -> float:
    """P(p_candidate >= p_incumbent - tolerance) under uniform-prior beta posteriors."""
    cand = _beta_masses(cand_successes, cand_n - cand_successes)
    inc = _beta_masses(inc_successes, inc_n - inc_successes)
    # tail[i] = P(p_candidate >= grid point i)
    tail = [0.0] * (GRID + 1)
    for i in range(GRID - 1, -1, -1):
        tail[i] = tail[i + 1] + cand[i]
    shift = tolerance * GRID
    total = 0.0
    for j, mass in enumerate(inc):
        k = math.ceil(j - shift)  # candidate cells at or above p_incumbent - tolerance
        total += mass * (tail[k] if k > 0 else 1.0) if k <= GRID else 0.0
    return min(1.0, max(0.0, total))


CanaryOutcome = Literal["promote", "reject", "continue"]


@dataclass(frozen=True)
class CanaryTest:
    """The canary's counts and what the stopping rule says about them."""

    cand_n: int
    cand_successes: int
    inc_n: int
    inc_successes: int
    p_not_worse: float | None
    """None until both sides have `min_sessions`."""
    outcome: CanaryOutcome
    why: str

    def as_dict(self) -> dict[str, object]:
        return {"candidate_sessions": self.cand_n, "candidate_successes": self.cand_successes,
                "incumbent_sessions": self.inc_n, "incumbent_successes": self.inc_successes,
                "p_not_worse": self.p_not_worse, "outcome": self.outcome, "why": self.why}


def canary_test(cand_successes: int, cand_n: int, inc_successes: int, inc_n: int, *, tolerance: float,
                min_sessions: int, max_sessions: int, confidence: float) -> CanaryTest:
    """Apply the stopping rule (module doc) to the counts so far."""
    def rate(s: int, n: int) -> str:
        return f"{s}/{n} = {s / n:.2f}" if n else "0/0"

    counts = (f"candidate {rate(cand_successes, cand_n)} sessions rewarded > 0, incumbent "
              f"{rate(inc_successes, inc_n)}")
    if cand_n < min_sessions or inc_n < min_sessions:
        return CanaryTest(cand_n, cand_successes, inc_n, inc_successes, None, "continue",
                          f"{counts}; waiting for {min_sessions} rewarded sessions on each side")
    p = p_not_worse(cand_successes, cand_n, inc_successes, inc_n, tolerance)
    tol = f" - {tolerance:g}" if tolerance else ""
    stated = f"{counts}; P(candidate >= incumbent{tol}) = {p:.3f}"
    if p >= confidence:
        return CanaryTest(cand_n, cand_successes, inc_n, inc_successes, p, "promote",
                          f"{stated} >= {confidence:g}")
    if p <= 1 - confidence:
        return CanaryTest(cand_n, cand_successes, inc_n, inc_successes, p, "reject",
                          f"{stated} <= {1 - confidence:.3g}")
    if cand_n >= max_sessions and inc_n >= max_sessions:
        verdict: CanaryOutcome = "promote" if p >= 0.5 else "reject"
        return CanaryTest(cand_n, cand_successes, inc_n, inc_successes, p, verdict,
                          f"{stated}; both sides reached canary_max_sessions ({max_sessions}), decided on 0.5")
    return CanaryTest(cand_n, cand_successes, inc_n, inc_successes, p, "continue",
                      f"{stated}; not yet decisive (needs >= {confidence:g} or <= {1 - confidence:.3g})")
