"""Where the privacy filter runs, and what it counted: `PrivacyGuard`, built from the settings.

Invariants:
- `privacy = "auto"` filters training data when the backend is hosted (`Capabilities.hosted`:
  tinker, fireworks) and judge prompts when `judge = "endpoint"`; `on` filters both wherever they
  go; `off` neither. Serving itself is never filtered: a hosted backend samples the prompt it is
  asked (the agent's answer depends on it); docs/privacy.md says what leaves the machine.
- Counters hold kinds and numbers only, never text: `masked` counts findings replaced in training
  data of committed steps (`count_trained`, so a retried step counts once) and in judge prompts
  sent. Turns dropped as private are counted by the store (`dropped_reason = 'private'`).
- Thread-safe: the trainer prepares batches in a worker thread while the judge runs on the loop.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clawbridge.backend import Capabilities, Datum
from clawbridge.privacy.detect import DetectorFilter, PrivacyFilter, mask_text
from clawbridge.privacy.tokens import TextCodec, redact_datum

if TYPE_CHECKING:
    from clawbridge.config import Settings

DROP_REASON = "private"
"""`samples.dropped_reason` of a turn whose sampled answer held a finding."""


@dataclass(frozen=True)
class BatchRedaction:
    """A batch after the filter."""

    datums: list[Datum]
    dropped_turns: tuple[str, ...] = ()
    masked: Counter[str] = field(default_factory=Counter)


def is_hosted(backend: object) -> bool:
    """Whether the backend sends training data off this machine (`Capabilities.hosted`)."""
    caps = getattr(backend, "capabilities", None)
    return isinstance(caps, Capabilities) and caps.hosted


class PrivacyGuard:
    """The filter, the tokenizer it maps tokens with, where it is on, and its counters."""

    def __init__(self, pfilter: PrivacyFilter, codec: TextCodec, *, train: bool, judge: bool,
                 detectors: Sequence[str] = ()) -> None:
        self.filter = pfilter
        self.codec = codec
        self.train = train
        """Filter training batches before they reach the backend."""
        self.judge = judge
        """Filter the judge's prompts before they reach its endpoint."""
        self.detectors = tuple(detectors)
        self._lock = threading.Lock()
        self._masked: dict[str, Counter[str]] = {"train": Counter(), "judge": Counter()}
        self._judge_prompts = 0

    def redact_batch(self, datums: Sequence[Datum]) -> BatchRedaction:
        """Each datum through `redact_datum`: datums left with no span are not sent."""
        kept: list[Datum] = []
        dropped: list[str] = []
        masked: Counter[str] = Counter()
        for d in datums:
            r = redact_datum(d, self.codec, self.filter)
            if r.datum is not None:
                kept.append(r.datum)
            dropped.extend(r.dropped_turns)
            masked.update(r.masked)
        return BatchRedaction(kept, tuple(dropped), masked)

    def count_trained(self, masked: Counter[str]) -> None:
        """A step that sent datums with these findings masked has committed."""
        with self._lock:
            self._masked["train"].update(masked)

    def mask_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Chat messages with every finding in their text content replaced by its placeholder."""
        out: list[dict[str, Any]] = []
        found: Counter[str] = Counter()
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                findings = self.filter.find(content)
                found.update(f.kind for f in findings)
                m = {**m, "content": mask_text(content, findings)}
            out.append(m)
        with self._lock:
            self._masked["judge"].update(found)
            self._judge_prompts += 1 if found else 0
        return out

    def status(self) -> dict[str, Any]:
        """The privacy section of `/rl/status` (counts since start-up)."""
        with self._lock:
            return {"train": self.train, "judge": self.judge, "detectors": list(self.detectors),
                    "masked": {where: dict(c) for where, c in self._masked.items()},
                    "judge_prompts_masked": self._judge_prompts}


def build_guard(settings: Settings, backend: object, codec: TextCodec) -> PrivacyGuard | None:
    """The guard the settings ask for with this backend (None: the filter is off everywhere)."""
    mode = settings.privacy
    train = mode == "on" or (mode == "auto" and is_hosted(backend))
    judge = mode == "on" or (mode == "auto" and settings.judge == "endpoint")
    if not (train or judge):
        return None
    pfilter = DetectorFilter(settings.privacy_detectors, settings.privacy_patterns, settings.privacy_phone_regions)
    return PrivacyGuard(pfilter, codec, train=train, judge=judge, detectors=settings.privacy_detectors)
