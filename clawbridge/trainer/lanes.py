"""Per-user adapters: a trainer lane per user beside the shared one (`per_user_adapters`).

Each user's rewarded turns train that user's own LoRA adapter, and that user's calls are answered
by it; calls without a user train and get the shared policy, as without lanes.

Invariants:
- A lane is a `TrainerLoop` bound to one user (`lane=user`) over a `TrainingBackend` of that
  user's adapter (`PerUserTraining.user_lane`), with its own `CheckpointKeeper`: its optimizer
  state, checkpoints and policy versions (the store's `lane` column) are that user's alone, and a
  step trains the turns of one user only (`clawbridge.store.training`). The shared loop is the lane ''.
- A lane's versions are not gated (promotion gates the shared policy; `per_user_problem` refuses
  `eval` and `canary`), but its steps rehearse: with the shared gate as `rehearsals`, each lane's
  loop gets `RehearsalOnly` (`clawbridge.trainer.gate`), so its steps add the same rehearsal set of
  the shared anchor's correct answers as the shared policy's steps (`clawbridge.promotion.rehearsal`).
- A lane starts when its user has a pending sample, or (at start-up) a committed version: a
  restart resumes every user's adapter from its newest committed checkpoint, exactly as the shared
  policy resumes.
- The steps of every lane, the shared one included, hold one `step_lock`, which asyncio hands to
  waiters in arrival order: lanes take turns, so one busy user never starves another's steps.
- Routing (`clawbridge.serving.versions.VersionRouter`): a user's plain calls get their lane's newest
  committed trained version (`version_for`) once their lane has one; until then the shared serving
  version. `NAME@N` naming another user's version is answered as a version that does not exist.
- Forgetting a user (`forget_user`, a `clawbridge.proxy.user_routes.ForgetHook`, called once her
  calls were cut and refused) stops their lane, unloads their versions from every engine (SGLang's
  adapters, their `versions/vN` folders: `PerUserTraining.unload_versions`), deletes their
  checkpoints and exports, and deletes their versions and steps from the store; no lane starts for
  them again until the store's part is over (`forgotten`), and the store never takes a turn of hers
  from a call that began before (`clawbridge.store.tombstones`), so a lane that starts later trains
  a new user of that name only. Her version numbers are never given again (`clawbridge.store.counters`).
  On a hosted backend (`RemoteCheckpoints`), what the lane keeps on the service is owed to the
  store's list of deletions before the lane's files go (`clawbridge.trainer.deletions`), then
  deleted; what the service does not delete now stays owed and is retried until it is gone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from clawbridge.backend import RemoteCheckpoints, TrainingBackend
from clawbridge.config import Settings
from clawbridge.runtime.background import Background
from clawbridge.store import Store
from clawbridge.store.versions import VersionStore
from clawbridge.trainer.checkpoints import CheckpointKeeper
from clawbridge.trainer.deletions import OwedDeletions
from clawbridge.trainer.gate import RehearsalOnly, RehearsalSource
from clawbridge.trainer.loop import TrainerLoop

if TYPE_CHECKING:
    from clawbridge.privacy.guard import PrivacyGuard

log = logging.getLogger("clawbridge.trainer")

TREND_STEPS = 10
"""Steps whose reward means a lane's status shows (its reward trend)."""


@runtime_checkable
class LaneBackend(TrainingBackend, Protocol):
    """The training backend of one user's adapter."""

    async def close(self) -> None:
        """Free the lane's trainer (its files stay)."""
        ...

    async def forget(self) -> int:
        """Close, and delete every file of the lane (checkpoints, exports); how many checkpoints."""
        ...


@runtime_checkable
class PerUserTraining(Protocol):
    """A backend that can train an adapter per user (optional capability)."""

    def user_lanes_unsupported(self) -> str | None:
        """Why these settings cannot train per user, or None when they can."""
        ...

    def user_lane(self, user: str) -> LaneBackend:
        """A training backend for `user`'s own adapter, over the one served base."""
        ...

    async def unload_versions(self, versions: list[int]) -> None:
        """Stop serving `versions` (a forgotten user's) on every engine and delete what was written
        to serve them (adapter folders); returns once nothing new can be sampled from them."""
        ...


