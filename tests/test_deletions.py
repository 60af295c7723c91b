"""Deletions owed on a hosted service (`clawbridge.trainer.deletions`, `clawbridge.store.deletions`)
with `FakeHostedBackend` on a real SQLite store and a `FakeClock`: owed before the first try,
each object on its own, retried with backoff until the service has none, shown in status, and
never lost to a crash. (Against the real tinker SDK: tests/test_tinker_restart.py and
tests/test_tinker_lanes.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from clawbridge.backend import ModelInfo
from clawbridge.cli.status import owed_lines
from clawbridge.runtime.clock import FakeClock
from clawbridge.serving.sampler import FakeSampler
from clawbridge.store import Store
from clawbridge.store.deletions import OwedDeletionStore
from clawbridge.store.versions import VersionStore
from clawbridge.trainer.checkpoints import CheckpointKeeper
from clawbridge.trainer.deletions import RETRY_FIRST_S, RETRY_MAX_S, DeletionRetrier, retry_delay
from clawbridge.trainer.fake import FakeHostedBackend, SimulatedCrash

INFO = ModelInfo(name="tiny", tokenizer_path="unused", context_window=4096, max_output_tokens=256)
KEPT = {"fake://v00000000-base", "fake://v00000000-base#sampler", "fake://v00000002-step",
        "fake://v00000002-step#sampler"}
"""What the service holds once v1 is pruned with keep=1: the base (never pruned) and the newest."""


async def commit_steps(keeper: CheckpointKeeper, n: int) -> None:
    """`n` steps as the trainer commits them (weights trained elsewhere: the fake only numbers them)."""
    await keeper.ensure_base()
    for step in range(1, n + 1):
        version = keeper.reserve_step(step)
        await keeper.publish(version)
        keeper.versions.commit(version, await keeper.save(version), None)


async def parked(clock: FakeClock) -> None:
    """Until the retrier waits on `clock` (an advance before that would not wake it)."""
    for _ in range(400):
        if clock.waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the retrier never waited")


def pruned(store: Store) -> dict[int, bool]:
    return {r.version: r.pruned_at is not None for r in VersionStore(store).listing(100)}


def test_retention_owes_each_object_and_a_retry_deletes_what_was_refused(tmp_path: Path) -> None:
    clock = FakeClock()
    store = Store.open(tmp_path, clock)
    backend = FakeHostedBackend(FakeSampler([7]), INFO)
    keeper = CheckpointKeeper(store, backend, keep=1)
    owed = OwedDeletionStore(store)

    async def main() -> None:
        await commit_steps(keeper, 2)
        backend.refuse = True
        assert await keeper.prune() == ["fake://v00000001-step"]
        # decided once: v1 is pruned (never offered again; the base v0 is always kept), both of its
        # objects owed, each tried once
        assert pruned(store) == {0: False, 1: True, 2: False}
        rows = owed.listing()
        assert sorted((r.kind, r.attempts, r.reason) for r in rows) == [("sampler", 1, "prune"), ("state", 1, "prune")]
        assert all(r.next_try_at == clock.now() + RETRY_FIRST_S and "refused" in (r.last_error or "") for r in rows)
        assert await keeper.prune() == []  # retention does not decide it again
        retrier = DeletionRetrier(store, backend)
        retrier.start()
        try:
            for seconds in (RETRY_FIRST_S, 2 * RETRY_FIRST_S):  # the service still refuses: backoff doubles
                before = len(backend.deletes)
                await parked(clock)
                clock.advance(seconds)
                for _ in range(400):
                    if len(backend.deletes) == before + 2 and all(r.attempts == len(backend.deletes) // 2 for r in
                                                                  owed.listing()):
                        break
                    await asyncio.sleep(0.01)
                assert len(backend.deletes) == before + 2
            assert {r.next_try_at - clock.now() for r in owed.listing()} == {4 * RETRY_FIRST_S}
            lines = owed_lines(owed.status())
            assert lines[0].startswith("remote deletions owed: 2 (2 for pruned checkpoints)") and len(lines) == 3
            backend.refuse = False
            await parked(clock)
            clock.advance(4 * RETRY_FIRST_S)
            for _ in range(400):
                if owed.count() == 0:
                    break
                await asyncio.sleep(0.01)
        finally:
            await retrier.stop()

    asyncio.run(main())
    assert owed.listing() == [] and owed_lines(owed.status()) == []
    assert backend.service == KEPT
    store.close()


def test_a_deletion_owed_before_a_crash_is_finished_by_the_next_run(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    service: set[str] = set()
    backend = FakeHostedBackend(FakeSampler([7]), INFO, service=service)
    keeper = CheckpointKeeper(store, backend, keep=1)

    async def first() -> None:
        await commit_steps(keeper, 2)
        backend.crash_on_delete = True
        await keeper.prune()

    with pytest.raises(SimulatedCrash):  # killed between owing v1's objects and the service deleting them
        asyncio.run(first())
    assert pruned(store) == {0: False, 1: True, 2: False}
    assert len(OwedDeletionStore(store).listing()) == 2 and "fake://v00000001-step" in service
    again = FakeHostedBackend(FakeSampler([7]), INFO, service=service)  # a restarted process
    retrier = DeletionRetrier(store, again)
    assert asyncio.run(retrier.owed.retry_due()) == 2
    assert OwedDeletionStore(store).listing() == [] and service == KEPT
    store.close()


def test_retry_delay_doubles_up_to_its_bound() -> None:
    assert [retry_delay(n) for n in (1, 2, 3)] == [RETRY_FIRST_S, 2 * RETRY_FIRST_S, 4 * RETRY_FIRST_S]
    assert retry_delay(40) == RETRY_MAX_S
