"""SGLang's errors mapped to `SamplerError`s, for the engine and its streams alike.

Invariants:
- An HTTP-like status from SGLang maps to one `SamplerError`: 429/503 or a full queue ->
  `SamplerOverloaded` (with the engine's Retry-After), 400 about the context length ->
  `PromptTooLong`, 408/504 -> `SamplerTimeout`, anything else -> `SamplerUnavailable`.
- A transport failure is `SamplerTimeout` when it timed out, else `SamplerUnavailable`.
"""

from __future__ import annotations

from typing import Any

import httpx

from clawbridge.serving.sampler import (
    PromptTooLong,
    SamplerError,
    SamplerOverloaded,
    SamplerTimeout,
    SamplerUnavailable,
)

OVERLOAD_STATUS = (429, 503)


def request_error(status: int, message: str, retry_after_s: float) -> SamplerError:
    """The SamplerError for an SGLang rejection with HTTP-like `status`."""
    low = message.lower()
    if status in OVERLOAD_STATUS or "queue is full" in low:
        return SamplerOverloaded(f"sglang is overloaded: {message}", retry_after_s=retry_after_s)
    if status == 400 and ("context length" in low or "longer than" in low):
        return PromptTooLong(f"sglang: {message}")
    if status in (408, 504):
        return SamplerTimeout(f"sglang timed out: {message}")
    return SamplerUnavailable(f"sglang failed ({status}): {message}")


def transport_error(exc: httpx.HTTPError, what: str) -> SamplerError:
    """The SamplerError for a failed HTTP exchange with SGLang (`what`: which request)."""
    if isinstance(exc, httpx.TimeoutException):
        return SamplerTimeout(f"sglang did not answer in time ({what}): {exc!r}")
    return SamplerUnavailable(f"sglang unreachable ({what}): {exc!r}")


def error_message(body: Any) -> str:
    """The error message in an SGLang error body (JSON object or text)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if "message" in body or "error_message" in body:
            return str(body.get("message") or body.get("error_message"))
    return str(body)[:500]


def response_json(response: httpx.Response) -> Any:
    """The response's JSON body, or its text when it is not JSON."""
    try:
        return response.json()
    except ValueError:
        return response.text