def per_user_problem(settings: Settings, backend: object) -> str | None:
    """Why `per_user_adapters` cannot run with these settings and this backend (None: it can)."""
    if not settings.per_user_adapters:
        return None
    if not isinstance(backend, PerUserTraining):
        name = getattr(backend, "name", "this backend")
        return (f"per_user_adapters: backend {name} cannot train an adapter per user yet; use --backend local or "
                "tinker with LoRA")
    if settings.promotion_mode in ("eval", "canary"):
        return (f"per_user_adapters with promotion_mode {settings.promotion_mode} is not supported yet (each user "
                "would need their own evaluation); set promotion_mode = \"probe\" (the shared policy's gate) or "
                "\"off\"")
    return backend.user_lanes_unsupported()


class UserLanes:
    """The users' trainer lanes of one server (module invariants)."""

    def __init__(self, settings: Settings, store: Store, backend: PerUserTraining, step_lock: asyncio.Lock,
                 identity: dict[str, Any] | None = None, privacy: PrivacyGuard | None = None) -> None:
        self.settings = settings
        self.store = store
        self.backend = backend
        self.step_lock = step_lock
        """Shared with the shared policy's loop: every lane's steps take turns."""
        self.identity = identity
        self.privacy = privacy
        self.lanes: dict[str, TrainerLoop] = {}
        """Running lanes by user."""
        self.rehearsals: RehearsalSource | None = None
        """The shared gate, whose rehearsal set every lane's steps add (module invariants); set
        before `start`."""
        self._lock = asyncio.Lock()
        """Starting and forgetting lanes never interleave."""
        self._forgetting: set[str] = set()
        """Users being forgotten: no lane starts for them until the store's part is over."""
        self.background = Background("clawbridge-lanes", store.clock)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start every lane that has committed versions, then look for new users' samples."""
        await self.scan()
        self.background.start(self._run)

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop looking for users, then every lane (a step in progress may finish), then free them."""
        await self.background.stop(timeout_s, cancel_first=True)
        async with self._lock:
            for user, loop in list(self.lanes.items()):
                await loop.stop(timeout_s)
                await _lane_backend(loop).close()
                del self.lanes[user]

    def notify(self) -> None:
        """A session ended: look for ready turns in every lane now."""
        self.background.notify()
        for loop in self.lanes.values():
            loop.notify()

    async def _run(self) -> None:
        while not self.background.stopping:
            try:
                await self.scan()
            except Exception:
                log.exception("could not look for users to train; retrying")
            await self.background.sleep(self.settings.trainer_poll_interval_s)

    async def scan(self) -> list[str]:
        """Start a lane for each user with pending samples or committed versions; returns those started."""
        users = await asyncio.to_thread(self._users_due)
        started = []
        for user in users:
            if user not in self.lanes and user not in self._forgetting:
                async with self._lock:
                    if user in self.lanes or user in self._forgetting:
                        continue
                    try:
                        await self._start_lane(user)
                    except Exception:  # one user's damaged checkpoint must not stop the others (or the server)
                        log.exception("user %s: could not start their trainer lane; trying again at the next look", user)
                        continue
                    started.append(user)
        return started

    def _users_due(self) -> list[str]:
        with self.store.read() as c:
            rows = c.execute(
                "SELECT DISTINCT s.user_id FROM samples sa JOIN sessions s ON s.session_id = sa.session_id "
                "WHERE sa.consumed_step IS NULL AND sa.dropped_reason IS NULL AND s.user_id IS NOT NULL "
                "UNION SELECT DISTINCT lane FROM policy_versions WHERE lane != '' AND status='committed' ORDER BY 1"
            ).fetchall()
        return [str(r[0]) for r in rows]

    async def _start_lane(self, user: str) -> None:
        backend = self.backend.user_lane(user)
        await backend.start()
        keeper = CheckpointKeeper(self.store, backend, self.identity, keep=self.settings.keep_checkpoints, lane=user)
        try:
            await keeper.resume()
        except BaseException:
            await backend.close()
            raise
        loop = TrainerLoop.from_settings(self.settings, self.store, backend, keeper, self.privacy, lane=user,
                                         step_lock=self.step_lock)
        if self.rehearsals is not None:
            loop.gate = RehearsalOnly(self.rehearsals)
        self.lanes[user] = loop
        await loop.start()
        trained = keeper.trained_version
        log.info("user %s: trainer lane started (%s)", user,
                 f"serving their v{trained}" if trained is not None else "no trained version yet")

    # ------------------------------------------------------------------ routing
    def own_version(self, user: str | None) -> tuple[int, str] | None:
        """The version `user`'s plain calls get, with its checkpoint: their lane's newest committed
        trained version, or None (the shared serving version answers). From memory: no store read
        on a model call's path."""
        loop = self.lanes.get(user) if user is not None else None
        return None if loop is None else loop.keeper.trained

    def version_for(self, user: str | None) -> int | None:
        """`own_version`'s number."""
        own = self.own_version(user)
        return None if own is None else own[0]

    # ------------------------------------------------------------------ the admin's rollback
    async def rollback(self, user: str, version: int) -> tuple[int | None, int]:
        """`clawbridge rollback N --user USER`: serve committed `version` of `user`'s lane to their
        calls under a new version of that lane, and train on from it; (the version their calls got
        before, the new one). `LookupError` when `user` has no lane running; the keeper's
        `NoCheckpoint` when `version` is not a kept version of their lane."""
        loop = self.lanes.get(user)
        if loop is None:
            raise LookupError(f"user {user!r} has no trainer lane running (nothing trained for them yet, or "
                              "the server runs with --no-train)")
        previous = loop.keeper.trained_version
        return previous, await loop.rollback(version)

    # ------------------------------------------------------------------ forgetting
    async def forget_user(self, user: str) -> dict[str, int]:
        """`ForgetHook`: stop `user`'s lane and delete their adapter, checkpoints, versions and steps;
        no lane starts for them again until `forgotten(user)`."""
        async with self._lock:
            self._forgetting.add(user)
            loop = self.lanes.pop(user, None)
            if loop is not None:
                await loop.stop()
            backend = _lane_backend(loop) if loop is not None else self.backend.user_lane(user)
            versions = VersionStore(self.store, user)
            rows = await asyncio.to_thread(versions.listing, 1_000_000, False)
            await self.backend.unload_versions([r.version for r in rows])
            owed, objects = None, []
            if isinstance(backend, RemoteCheckpoints) and isinstance(self.backend, RemoteCheckpoints):
                await backend.close()  # trainers released first: what is left on the service is owed
                owed, objects = OwedDeletions(self.store, self.backend), backend.remote_objects()
                await owed.owe(objects, "forget")
            checkpoints = await backend.forget()
            deleted = await asyncio.to_thread(versions.delete_lane)
            if owed is not None:
                await owed.attempt(objects)
        log.info("user %s: adapter forgotten (%d checkpoint folder(s), %d version(s), %d step(s))", user,
                 checkpoints, deleted["policy_versions"], deleted["steps"])
        return {"adapter_checkpoints": checkpoints, "adapter_versions": deleted["policy_versions"],
                "steps": deleted["steps"], "samples": deleted["samples"]}

    def forgotten(self, user: str) -> None:
        """`ForgetHook`: the store no longer holds `user`'s turns; a lane may start if they come back."""
        self._forgetting.discard(user)

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """Per user: the version their calls get, steps, pending turns, reward trend and the answers
        their last step rehearsed (reads the store)."""
        out: dict[str, Any] = {}
        lanes = sorted(self.lanes.items())
        if not lanes:
            return out
        every = lanes[0][1].tstore
        counts = every.step_counts_by_lane()
        ready: dict[str, int] = {}
        for s in every.ready_samples(every_lane=True):
            ready[s.user_id or ""] = ready.get(s.user_id or "", 0) + 1
        for user, loop in lanes:
            recent = loop.tstore.lane_steps(4 * TREND_STEPS)
            ok = [s for s in recent if s.status == "ok"]
            trend = [float(s.metrics["reward_mean"]) for s in reversed(ok[:TREND_STEPS])
                     if isinstance(s.metrics.get("reward_mean"), int | float)]
            last = recent[0] if recent else None
            rehearsed = ok[0].metrics.get("rehearsal_datums") if ok else None
            out[user] = {
                "serving_version": loop.keeper.trained_version,
                "in_step": loop.in_step,
                "steps": {"ok": counts.get(user, {}).get("ok", 0), "failed": counts.get(user, {}).get("failed", 0)},
                "pending_turns": ready.get(user, 0),
                "reward_trend": trend,
                "last_error": last.error if last is not None and last.status == "failed" else None,
                "rehearsed": int(rehearsed) if isinstance(rehearsed, int | float) else 0,
            }
        return out


def _lane_backend(loop: TrainerLoop) -> LaneBackend:
    backend = loop.backend
    assert isinstance(backend, LaneBackend)
    return backend
