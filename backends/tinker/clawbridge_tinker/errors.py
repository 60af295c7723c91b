"""How Tinker failures are classified, and the bounded retry for idempotent calls.

Invariants:
- `RequestFailedError` (Tinker ran the request and reported it failed) is permanent: never retried.
- 429, 408/409/5xx, connection errors and timeouts are transient. The SDK already retries
  `try_again` polls, 429s and 5xx internally without a count bound; every call here is wrapped
  in an explicit wall-clock timeout, which is what bounds those loops.
- `retry_transient` re-runs only idempotent operations (sampling, saving weights, creating
  clients). A training step is never re-submitted here: Tinker orders a model's requests by
  sequence id and applies each once, so after an unknown outcome the caller decides.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .sdk import APIConnectionError, APIStatusError, RequestFailedError

log = logging.getLogger(__name__)
T = TypeVar("T")


class TinkerError(RuntimeError):
    """Base of the errors this backend raises."""


class TinkerRequestFailed(TinkerError):
    """Permanent: Tinker reported the request failed (bad input, unsupported model, ...)."""


class TinkerTransientError(TinkerError):
    """Transient: timeout, rate limit or connection trouble persisted past the retry bound."""


def is_transient(exc: BaseException) -> bool:
    """True for failures worth retrying later; False for permanent ones."""
    if isinstance(exc, RequestFailedError):
        return False
    if isinstance(exc, TimeoutError | APIConnectionError):
        return True
    if isinstance(exc, APIStatusError):
        code = exc.status_code
        return code in (408, 409, 429) or 500 <= code < 600
    return False


async def retry_transient(
    what: str,
    call: Callable[[], Awaitable[T]],
    *,
    timeout_s: float,
    max_retries: int,
    backoff_s: float,
) -> T:
    """Run `call`, retrying transient failures up to `max_retries` times, all within `timeout_s`.

    `timeout_s` bounds the whole thing, attempts and waits included. Raises
    `TinkerRequestFailed` for a permanent failure and `TinkerTransientError` (chained to the last
    cause) once retries or time are spent. Cancellation propagates untouched.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    attempt = 0
    while True:
        remaining = deadline - loop.time()
        try:
            if remaining <= 0:
                raise TimeoutError
            return await asyncio.wait_for(call(), remaining)
        except RequestFailedError as e:
            raise TinkerRequestFailed(f"{what}: Tinker reported failure: {e}") from e
        except Exception as e:
            if not is_transient(e):
                raise
            delay = backoff_s * (2**attempt)
            out_of_time = isinstance(e, TimeoutError) or loop.time() + delay >= deadline
            if attempt >= max_retries or out_of_time:
                reason = f"no answer within {timeout_s:g}s" if isinstance(e, TimeoutError) else str(e)
                raise TinkerTransientError(f"{what}: {reason} (after {attempt + 1} attempts)") from e
            log.warning(
                "%s: transient failure (%s); retry %d/%d in %.1fs", what, e, attempt + 1, max_retries, delay
            )
            attempt += 1
            await asyncio.sleep(delay)
