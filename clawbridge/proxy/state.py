"""What the request handlers share: settings, model, renderer, sampler, keys and the store writer.

Invariants:
- No store call runs on the event loop: every write goes through `StoreWriter` (one thread, in
  submission order, so writes never interleave) and every read through `ProxyState.read` (a
  worker thread). The store's lock is held by the trainer's and the reward worker's threads for
  whole transactions; a handler waits on it in a thread, never with the loop, so `/health` and
  other requests keep being answered.
- A turn that cannot be recorded (disk full, read-only or failing store) is never answered as a
  success: `record_turn` raises `ApiError` 507 (no space) or 503 (other store failures) with what
  to do, and the failure is kept (`StoreWriter.problem`) until a later write succeeds, so `/health`
  and new model calls see it.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from clawbridge.backend import ModelInfo, ServingBackend
from clawbridge.chatformat import ChatFormat
from clawbridge.config import Settings
from clawbridge.proxy.auth import Keys
from clawbridge.proxy.errors import ApiError
from clawbridge.proxy.guard import Drain
from clawbridge.sampler import Sampler
from clawbridge.store import Store, TurnRecord
from clawbridge.store.health import disk_problem
from clawbridge.store.versions import VersionStore
from clawbridge.versions import VersionRouter

if TYPE_CHECKING:
    from clawbridge.privacy.guard import PrivacyGuard
    from clawbridge.reporting import StepReporter
    from clawbridge.rewards.worker import RewardWorker
    from clawbridge.trainer.loop import TrainerLoop

log = logging.getLogger("clawbridge.store")
T = TypeVar("T")


def store_failure(exc: BaseException) -> ApiError:
    """The client-facing error for a turn the store could not record."""
    text = str(exc)
    if isinstance(exc, sqlite3.OperationalError) and "full" in text.lower():
        return ApiError(507, f"the answer could not be recorded: the store is out of space ({text}); "
                        "free disk space in the state dir, then retry", code="store_full")
    return ApiError(503, f"the answer could not be recorded: the store failed ({text}); see the clawbridge log",
                    code="store_unavailable")


class StoreWriter:
    """Runs store calls on one dedicated thread, and remembers whether recording is failing."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clawbridge-store")
        self.failure: str | None = None
        """Why the last turn could not be recorded; None once one has been recorded since."""

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _record(self, turn: TurnRecord, source: str, end_reason: str | None) -> str:
        try:
            turn_id = self.store.record_turn(turn, source, end_reason)
        except sqlite3.Error as exc:
            self.failure = f"recording turns fails: {exc}"
            raise
        self.failure = None
        return turn_id

    async def record_turn(self, turn: TurnRecord, source: str, end_reason: str | None) -> None:
        try:
            await self.call(self._record, turn, source, end_reason)
        except sqlite3.Error as exc:
            log.error("recording %s failed: %s", turn.turn_id, exc)
            raise store_failure(exc) from None

    def record_turn_nowait(self, turn: TurnRecord, source: str, end_reason: str | None) -> None:
        def report(f: Future[str]) -> None:
            if f.exception() is not None:
                log.error("recording %s failed: %s", turn.turn_id, f.exception())

        self._pool.submit(self._record, turn, source, end_reason).add_done_callback(report)

    def ensure_recordable(self, min_free_bytes: int) -> None:
        """Raise `ApiError` 507 when the state dir's disk is below `min_free_bytes` free (checked
        before sampling, so no model time is spent on a turn that could not be recorded)."""
        low = disk_problem(self.store.path.parent, min_free_bytes)
        if low is not None:
            raise ApiError(507, f"not sampling: {low}", code="insufficient_storage")

    def problem(self, min_free_bytes: int) -> str | None:
        """Why a turn could not be recorded now (low disk space, or the last write failed), else None."""
        return disk_problem(self.store.path.parent, min_free_bytes) or self.failure

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass
class ProxyState:
    """Shared by all handlers of one running proxy."""

    settings: Settings
    backend: ServingBackend
    model_info: ModelInfo
    renderer: ChatFormat
    """The served model's chat format (`clawbridge.render.Renderer`)."""
    store: Store
    writer: StoreWriter
    keys: Keys
    trainer: TrainerLoop | None = None
    """The trainer loop when the backend trains and training is on (clawbridge.trainer)."""
    judge: RewardWorker | None = None
    """The judge worker when a judge is configured (clawbridge.rewards.worker)."""
    privacy: PrivacyGuard | None = None
    """The privacy filter where it is on (clawbridge.privacy): counts shown in status and metrics."""
    reporter: StepReporter | None = None
    """Step metrics to TensorBoard / W&B when `report_to` is set (clawbridge.reporting)."""
    drain: Drain = field(default_factory=Drain)
    """Shutdown state: set by the server on SIGTERM (clawbridge.proxy.guard)."""
    router: VersionRouter = field(init=False)
    """Which version answers each model call: `NAME@N`, the serving version, a canary's candidate
    (clawbridge.versions)."""

    def __post_init__(self) -> None:
        self.router = VersionRouter(self.backend, VersionStore(self.store), (self.model_info.name, "default"))

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)`, a read of the store (or of something that reads it), on a worker thread."""
        return await asyncio.to_thread(fn, *args)

    @property
    def sampler(self) -> Sampler:
        """The backend's published sampler (model calls go through `router` instead)."""
        return self.backend.sampler()
