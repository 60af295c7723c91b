"""What the request handlers share: settings, model, renderer, sampler, keys and the store writer.

Invariants:
- No store call runs on the event loop: every write goes through `StoreWriter` (one thread, in
  submission order, so writes never interleave) and every read through `ProxyState.read` (a
  worker thread). Turns waiting together are written as one group commit (`Store.record_turns`:
  one transaction, a savepoint per turn): a turn's `record_turn` returns only once the
  transaction holding it has committed, so "committed before the response ends" holds per turn,
  and concurrent calls share one commit instead of queueing one commit each. The store's lock is held by the trainer's and the reward worker's threads for
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
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from clawbridge.access import Denied
from clawbridge.backend import ModelInfo, ServingBackend
from clawbridge.chat.chatformat import ChatFormat
from clawbridge.config import Settings
from clawbridge.proxy.auth import Keys
from clawbridge.proxy.errors import ApiError, denied
from clawbridge.proxy.guard import Drain
from clawbridge.proxy.inflight import InFlight
from clawbridge.runtime.lifecycle import SessionLifecycle
from clawbridge.serving.sampler import Sampler
from clawbridge.serving.versions import VersionRouter
from clawbridge.store import Store, TurnRecord
from clawbridge.store.health import disk_problem
from clawbridge.store.versions import VersionStore

if TYPE_CHECKING:
    from clawbridge.privacy.guard import PrivacyGuard
    from clawbridge.promotion.promoter import Promoter
    from clawbridge.rewards.note_check import NoteChecker
    from clawbridge.rewards.notes import NoteBook
    from clawbridge.rewards.worker import RewardWorker
    from clawbridge.telemetry.reporting import StepReporter
    from clawbridge.trainer.deletions import DeletionRetrier
    from clawbridge.trainer.lanes import UserLanes
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


@dataclass
class _Job:
    """One entry of the writer's queue: a store call, or a turn to record (`fn` None)."""

    done: Future[Any]
    fn: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()
    turn: tuple[TurnRecord, str, str | None] | None = None


INLINE_BYTES = 256 * 1024
"""Requests up to this many bytes are parsed and rendered on the event loop (`ProxyState.compute`);
a 256 KB OpenClaw request renders in about 5 ms on this project's 2-core box once its segments
are cached."""

MAX_GROUP = 64
"""At most this many turns share one transaction (bounds how long the store's lock is held)."""


