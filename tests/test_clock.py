"""The clock seam: `FakeClock` moves only when told, wakes waits whose deadline it passes, and
the store stamps rows with it."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from clawbridge.runtime.clock import FakeClock, SystemClock
from clawbridge.store import Store


def test_fake_clock_moves_only_by_advance() -> None:
    clock = FakeClock(start=1000.0)
    assert (clock.now(), clock.monotonic()) == (1000.0, 0.0)
    clock.advance(2.5)
    assert (clock.now(), clock.monotonic()) == (1002.5, 2.5)
    with pytest.raises(ValueError):
        clock.advance(-1.0)


def test_fake_wait_ends_on_its_event_or_when_advanced_past_its_deadline() -> None:
    clock = FakeClock()

    async def scenario() -> None:
        event = asyncio.Event()
        waiter = asyncio.create_task(clock.wait(event, 10.0))
        while clock.waiting == 0:
            await asyncio.sleep(0)
        clock.advance(9.0)
        for _ in range(20):  # let the loop run: nothing is due yet
            await asyncio.sleep(0)
        assert not waiter.done()
        clock.advance(1.0)
        assert await asyncio.wait_for(waiter, 30) is False  # timed out on the fake clock
        assert clock.waiting == 0
        other = asyncio.create_task(clock.wait(event, 10.0))
        while clock.waiting == 0:
            await asyncio.sleep(0)
        event.set()
        assert await asyncio.wait_for(other, 30) is True
        assert clock.waiting == 0
        assert await clock.wait(event, 0.0) is True  # already set

    asyncio.run(scenario())


def test_fake_clock_is_advanced_from_another_thread() -> None:
    clock = FakeClock()

    async def scenario() -> None:
        sleeper = asyncio.create_task(clock.sleep(60.0))
        while clock.waiting == 0:
            await asyncio.sleep(0)
        t = threading.Thread(target=clock.advance, args=(60.0,))
        t.start()
        await asyncio.wait_for(sleeper, 30)
        t.join()

    asyncio.run(scenario())


def test_system_clock_wait_returns_once_set() -> None:
    async def scenario() -> bool:
        event = asyncio.Event()
        asyncio.get_running_loop().call_soon(event.set)
        return await SystemClock().wait(event, 30.0)

    assert asyncio.run(scenario()) is True


def test_store_stamps_rows_with_its_clock(tmp_path: Path) -> None:
    clock = FakeClock(start=5000.0)
    store = Store.open(tmp_path, clock)
    sid = store.start_keyed_session("k" * 24, None)
    clock.advance(7.0)
    assert store.end_session(sid, "end_session")
    session = store.get_session(sid)
    assert session is not None and (session.created_at, session.ended_at) == (5000.0, 5007.0)
    store.close()
