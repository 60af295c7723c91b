"""The statistics promotion decides with: a Wilson interval for pass rates, and the canary's
sequential test, an anytime-valid test by betting. Pure functions, no I/O, deterministic (the
same sessions in the same order give the same figures everywhere).

The canary test (documented in docs/promotion.md; its error rates are simulated by
`bench/canary_error.py`):
- Each finished, rewarded session is a success when its reward is > 0 (explicit rewards, else the
  judge's verdicts: the same rewards training uses). Each side (candidate, incumbent) has a
  success rate; d = p_candidate - p_incumbent.
- Observations: sessions are paired in the order they became countable, `k_c` candidate sessions
  with `k_i` incumbent ones (`pair_sizes`: 1 with 4 at the default share 0.2, the ratio in which
  the router sends new sessions), and each pair gives z = (mean of its candidate successes) -
  (mean of its incumbent successes), in [-1, 1] with E[z] = d. Sessions are independent, so the
  z's are too.
- Two tests by betting (Shafer 2021, "Testing by betting", JRSS A 184(2); Waudby-Smith & Ramdas
  2024, "Estimating means of bounded random variables by betting", JRSS B 86(1)): for the null
  H: E[X] <= 0 of a bounded X, the wealth K_t = prod (1 + lambda_i X_i), with each bet lambda_i
  in [0, 1/L) chosen from X_1..X_{i-1} only (L the most X can lose), is a nonnegative
  supermartingale under every distribution in H, so by Ville's inequality P(K_t ever reaches
  1/alpha) <= alpha: it may be looked at after every session, any number of times, and stopped
  whenever. The bets are the aGRAPA rule of Waudby-Smith & Ramdas (section 5), lambda =
  mean / (variance + mean^2) of the past X's (regularized by one pseudo-observation of mean 0 and
  variance 1/4), truncated at half the maximum (`TRUNCATION`), as in their `confseq` package.
  * promote: X = z + tolerance (null: the candidate is worse than the incumbent by the tolerance
    or more); `e_not_worse` is its wealth.
  * roll back: X = -z (null: the candidate is at least as good as the incumbent); `e_worse`.
- Stopping rule, checked whenever the sessions change: nothing before both sides have
  `min_sessions`; then promote when e_not_worse >= 1 / (1 - confidence), roll back when
  e_worse >= 1 / (1 - confidence); once both sides have `max_sessions`, roll back (not shown to
  be within the tolerance: never worse by default). So a candidate worse by the tolerance or more
  is promoted with probability <= 1 - confidence, and one at least as good is rolled back by the
  test with probability <= 1 - confidence, however often the test looks; `max_sessions` adds
  roll-backs of candidates the sessions could not tell apart.
- Why not a posterior: the beta-binomial rule used before ("promote when P(not worse) >= 0.95,
  looked at after every session") promoted a candidate 0.10 worse in 12-14% of simulated runs,
  since a posterior probability checked again and again crosses 0.95 by chance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Z95 = 1.959963984540054

TRUNCATION = 0.5
"""Bets are at most this share of the largest bet that cannot go broke."""


def wilson(passed: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of a pass rate `passed / n`; (0, 1) for n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = passed / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


class BettingTest:
    """The wealth of betting against H: E[X] <= 0, for X in [-max_loss, +inf) (module doc)."""

    def __init__(self, max_loss: float) -> None:
        if max_loss <= 0:
            raise ValueError("max_loss must be > 0")
        self.cap = TRUNCATION / max_loss
        self.wealth = 1.0
        self.n = 0
        self._sum = 0.0
        self._squares = 0.0

    def bet(self) -> float:
        """The next bet, from the past observations only (aGRAPA, truncated), with one
        pseudo-observation of mean 0 and variance 1/4."""
        n = self.n
        mean = self._sum / (n + 1)
        if mean <= 0:
            return 0.0
        var = (0.25 + self._squares - 2.0 * mean * self._sum + n * mean * mean) / (n + 1)
        return min(self.cap, mean / (var + mean * mean))

    def update(self, x: float) -> None:
        self.wealth *= 1.0 + self.bet() * x
        self.n += 1
        self._sum += x
        self._squares += x * x


def pair_sizes(share: float) -> tuple[int, int]:
    """(candidate sessions, incumbent sessions) per observation: the ratio `share` sends them in."""
    if not 0.0 < share < 1.0:
        return 1, 1
    if share <= 0.5:
        return 1, max(1, round((1.0 - share) / share))
    return max(1, round(share / (1.0 - share))), 1


CanaryOutcome = Literal["promote", "reject", "continue"]


class CanaryEvidence:
    """Both tests over the sessions seen so far, updated one session at a time (`add`)."""

    def __init__(self, share: float, tolerance: float) -> None:
        if not 0.0 <= tolerance <= 1.0:
            raise ValueError("tolerance must be in [0, 1]")
        self.tolerance = tolerance
        self.kc, self.ki = pair_sizes(share)
        self.not_worse = BettingTest(max_loss=max(0.01, 1.0 - tolerance))
        """X = z + tolerance >= -1 + tolerance."""
        self.worse = BettingTest(max_loss=1.0)
        """X = -z >= -1."""
        self.cand: list[bool] = []
        self.inc: list[bool] = []
        self.pairs = 0

    @classmethod
    def of(cls, cand: Sequence[bool], inc: Sequence[bool], share: float, tolerance: float) -> CanaryEvidence:
        ev = cls(share, tolerance)
        ev.cand, ev.inc = list(cand), list(inc)
        ev._pair()
        return ev

    def add(self, candidate: bool, success: bool) -> None:
        """One more countable session, of the candidate's side or the incumbent's."""
        (self.cand if candidate else self.inc).append(success)
        self._pair()

    def _pair(self) -> None:
        while len(self.cand) >= (self.pairs + 1) * self.kc and len(self.inc) >= (self.pairs + 1) * self.ki:
            j = self.pairs
            z = (sum(self.cand[j * self.kc:(j + 1) * self.kc]) / self.kc
                 - sum(self.inc[j * self.ki:(j + 1) * self.ki]) / self.ki)
            self.not_worse.update(z + self.tolerance)
            self.worse.update(-z)
            self.pairs += 1

    def outcome(self, min_sessions: int, max_sessions: int, confidence: float) -> CanaryOutcome:
        """The stopping rule (module doc)."""
        cn, inn = len(self.cand), len(self.inc)
        if cn < min_sessions or inn < min_sessions:
            return "continue"
        threshold = 1.0 / (1.0 - confidence)
        if self.not_worse.wealth >= threshold:
            return "promote"
        if self.worse.wealth >= threshold or (cn >= max_sessions and inn >= max_sessions):
            return "reject"
        return "continue"


@dataclass(frozen=True)
class CanaryTest:
    """The canary's counts, its evidence and what the stopping rule says about them."""

    cand_n: int
    cand_successes: int
    inc_n: int
    inc_successes: int
    pairs: int
    e_not_worse: float
    """The promote test's wealth: evidence the candidate is not worse than the incumbent - tolerance."""
    e_worse: float
    """The roll-back test's wealth: evidence the candidate is worse than the incumbent."""
    threshold: float
    """1 / (1 - confidence): the wealth that decides."""
    outcome: CanaryOutcome
    why: str

    def as_dict(self) -> dict[str, object]:
        return {"candidate_sessions": self.cand_n, "candidate_successes": self.cand_successes,
                "incumbent_sessions": self.inc_n, "incumbent_successes": self.inc_successes, "pairs": self.pairs,
                "e_not_worse": self.e_not_worse, "e_worse": self.e_worse, "threshold": self.threshold,
                "outcome": self.outcome, "why": self.why}


