"""One background asyncio loop with start / stop / notify: the trainer loop and the reward worker.

Invariants:
- At most one task runs per `Background`; `start` while it runs does nothing.
- `stop` is idempotent. It sets `stopping`, wakes a `sleep` in progress, then either waits up to
  `timeout_s` for the task to end by itself before cancelling it (`cancel_first=False`: a step in
  progress may finish) or cancels it at once and waits up to `timeout_s` for it to unwind.
- `notify` ends the current (or next) `sleep` early; wake-ups do not queue beyond one.
- `sleep` runs on the loop's `Clock` (the store's, `clawbridge.runtime.clock`), so a test moves it instead of waiting.
- An exception that ends the task is logged by `stop`, never raised from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from clawbridge.runtime.clock import SYSTEM_CLOCK, Clock

log = logging.getLogger(__name__)


class Background:
    """The task, stop flag and wake-up event of one named background loop."""

    def __init__(self, name: str, clock: Clock = SYSTEM_CLOCK) -> None:
        """`name`: the asyncio task's name (shows in task dumps), e.g. "clawbridge-trainer"."""
        self.name = name
        self.clock = clock
        self.task: asyncio.Task[None] | None = None
        """The running task (None before `start` and after `stop`)."""
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()

    @property
    def running(self) -> bool:
        """Whether the task exists and has not ended."""
        return self.task is not None and not self.task.done()

    @property
    def stopping(self) -> bool:
        """True once `stop` was called (the loop body should return)."""
        return self._stop.is_set()

    def start(self, body: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run `body()` as the task unless one is running."""
        if self.running:
            return
        self._stop.clear()
        self.task = asyncio.create_task(body(), name=self.name)

    def notify(self) -> None:
        """End the loop's current or next `sleep` now."""
        self._wake.set()

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds`, or less when notified or stopped."""
        await self.clock.wait(self._wake, seconds)
        self._wake.clear()

    async def stop(self, timeout_s: float, *, cancel_first: bool) -> None:
        """Stop the task (module invariants); returns when it has ended or `timeout_s` passed."""
        task, self.task = self.task, None
        if task is None:
            return
        self._stop.set()
        self._wake.set()
        if cancel_first:
            task.cancel()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        except asyncio.CancelledError:
            if not task.cancelled():  # we were cancelled ourselves, not the task
                raise
        except Exception:
            log.exception("%s ended with an error", self.name)
