"""What the request handlers share: settings, model, renderer, sampler, keys and the store writer.

Invariant: every store write from the event loop goes through `StoreWriter`, one thread, in
submission order, so writes never block the loop and never interleave.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from clawbridge.backend import ModelInfo, ServingBackend
from clawbridge.chatformat import ChatFormat
from clawbridge.config import Settings
from clawbridge.proxy.auth import Keys
from clawbridge.proxy.guard import Drain
from clawbridge.sampler import Sampler
from clawbridge.store import Store, TurnRecord

if TYPE_CHECKING:
    from clawbridge.rewards.worker import RewardWorker
    from clawbridge.trainer.loop import TrainerLoop

log = logging.getLogger("clawbridge.store")
T = TypeVar("T")


class StoreWriter:
    """Runs store calls on one dedicated thread."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clawbridge-store")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def record_turn(self, turn: TurnRecord, source: str, end_reason: str | None) -> None:
        await self.call(self.store.record_turn, turn, source, end_reason)

    def record_turn_nowait(self, turn: TurnRecord, source: str, end_reason: str | None) -> None:
        def report(f: Future[str]) -> None:
            if f.exception() is not None:
                log.error("recording %s failed: %s", turn.turn_id, f.exception())

        self._pool.submit(self.store.record_turn, turn, source, end_reason).add_done_callback(report)

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
    drain: Drain = field(default_factory=Drain)
    """Shutdown state: set by the server on SIGTERM (clawbridge.proxy.guard)."""

    @property
    def sampler(self) -> Sampler:
        return self.backend.sampler()
