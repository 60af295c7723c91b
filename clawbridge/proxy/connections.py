"""Connection limits below the app: uvicorn's h11 protocol with a header-read timeout.

Invariant: a connection that opens (or finishes a response) and does not deliver a complete request
head within `header_timeout_s` is closed, so idle or slow-header (slowloris) connections cannot
pile up until the process runs out of file descriptors. Together with uvicorn's
`limit_concurrency` (`max_connections`: beyond it, 503 at once) and `timeout_keep_alive`, and
`read_body`'s body timeout, no client can hold a connection open without sending a request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("clawbridge.proxy")


def header_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """An `H11Protocol` class that closes connections slower than `header_timeout_s` to send a request head."""

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                log.debug("closing a connection that sent no request head within %.0fs", header_timeout_s)
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if not self._waiting_for_head():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
