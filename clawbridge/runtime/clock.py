"""Time as a seam: wall time for stored timestamps, a monotonic clock for deadlines, and waiting.

Invariants:
- The store stamps every row with its `Clock.now()`, and the parts that act on elapsed time (the
  trainer's `no_reward` drops and poll waits, the reward worker's retry backoff and poll waits,
  the idle-session reaper) read the same clock (`Store.clock`), so one `FakeClock` moves them all.
- `SystemClock` is the real thing; `FakeClock` moves only when `advance` is called, so a test
  that needs time to pass advances it instead of sleeping. A `wait` on a `FakeClock` returns when
  its event is set or when `advance` has moved the clock past its deadline, whichever is first.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Where time comes from.

    Fake: `FakeClock` below. Tested by tests/test_clock.py (and used by tests/test_sessions.py,
    tests/test_session_lifecycle.py, tests/test_rewards.py to move time instead of waiting)."""

    def now(self) -> float:
        """Wall time, seconds since the epoch (what the store records)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for deadlines and backoff)."""
        ...

    async def wait(self, event: asyncio.Event, timeout_s: float) -> bool:
        """Wait until `event` is set (True) or `timeout_s` has passed on this clock (False)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Let `seconds` pass on this clock."""
        ...


class SystemClock:
    """The real clocks and `asyncio`'s timers."""

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def wait(self, event: asyncio.Event, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(0.0, timeout_s))
        return event.is_set()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


SYSTEM_CLOCK = SystemClock()


class FakeClock:
    """A clock that moves only by `advance` (thread-safe: a test thread may advance a clock that a
    server's event loop waits on)."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._lock = threading.Lock()
        self._wall = start
        self._mono = 0.0
        self._waiters: list[tuple[float, asyncio.AbstractEventLoop, asyncio.Event]] = []

    def now(self) -> float:
        with self._lock:
            return self._wall

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    @property
    def waiting(self) -> int:
        """How many `wait`/`sleep` calls are blocked on this clock now (a test advances once the
        code under test is parked, so the advance cannot come before the wait it should end)."""
        with self._lock:
            return len(self._waiters)

    def advance(self, seconds: float) -> None:
        """Move both clocks forward and wake every wait whose deadline has passed."""
        if seconds < 0:
            raise ValueError("a clock does not go back")
        with self._lock:
            self._wall += seconds
            self._mono += seconds
            due = [w for w in self._waiters if w[0] <= self._mono]
            self._waiters = [w for w in self._waiters if w[0] > self._mono]
        for _, loop, timer in due:
            with contextlib.suppress(RuntimeError):  # a loop closed meanwhile has nobody to wake
                loop.call_soon_threadsafe(timer.set)

    async def wait(self, event: asyncio.Event, timeout_s: float) -> bool:
        if event.is_set():
            return True
        timer = asyncio.Event()
        entry = (self.monotonic() + max(0.0, timeout_s), asyncio.get_running_loop(), timer)
        with self._lock:
            if entry[0] <= self._mono:
                return event.is_set()
            self._waiters.append(entry)
        waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(timer.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            with self._lock:
                if entry in self._waiters:
                    self._waiters.remove(entry)
        return event.is_set()

    async def sleep(self, seconds: float) -> None:
        await self.wait(asyncio.Event(), seconds)
