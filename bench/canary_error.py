"""The canary's error rates, simulated: how often its sequential test (`clawbridge.promotion.stats`)
promotes a candidate worse than the incumbent by twice the tolerance (target: at most
1 - canary_confidence = 5%), and for an equal and a better candidate how often it promotes and after
how many sessions it decides.

Each run replays the canary as the server runs it, with the defaults (tolerance 0.05, confidence
0.95, min 20, max 200 sessions per side, share 0.2): every new session goes to the candidate with
probability `share`, ends rewarded > 0 with its side's success rate, and the test looks after EVERY
session (the most looks it can take; the server looks every promotion_poll_interval_s, never more
often than the sessions change). Seeded: the same arguments print the same figures.

Run (about a minute on one CPU core):
    python bench/canary_error.py
    python bench/canary_error.py --runs 2000 --base 0.8
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clawbridge.config import Settings
from clawbridge.promotion.promoter import NOISY_TOLERANCE
from clawbridge.promotion.stats import CanaryEvidence


@dataclass(frozen=True)
class Case:
    name: str
    delta: float
    """p_candidate - p_incumbent."""


@dataclass
class Result:
    promoted: int = 0
    rejected_by_test: int = 0
    rejected_at_cap: int = 0
    sessions: int = 0
    """Sessions (both sides) until the decision, summed over runs."""


def run_one(rng: random.Random, p_cand: float, p_inc: float, share: float, tolerance: float, min_s: int,
            max_s: int, confidence: float, result: Result) -> None:
    ev = CanaryEvidence(share, tolerance)
    n = 0
    while True:
        n += 1
        candidate = rng.random() < share
        ev.add(candidate, rng.random() < (p_cand if candidate else p_inc))
        outcome = ev.outcome(min_s, max_s, confidence)
        if outcome == "continue":
            continue
        result.sessions += n
        if outcome == "promote":
            result.promoted += 1
        elif ev.worse.wealth >= 1.0 / (1.0 - confidence):
            result.rejected_by_test += 1
        else:
            result.rejected_at_cap += 1
        return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000, help="simulated canaries per case (>= 1000 for the figures)")
    ap.add_argument("--base", type=float, default=0.5, help="the incumbent's share of sessions rewarded > 0")
    ap.add_argument("--seed", type=int, default=0)
    defaults = Settings()
    ap.add_argument("--tolerance", type=float, default=NOISY_TOLERANCE)
    ap.add_argument("--confidence", type=float, default=defaults.canary_confidence)
    ap.add_argument("--min-sessions", type=int, default=defaults.canary_min_sessions)
    ap.add_argument("--max-sessions", type=int, default=defaults.canary_max_sessions)
    ap.add_argument("--share", type=float, default=defaults.canary_share)
    args = ap.parse_args()
    tol = args.tolerance
    cases = [Case(f"worse by 2 x tolerance ({-2 * tol:+.2f})", -2 * tol), Case("equal (+0.00)", 0.0),
             Case(f"better by 2 x tolerance ({2 * tol:+.2f})", 2 * tol)]
    print(f"canary test by betting: tolerance {tol:g}, confidence {args.confidence:g}, min {args.min_sessions}, "
          f"max {args.max_sessions} sessions per side, share {args.share:g}; incumbent rate {args.base:g}; "
          f"{args.runs} runs per case, seed {args.seed}, a look after every session")
    print(f"{'candidate':<34} {'promoted':>10} {'rolled back by test':>20} {'at max_sessions':>16} "
          f"{'mean sessions to decide':>24}")
    t0 = time.monotonic()
    for i, case in enumerate(cases):
        rng = random.Random(args.seed * 1000 + i)
        res = Result()
        p_cand = min(1.0, max(0.0, args.base + case.delta))
        for _ in range(args.runs):
            run_one(rng, p_cand, args.base, args.share, tol, args.min_sessions, args.max_sessions, args.confidence,
                    res)
        pct = 100.0 / args.runs
        print(f"{case.name:<34} {res.promoted * pct:>9.1f}% {res.rejected_by_test * pct:>19.1f}% "
              f"{res.rejected_at_cap * pct:>15.1f}% {res.sessions / args.runs:>24.0f}")
    print(f"({time.monotonic() - t0:.1f} s)")


if __name__ == "__main__":
    main()
