"""The front door: checks every HTTP request passes before it reaches a route.

Invariants:
- Host check (DNS rebinding): a request whose `Host` header is not a loopback name, the bind
  address, this machine's own names (wildcard binds only) or one of `allowed_hosts` gets 403 with
  an OpenAI-style body, before any route runs, so a web page that rebinds its name to 127.0.0.1
  learns nothing, not even `/health`. `allowed_hosts = ["*"]` turns the check off.
- Draining: once `Drain.begin()` has been called (SIGTERM), new requests get 503 with
  `Retry-After`; requests already running continue until `Drain.expired` is set (the grace
  period), then end with an OpenAI-shaped error (a JSON body, or an SSE error event).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from clawbridge.proxy.errors import error_body

log = logging.getLogger("clawbridge.proxy")

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def host_name(header: str) -> str:
    """The name part of a Host header value, lower-case, without port ('[::1]:80' -> '::1')."""
    value = header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def _is_loopback_name(name: str) -> bool:
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def machine_names() -> set[str]:
    """This machine's host name, FQDN and the addresses they resolve to (for wildcard binds)."""
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    for name in list(names):
        try:
            for info in socket.getaddrinfo(name, None):
                names.add(str(info[4][0]).lower())
        except OSError:
            continue
    return {n for n in names if n}


class HostPolicy:
    """Which Host header names this server answers to."""

    def __init__(self, bind_host: str, allowed: Iterable[str]) -> None:
        allowed = [host_name(a) for a in allowed if a.strip()]
        self.any = "*" in allowed
        self.names = set(allowed)
        bind = host_name(bind_host)
        if bind in ("0.0.0.0", "::", ""):
            self.names |= machine_names()
        else:
            self.names.add(bind)

    def allows(self, header: str | None) -> bool:
        if self.any:
            return True
        if not header:
            return False
        name = host_name(header)
        return _is_loopback_name(name) or name in self.names


class Drain:
    """Shutdown state shared by the server (which starts it) and the request handlers."""

    def __init__(self) -> None:
        self.draining = False
        self.expired = asyncio.Event()
        """Set when the grace period is over: running calls must end now."""

    def begin(self, grace_s: float) -> None:
        """Stop taking new requests; end running ones after `grace_s` seconds."""
        if self.draining:
            return
        self.draining = True
        log.info("draining: no new requests; running calls get %.0fs to finish", grace_s)
        asyncio.get_running_loop().call_later(grace_s, self.expired.set)


async def _send_error(send: Send, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
    body = orjson.dumps(error_body(status, message, code=code))
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """ASGI middleware applying `HostPolicy` and `Drain` to every HTTP request."""

    def __init__(self, app: ASGIApp, hosts: HostPolicy, drain: Drain) -> None:
        self.app = app
        self.hosts = hosts
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = None
        for k, v in scope.get("headers", ()):
            if k == b"host":
                host = v.decode("latin-1")
                break
        if not self.hosts.allows(host):
            log.warning("refused a request for Host %r (not loopback, the bind address or allowed_hosts)", host)
            await _send_error(send, 403, f"Host {host!r} is not served here; add it to allowed_hosts "
                              "(CLAWBRIDGE_ALLOWED_HOSTS) if it should be", "host_not_allowed")
            return
        if self.drain.draining:
            await _send_error(send, 503, "clawbridge is shutting down; retry shortly", "server_shutting_down",
                              {"Retry-After": "5", "Connection": "close"})
            return
        await self.app(scope, receive, send)