class StoreWriter:
    """Runs store calls on one dedicated thread, in submission order, and remembers whether
    recording is failing. Consecutive waiting turns are written in one group commit."""

    def __init__(self, store: Store) -> None:
        self.store = store
        store.checkpoint_in_background()  # a group commit never waits for a WAL checkpoint
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clawbridge-store")
        self._queue: deque[_Job] = deque()
        self._lock = threading.Lock()
        self.failure: str | None = None
        """Why the last turn could not be recorded; None once one has been recorded since."""

    def _submit(self, job: _Job) -> Future[Any]:
        with self._lock:
            self._queue.append(job)
        # One pool task per job: each runs the queue's head (and any turns right behind it), so
        # every job runs, in queue order, before `close()` returns.
        self._pool.submit(self._run_head)
        return job.done

    def _run_head(self) -> None:
        with self._lock:
            if not self._queue:
                return  # taken by an earlier task's group
            jobs = [self._queue.popleft()]
            if jobs[0].turn is not None:
                while self._queue and self._queue[0].turn is not None and len(jobs) < MAX_GROUP:
                    jobs.append(self._queue.popleft())
        if jobs[0].fn is not None:
            self._run_call(jobs[0])
        else:
            self._record(jobs)

    @staticmethod
    def _run_call(job: _Job) -> None:
        assert job.fn is not None
        try:
            result = job.fn(*job.args)
        except BaseException as exc:
            job.done.set_exception(exc)
        else:
            job.done.set_result(result)

    def _record(self, jobs: list[_Job]) -> None:
        turns = [job.turn for job in jobs if job.turn is not None]
        try:
            errors = self.store.record_turns(turns)
        except sqlite3.Error as exc:  # the transaction failed: none of the group was written
            self.failure = f"recording turns fails: {exc}"
            for job in jobs:
                job.done.set_exception(exc)
            return
        except BaseException as exc:
            for job in jobs:
                job.done.set_exception(exc)
            return
        for job, (turn, _, _), err in zip(jobs, turns, errors, strict=True):
            if err is None:
                job.done.set_result(turn.turn_id)
            else:
                job.done.set_exception(err)
        failed = next((err for err in errors if isinstance(err, sqlite3.Error)), None)
        self.failure = None if failed is None else f"recording turns fails: {failed}"

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the store call `fn(*args)` on the writer thread, after every write submitted before it."""
        result: T = await asyncio.wrap_future(self._submit(_Job(Future(), fn=fn, args=args)))
        return result

    async def record_turn(self, turn: TurnRecord, source: str, end_reason: str | None) -> None:
        """Record `turn`; returns once the transaction holding it has committed."""
        try:
            await asyncio.wrap_future(self._submit(_Job(Future(), turn=(turn, source, end_reason))))
        except sqlite3.Error as exc:
            log.error("recording %s failed: %s", turn.turn_id, exc)
            raise store_failure(exc) from None
        except Denied as exc:  # the session is another owner's (`clawbridge.store.owners`): a race the route's check lost
            log.warning("turn %s not recorded: %s", turn.turn_id, exc)
            raise denied(exc) from None

    def record_turn_nowait(self, turn: TurnRecord, source: str, end_reason: str | None) -> None:
        def report(f: Future[Any]) -> None:
            if f.exception() is not None:
                log.error("recording %s failed: %s", turn.turn_id, f.exception())

        self._submit(_Job(Future(), turn=(turn, source, end_reason))).add_done_callback(report)

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
        self.store.checkpoint_on_commit()


@dataclass
class ProxyState:
    """Shared by all handlers of one running proxy."""

    settings: Settings
    backend: ServingBackend
    model_info: ModelInfo
    renderer: ChatFormat
    """The served model's chat format (`clawbridge.chat.render.Renderer`)."""
    store: Store
    writer: StoreWriter
    keys: Keys
    trainer: TrainerLoop | None = None
    """The trainer loop when the backend trains and training is on (clawbridge.trainer)."""
    lanes: UserLanes | None = None
    """Users' own adapters' trainer lanes with `per_user_adapters` (clawbridge.trainer.lanes)."""
    judge: RewardWorker | None = None
    """The judge worker when a judge is configured (clawbridge.rewards.worker)."""
    notes: NoteBook | None = None
    """Users' notes from talk when a judge is configured and notes are on (clawbridge.rewards.notes)."""
    note_checker: NoteChecker | None = None
    """The judge's check of a noted call's candidates (`notes_pick`, clawbridge.rewards.note_check)."""
    privacy: PrivacyGuard | None = None
    """The privacy filter where it is on (clawbridge.privacy): counts shown in status and metrics."""
    promotion: Promoter | None = None
    """Which version serves and when a new one may (clawbridge.promotion); set by `build_state`."""
    reporter: StepReporter | None = None
    """Step metrics to TensorBoard / W&B when `report_to` is set (clawbridge.telemetry.reporting)."""
    deletions: DeletionRetrier | None = None
    """Retries the deletions owed on a hosted backend's service (clawbridge.trainer.deletions)."""
    drain: Drain = field(default_factory=Drain)
    """Shutdown state: set by the server on SIGTERM (clawbridge.proxy.guard)."""
    router: VersionRouter = field(init=False)
    """Which version answers each model call: `NAME@N`, the serving version, a canary's candidate
    (clawbridge.serving.versions)."""

    sessions: SessionLifecycle = field(init=False)
    """How sessions end, with their default reward (clawbridge.runtime.lifecycle): every route and the reaper."""
    inflight: InFlight = field(init=False)
    """The requests running now and the forget epoch each began in (clawbridge.proxy.inflight)."""

    def __post_init__(self) -> None:
        self.router = VersionRouter(self.backend, VersionStore(self.store), (self.model_info.name, "default"))
        self.sessions = SessionLifecycle(self.store, self.settings)
        self.inflight = InFlight(self.store.tombstones)

    async def end_session(self, session_id: str, reason: str = "end_session") -> bool:
        """End `session_id` (`clawbridge.runtime.lifecycle`) and wake the trainer; False when it was unknown
        or already ended."""
        ended = await self.writer.call(self.sessions.end, session_id, reason)
        self._wake_trainer()
        return ended

    async def end_idle(self, idle_s: float) -> list[str]:
        """End every session idle for `idle_s` seconds (`clawbridge.runtime.lifecycle`) and wake the trainer."""
        ended = await self.writer.call(self.sessions.end_idle, idle_s)
        if ended:
            self._wake_trainer()
        return ended

    def _wake_trainer(self) -> None:
        if self.trainer is not None:
            self.trainer.notify()
        if self.lanes is not None:
            self.lanes.notify()

    async def compute(self, size: int, fn: Callable[..., T], *args: Any, reads_store: bool = False) -> T:
        """`fn(*args)`: CPU work that grows with a request of `size` bytes (parsing, validation,
        rendering). Up to `INLINE_BYTES` it runs right here on the loop: under the GIL a worker
        thread runs no sooner, and each hop costs a thread handoff and up to a 5 ms switch
        interval per call, which at 16 concurrent calls was most of the proxy's added latency
        (docs/benchmarks.md, "proxy overhead"). Larger requests go to a worker thread, so one huge
        body cannot hold the loop for its whole render. `reads_store`: `fn` may read the store (or
        works on what it read, whose size `size` does not show), so it always runs in a worker
        thread (the store's lock may be held for a whole transaction)."""
        if size <= INLINE_BYTES and not reads_store:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)`, a read of the store (or of something that reads it), on a worker thread."""
        return await asyncio.to_thread(fn, *args)

    @property
    def sampler(self) -> Sampler:
        """The backend's published sampler (model calls go through `router` instead)."""
        return self.backend.sampler()
