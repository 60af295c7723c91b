"""The requests running now, each with the forget epoch it began in: how forgetting a user finds,
cuts and waits for every call that could still act for her.

Forgetting runs: revoke her and open her grave (`UserStore.begin_forget`, epoch E), `cut` her
model calls, `drain` until no request that began before E can still act for her, let the hooks
delete what they keep, delete her rows (`UserStore.forget`). A request that begins after E is
authenticated against the revoked row (401); one that began before E either ends before her rows
are deleted (so they take its writes with them) or was cut, and the store refuses its turn anyway
(`clawbridge.store.tombstones`).

Invariants:
- Every HTTP request holds a `Ticket` from before its key is checked until its response was sent
  (`InFlightMiddleware`); the ticket notes the store's forget epoch when it was taken.
- A model call names whose call it is right after authentication (`identify`); it is refused (401
  `user_forgotten`) when that user is being forgotten or was forgotten after the call began. The
  user API's admin requests identify as nobody's, so two forgets never wait for each other.
- `cut(user)` ends every identified model call of `user` at once: its sampler stream is closed, it
  records nothing, and its client gets the same 401 (a stream: as an error event).
- `drain(user, epoch)` returns once every ticket taken before `epoch` that is not identified as
  somebody else's has ended, or after `timeout_s`.
- A forgotten name's grave is swept each time a ticket ends, once no ticket older than its end runs.
- A ticket that ended holds no callback (`Ticket.end` drops them): a call's `on_cut` callback holds the
  call, which holds its ticket, and that cycle would keep the call's sampler stream, and with it
  its version's weights (a user's adapter), alive until a full cyclic collection (rare in a server:
  `clawbridge.server.tune_gc`), long after the version was evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from clawbridge.proxy.errors import ApiError
from clawbridge.store.tombstones import Tombstones

log = logging.getLogger("clawbridge.proxy")

SCOPE_KEY = "clawbridge.ticket"
"""Where `InFlightMiddleware` puts a request's ticket in its ASGI scope."""


def forgotten_error() -> ApiError:
    """How a call of a user who is being (or was since the call began) forgotten is answered."""
    return ApiError(401, "this user's key was revoked: the user is being forgotten, and nothing of this call is "
                    "recorded", code="user_forgotten")


@dataclass(eq=False)
class Ticket:
    """One running request (module invariants)."""

    epoch: int
    """The store's forget epoch when the request began."""
    caller: str | None = None
    identified: bool = False
    """Whether it said whose it is (`InFlight.identify`): a model call after authentication."""
    cut: bool = False
    """Set by `InFlight.cut`: the call must end now and record nothing."""
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    _on_cut: list[Callable[[], None]] = field(default_factory=list)

    def on_cut(self, callback: Callable[[], None]) -> None:
        """Run `callback` when the call is cut (at once if it already was)."""
        if self.cut:
            callback()
        else:
            self._on_cut.append(callback)

    def end(self) -> None:
        """The request ended: wake whoever waits for it, and drop the callbacks (module invariants)."""
        self._on_cut.clear()  # no cycle through the call outlives it
        self.ended.set()


class InFlight:
    """The tickets of one server (module invariants)."""

    def __init__(self, tombstones: Tombstones) -> None:
        self.tombstones = tombstones
        self._tickets: set[Ticket] = set()

    def __len__(self) -> int:
        return len(self._tickets)

    def calls_of(self, user: str) -> int:
        """Identified calls of `user` running now."""
        return sum(1 for t in self._tickets if t.identified and t.caller == user)

    def open(self) -> Ticket:
        ticket = Ticket(self.tombstones.epoch)
        self._tickets.add(ticket)
        return ticket

    def close(self, ticket: Ticket) -> None:
        self._tickets.discard(ticket)
        ticket.end()
        if len(self.tombstones):
            self.sweep()

    def sweep(self) -> None:
        """Drop the graves no running request began before (`Tombstones.sweep`)."""
        self.tombstones.sweep(min((t.epoch for t in self._tickets), default=None))

    def identify(self, ticket: Ticket, caller: str | None) -> None:
        """`ticket`'s request is a model call of `caller` (None: of nobody's user); 401 when that
        user is being forgotten or was forgotten after the request began."""
        ticket.caller, ticket.identified = caller, True
        if self.tombstones.refuses(caller, ticket.epoch):
            raise forgotten_error()

    def cut(self, user: str) -> int:
        """End every identified call of `user` (module invariants); how many."""
        n = 0
        for ticket in list(self._tickets):
            if ticket.identified and ticket.caller == user and not ticket.cut:
                ticket.cut = True
                for callback in ticket._on_cut:
                    with contextlib.suppress(Exception):
                        callback()
                n += 1
        return n

    async def drain(self, user: str, epoch: int, timeout_s: float) -> bool:
        """Wait until every request that began before `epoch` and may act for `user` ended
        (module invariants); False when `timeout_s` passed first."""
        waiting = [t.ended.wait() for t in self._tickets
                   if t.epoch < epoch and (not t.identified or t.caller == user)]
        if not waiting:
            return True
        try:
            await asyncio.wait_for(asyncio.gather(*waiting), timeout_s)
        except TimeoutError:
            log.warning("forgetting %s: requests that began before it still run after %.0fs; their turns "
                        "will not be recorded", user, timeout_s)
            return False
        return True


class InFlightMiddleware:
    """ASGI middleware: a ticket for every HTTP request, from its start to its last byte."""

    def __init__(self, app: ASGIApp, inflight: InFlight) -> None:
        self.app = app
        self.inflight = inflight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ticket = self.inflight.open()
        scope[SCOPE_KEY] = ticket
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight.close(ticket)


def ticket_of(scope: Scope) -> Ticket | None:
    """The ticket `InFlightMiddleware` gave this request (None: called outside it)."""
    ticket = scope.get(SCOPE_KEY)
    return ticket if isinstance(ticket, Ticket) else None
