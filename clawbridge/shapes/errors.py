"""`ShapeError`: a request whose shape the server refuses.

Invariant: its message is fit for an HTTP 400 body and names the field; `param` is that field's
dotted path (or None). The proxy answers it as 400 `invalid_request`; readers of recorded
requests treat it as "nothing usable in this request".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ShapeError(ValueError):
    """A refused request; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        """The offending field's dotted path, or None."""


def invalid(message: str, param: str | None = None) -> ShapeError:
    """A request the server refuses (the proxy answers 400 `invalid_request`)."""
    return ShapeError(message, param)


class Problems(Protocol):
    """A pydantic `ValidationError`, or FastAPI's `RequestValidationError` (the same error dicts)."""

    def errors(self) -> Sequence[Any]: ...


def first_problem(exc: Problems, skip: tuple[str, ...] = ()) -> tuple[str, str]:
    """The first error of a validation error: the field's dotted path ("" for the whole body;
    path parts in `skip` left out) and pydantic's message. Every 4xx built from one names the
    field this way."""
    errors = exc.errors()
    err: dict[str, Any] = dict(errors[0]) if errors else {}
    loc = ".".join(str(p) for p in err.get("loc", ()) if str(p) not in skip)
    return loc, str(err.get("msg", "invalid"))


def validated(model: type[M], data: Any, *, prefix: str = "invalid field ") -> M:
    """`data` as `model`, or a `ShapeError` "<prefix><field>: <message>" naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        loc, msg = first_problem(exc)
        raise ShapeError(f"{prefix}{loc}: {msg}", loc) from None
