"""Stop strings over streamed text.

Invariant: text is released only once it cannot be the start of a stop string, so a stop string
split across pieces is never sent to the client; what is released before a match is exactly the
text before the first stop string.
"""

from __future__ import annotations


class StopMatcher:
    """Feed text pieces; get back releasable text and whether a stop string was hit."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self._keep = max((len(s) for s in self.stops), default=1) - 1

    def push(self, piece: str) -> tuple[str, bool]:
        if not self.stops:
            return piece, False
        buf = self._held + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        # Hold back the longest suffix that is a prefix of some stop string.
        hold = 0
        for k in range(min(self._keep, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                hold = k
                break
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out
