"""Deleting what a hosted backend keeps on its service, as owed work: the one mechanism that
retention (`clawbridge.trainer.checkpoints`) and forgetting a user (`clawbridge.trainer.lanes`)
both use for a `clawbridge.backend.RemoteCheckpoints` backend.

Invariants:
- Owe first, then try: `owe` records every object in the store (`clawbridge.store.deletions`)
  before `attempt` sends anything, so a crash, a refusal or a service that is down leaves the
  deletion owed, never lost.
- Each object is tried on its own; one the service no longer has counts as deleted (the backend's
  `delete_remote` says so by returning). A failure is recorded with its error and tried again
  after `RETRY_FIRST_S`, doubling with each failure up to `RETRY_MAX_S`.
- `DeletionRetrier` (started with the server) tries every due object of its backend, whichever
  run recorded it, until the list is empty; `clawbridge status` and `GET /rl/status`
  (`remote_deletions`) show the list until then.
- Nothing here raises to its caller for a deletion that failed: it is owed, logged and retried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from clawbridge.backend import RemoteCheckpoints, RemoteObject
from clawbridge.runtime.background import Background
from clawbridge.store import Store
from clawbridge.store.deletions import OwedDeletionStore, OwedReason

log = logging.getLogger("clawbridge.trainer")

RETRY_FIRST_S = 30.0
"""Wait before the second try at an object whose deletion failed; doubles with each failure."""
RETRY_MAX_S = 3600.0
"""The longest wait between two tries at one object."""
POLL_MAX_S = 60.0
"""`DeletionRetrier` looks at the list at least this often (another run's rows, a clock jump)."""


def retry_delay(attempts: int) -> float:
    """Seconds until the next try after `attempts` failed ones."""
    return float(min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** max(0, attempts - 1)))


class OwedDeletions:
    """Owe, try and retry the deletion of `deleter`'s objects on its service (module invariants)."""

    def __init__(self, store: Store, deleter: RemoteCheckpoints) -> None:
        self.rows = OwedDeletionStore(store)
        self.deleter = deleter
        self.backend = deleter.name
        self.clock = store.clock

    async def owe(self, objects: Sequence[RemoteObject], reason: OwedReason,
                  prune_checkpoint: str | None = None) -> None:
        """Record `objects` as owed (with `prune_checkpoint`: and mark that checkpoint's versions
        pruned, in the same transaction)."""
        pairs = [(o.path, o.kind) for o in objects]
        await asyncio.to_thread(self.rows.owe, pairs, self.backend, reason, prune_checkpoint)

    async def attempt(self, objects: Sequence[RemoteObject]) -> int:
        """Try to delete each of `objects` (owed already) once now; how many are gone."""
        gone = 0
        for obj in objects:
            gone += await self._try(obj)
        return gone

    async def retry_due(self, now: float | None = None) -> int:
        """Try every object of this backend due at `now` (default: the store's clock); how many are gone."""
        due = await asyncio.to_thread(self.rows.due, self.backend, self.clock.now() if now is None else now)
        return await self.attempt([RemoteObject(r.object, r.kind) for r in due])

    async def _try(self, obj: RemoteObject) -> bool:
        try:
            await self.deleter.delete_remote(obj)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            attempts = await asyncio.to_thread(self.rows.attempts, obj.path) + 1
            delay = retry_delay(attempts)
            await asyncio.to_thread(self.rows.failed, obj.path, error, self.clock.now() + delay)
            log.warning("could not delete %s %s on the service (try %d; owed, next try in %.0f s): %s",
                        obj.kind, obj.path, attempts, delay, error)
            return False
        await asyncio.to_thread(self.rows.done, obj.path)
        return True


class DeletionRetrier:
    """The server's background loop over the owed list of its backend (module invariants)."""

    def __init__(self, store: Store, deleter: RemoteCheckpoints) -> None:
        self.owed = OwedDeletions(store, deleter)
        self.background = Background("clawbridge-deletions", store.clock)

    def start(self) -> None:
        self.background.start(self._run)

    async def stop(self, timeout_s: float = 10.0) -> None:
        await self.background.stop(timeout_s, cancel_first=True)

    def notify(self) -> None:
        """Look at the list now (new rows were owed)."""
        self.background.notify()

    async def _run(self) -> None:
        while not self.background.stopping:
            try:
                await self.owed.retry_due()
                next_due = await asyncio.to_thread(self.owed.rows.next_due, self.owed.backend)
            except Exception:
                log.exception("could not retry the deletions owed on the service; trying again later")
                next_due = None
            wait = POLL_MAX_S if next_due is None else next_due - self.owed.clock.now()
            await self.background.sleep(min(POLL_MAX_S, max(0.01, wait)))