def canary_test(cand: Sequence[bool], inc: Sequence[bool], *, share: float, tolerance: float, min_sessions: int,
                max_sessions: int, confidence: float) -> CanaryTest:
    """Apply the stopping rule (module doc) to the sessions so far: each side's successes, in the
    order the sessions became countable."""
    ev = CanaryEvidence.of(cand, inc, share, tolerance)
    outcome = ev.outcome(min_sessions, max_sessions, confidence)
    threshold = 1.0 / (1.0 - confidence)
    cn, cw, inn, iw = len(cand), sum(cand), len(inc), sum(inc)

    def rate(s: int, n: int) -> str:
        return f"{s}/{n} = {s / n:.2f}" if n else "0/0"

    counts = f"candidate {rate(cw, cn)} sessions rewarded > 0, incumbent {rate(iw, inn)}"
    tol = f" - {tolerance:g}" if tolerance else ""
    evidence = (f"evidence candidate >= incumbent{tol}: {ev.not_worse.wealth:.3g}, candidate worse: "
                f"{ev.worse.wealth:.3g} ({ev.pairs} pairs; {threshold:.3g} decides)")
    if cn < min_sessions or inn < min_sessions:
        why = f"{counts}; waiting for {min_sessions} rewarded sessions on each side"
    elif outcome == "promote":
        why = f"{counts}; {evidence}: not worse"
    elif outcome == "reject" and ev.worse.wealth >= threshold:
        why = f"{counts}; {evidence}: worse"
    elif outcome == "reject":
        why = (f"{counts}; {evidence}; both sides reached canary_max_sessions ({max_sessions}) without showing "
               "the candidate is not worse: rolled back")
    else:
        why = f"{counts}; {evidence}: not yet decisive"
    return CanaryTest(cn, cw, inn, iw, ev.pairs, ev.not_worse.wealth, ev.worse.wealth, threshold, outcome, why)
