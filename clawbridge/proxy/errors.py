"""OpenAI-style error bodies, and the one exception type every handler raises.

Invariant: no request, however malformed, makes the proxy answer 500 with a traceback; bad input
is a 4xx with `{"error": {"message", "type", "param", "code"}}`, an unreachable model 502/504.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from clawbridge.access import Denied
from clawbridge.shapes.errors import ShapeError, first_problem

M = TypeVar("M", bound=BaseModel)

log = logging.getLogger("clawbridge.proxy")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "api_error",
    507: "api_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error answered to the client as OpenAI-style JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code, param=self.param)


def denied(d: Denied) -> ApiError:
    """The answer to a refusal of `clawbridge.access` the caller is told about."""
    return ApiError(d.status, d.message, code=d.code, param=d.param)


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error"), "param": param, "code": code}}


@contextlib.contextmanager
def refused_as_400() -> Iterator[None]:
    """A `ShapeError` of a request conversion (`clawbridge.shapes`) as the 400 `invalid_request` it answers."""
    try:
        yield
    except ShapeError as e:
        raise ApiError(400, str(e), code="invalid_request", param=e.param) from None


def validated(model: type[M], data: Any, *, code: str | None = None,
              message: str = "invalid field {loc}: {msg}", empty_loc: str = "body") -> M:
    """`data` as `model`, or a 422 naming the first bad field: `message` with `{loc}` (the dotted
    path, `empty_loc` for the whole body) and `{msg}` (pydantic's message)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        loc, msg = first_problem(exc)
        loc = loc or empty_loc
        raise ApiError(422, message.format(loc=loc, msg=msg), param=loc, code=code) from None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Denied)
    async def _denied(_: Request, exc: Denied) -> JSONResponse:  # `clawbridge.access`, from the store or the router
        return JSONResponse(denied(exc).body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = "no such route; see /v1/chat/completions, /v1/messages, /v1/responses, /v1/models, /health and /rl/*"
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        loc, msg = first_problem(exc, skip=("body",))
        return JSONResponse(error_body(422, f"invalid field {loc or 'body'}: {msg}", param=loc or None),
                            status_code=422)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while handling a request")
        return JSONResponse(error_body(500, "internal error; see the clawbridge log"), status_code=500)
