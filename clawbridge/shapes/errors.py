"""`ShapeError`: a request whose shape the server refuses.

Invariant: its message is fit for an HTTP 400 body and names the field; `param` is that field's
dotted path (or None). The proxy answers it as 400 `invalid_request`; readers of recorded
requests treat it as "nothing usable in this request".
"""

from __future__ import annotations


class ShapeError(ValueError):
    """A refused request; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        """The offending field's dotted path, or None."""
