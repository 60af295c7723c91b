"""Stop strings over streamed text.

Invariant: text is released only once it cannot be the start of a stop string, so a stop string
split across pieces is never sent to the client; what is released before a match is exactly the
text before the first stop string. An end string (`ends`, e.g. the close of a tool call that must
be the last) also stops, but the text through its end is released.
"""

from __future__ import annotations


class StopMatcher:
    """Feed text pieces; get back releasable text and whether a stop string was hit."""

    def __init__(self, stops: list[str], ends: list[str] | None = None) -> None:
        """`stops`: strings that end the text before them; `ends`: strings that end it after them."""
        self.stops = [s for s in stops if s]
        self.ends = [s for s in ends or [] if s]
        self._held = ""
        self._keep = max((len(s) for s in self.stops + self.ends), default=1) - 1

    def push(self, piece: str) -> tuple[str, bool]:
        if not self.stops and not self.ends:
            return piece, False
        buf = self._held + piece
        cuts = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        cuts += [i + len(s) for s in self.ends if (i := buf.find(s)) >= 0]
        if cuts:
            self._held = ""
            return buf[: min(cuts)], True
        # Hold back the longest suffix that is a prefix of some stop or end string.
        hold = 0
        for k in range(min(self._keep, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops + self.ends):
                hold = k
                break
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out
