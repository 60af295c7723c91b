"""Start-up probes of hosted services (Tinker, Fireworks): say in seconds what is wrong.

A hosted backend calls its service once at `start()`, before creating anything, through a
`ServiceProbe`, so `clawbridge up` exits at once with one of three answers instead of hanging in
an SDK's retry loop: the service is unreachable, it refused the key, or it does not offer the
model (or the named deployment / trainer job).

Invariants:
- A probe only reads (GET, or the SDK's own read-only config call); every request is bounded by
  `timeout_s` (`Settings.probe_timeout_s`) and none is retried, so a probe of k requests ends
  within k * timeout_s.
- Every failure is one `ServiceProbeFailed` whose `problem` is "unreachable", "bad key",
  "model unknown" or "unexpected answer"; its message names the service, the URL, what failed,
  how long it took and the setting that fixes it. It never contains the key.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Problem = Literal["unreachable", "bad key", "model unknown", "unexpected answer"]


class ServiceProbeFailed(RuntimeError):
    """A hosted service failed its start-up probe (see the module docstring)."""

    def __init__(self, service: str, problem: Problem, detail: str, fix: str) -> None:
        self.service = service
        self.problem = problem
        super().__init__(f"{service}: {problem}: {detail}; {fix}")


@dataclass
class ServiceProbe:
    """Bounded, unretried HTTP calls to one service, failures classified."""

    service: str
    """Name in messages, e.g. "tinker"."""
    base_url: str
    headers: dict[str, str] = field(repr=False)
    """Auth headers (never printed)."""
    timeout_s: float
    url_fix: str
    """How to fix an unreachable URL, e.g. "check [backends.tinker] base_url (CLAWBRIDGE_TINKER_BASE_URL)"."""
    key_fix: str
    """How to fix a refused key."""

    async def call(self, method: str, path: str, json: Any = None, *, auth_checked: bool = True) -> httpx.Response:
        """One request. Raises `ServiceProbeFailed` for no connection, a timeout, and (when
        `auth_checked`) 401/403; any other answer is returned for the caller to judge."""
        url = self.base_url.rstrip("/") + path
        start = time.monotonic()
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                resp = await client.request(method, url, headers=self.headers, json=json)
        except httpx.TimeoutException:
            raise ServiceProbeFailed(
                self.service, "unreachable", f"no answer from {url} within {self.timeout_s:g} s", self.url_fix
            ) from None
        except httpx.HTTPError as e:
            took = time.monotonic() - start
            raise ServiceProbeFailed(
                self.service, "unreachable", f"cannot connect to {url} ({_why(e)}, after {took:.1f} s)", self.url_fix
            ) from None
        if auth_checked and resp.status_code in (401, 403):
            raise ServiceProbeFailed(
                self.service, "bad key", f"{url} refused the API key (HTTP {resp.status_code})", self.key_fix
            )
        return resp

    def unexpected(self, resp: httpx.Response, what: str) -> ServiceProbeFailed:
        """The failure for an answer the probe did not expect."""
        body = resp.text[:200].replace("\n", " ")
        return ServiceProbeFailed(
            self.service, "unexpected answer", f"{what}: {resp.request.url} answered HTTP {resp.status_code} ({body})",
            "try again later, or check the service's status page",
        )


def _why(e: BaseException) -> str:
    """The root cause in words ("connection refused" rather than anyio's "All connection attempts
    failed")."""
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        cause = cause.__cause__ or cause.__context__
    return str(e) or type(e).__name__
