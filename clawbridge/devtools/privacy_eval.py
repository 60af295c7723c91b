"""Scoring a `PrivacyFilter` against labelled strings (tests/data/privacy_cases.jsonl).

A case is `{"text": ..., "find": [substrings that must be masked], "group": ...}`; a case with an
empty `find` holds none (a look-alike: an order number, a date, a version, a git SHA, ...).

- recall: the share of expected substrings that one finding covers entirely;
- false-positive rate: the share of cases without secrets where anything was found;
- extra findings: findings in cases with secrets that overlap none of the expected substrings.

Run `python -m clawbridge.devtools.privacy_eval [cases.jsonl]` to print them (with the misses and
false positives by group, never more text than the case file already holds).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from clawbridge.privacy.detect import PrivacyFilter

DEFAULT_CASES = Path(__file__).resolve().parents[2] / "tests" / "data" / "privacy_cases.jsonl"


@dataclass
class Score:
    expected: int = 0
    found: int = 0
    negatives: int = 0
    false_positives: int = 0
    extra: int = 0
    misses: list[str] = field(default_factory=list)
    """`group: substring` of each expected substring not covered."""
    flagged: list[str] = field(default_factory=list)
    """`group: text` of each negative case where something was found."""

    @property
    def recall(self) -> float:
        return self.found / self.expected if self.expected else 1.0

    @property
    def false_positive_rate(self) -> float:
        return self.false_positives / self.negatives if self.negatives else 0.0


def load_cases(path: Path = DEFAULT_CASES) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def evaluate(pfilter: PrivacyFilter, cases: list[dict[str, object]]) -> Score:
    score = Score()
    for case in cases:
        text, want, group = str(case["text"]), [str(s) for s in case["find"]], str(case.get("group", ""))  # type: ignore[attr-defined]
        found = pfilter.find(text)
        if not want:
            score.negatives += 1
            if found:
                score.false_positives += 1
                score.flagged.append(f"{group}: {text}")
            continue
        spans = [(text.index(s), text.index(s) + len(s)) for s in want]
        for (lo, hi), s in zip(spans, want, strict=True):
            score.expected += 1
            if any(f.start <= lo and f.end >= hi for f in found):
                score.found += 1
            else:
                score.misses.append(f"{group}: {s}")
        score.extra += sum(1 for f in found if not any(f.start < hi and f.end > lo for lo, hi in spans))
    return score


def main(argv: list[str]) -> None:
    from clawbridge.privacy.detect import DetectorFilter

    cases = load_cases(Path(argv[0]) if argv else DEFAULT_CASES)
    s = evaluate(DetectorFilter(), cases)
    print(f"{len(cases)} cases: {s.expected} expected findings in {len(cases) - s.negatives} cases, "
          f"{s.negatives} cases without secrets")
    print(f"recall {s.recall:.3f} ({s.found}/{s.expected}); false-positive rate {s.false_positive_rate:.3f} "
          f"({s.false_positives}/{s.negatives}); extra findings in cases with secrets: {s.extra}")
    for m in s.misses:
        print(f"  missed {m}")
    for f in s.flagged:
        print(f"  flagged {f}")


if __name__ == "__main__":
    main(sys.argv[1:])
