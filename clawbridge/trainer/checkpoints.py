"""Checkpoints and policy versions, owned by the trainer loop the same way for every backend.

Invariants (with `clawbridge.store.versions`, which keeps the numbering):
- Every committed training step has a checkpoint: the step reserves a version in the store,
  publishes it, saves the trainer's weights + optimizer state, and only then commits step,
  samples and version in one transaction. So nothing is left to save at a graceful shutdown, and
  a restart (after a clean stop or `kill -9` at any moment) restores exactly the newest committed
  version, with its optimizer state, and serves it under its own number.
- Before the first step ever, the untrained trainer state is saved as version 0 (the base).
- A checkpoint is on the disk (files and names flushed: `clawbridge.runtime.durable`) before the store
  commits the row that names it. If the newest committed one is torn anyway (a disk that lied, a
  file damaged since: `CheckpointDamaged`), `resume` restores the newest intact older one under a
  NEW version (kind `restore`), since the torn one's number named other weights; the samples its
  steps consumed stay consumed (their update is what was lost).
- A failed step never applies its update twice: after any failure (train_step, publish,
  checkpoint or commit) the trainer state may hold an update that was not committed, so it is
  reloaded from the newest committed checkpoint before another step runs (`undo`). If a publish
  was attempted, the reloaded weights are served under a NEW version (kind `restore`), since the
  served number may already have named the uncommitted weights.
- A checkpoint names what it belongs to (`identity`: backend, base model and its content hash,
  LoRA config); resuming onto anything else refuses with what differs (`CheckpointMismatch`).
- Rollback to an earlier committed version serves its checkpoint under a new version (kind
  `rollback`); training continues from it. Numbers are never reused.
- Retention: after each commit (a step or a rollback), checkpoints named only by committed
  versions older than the `keep` newest, and those written for versions that were abandoned
  (a failed or killed step), are deleted through the backend (`CheckpointDeleter`)
  and marked pruned in the store (`VersionStore.prunable`). The served checkpoint is always kept,
  and so is any a recent rollback version names; the one being restored is never deleted (all of
  this runs under the trainer loop's lock, and `prune` skips `restoring` anyway). A failed
  delete is logged and tried again after the next commit; a backend without `delete_checkpoint`
  keeps everything. A hosted backend's checkpoints (`RemoteCheckpoints`) are pruned as owed work
  (`clawbridge.trainer.deletions`): its objects are owed and its versions marked pruned in one
  transaction, then each object is deleted on its own and retried until the service has none.
- A keeper is bound to one lane (`clawbridge.store.versions`: '' the shared policy, or a user's
  adapter): it reserves, restores, undoes and prunes only that lane's versions.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from clawbridge.backend import CheckpointDamaged, CheckpointDeleter, RemoteCheckpoints, TrainingBackend
from clawbridge.store import Store, StoreError
from clawbridge.store.versions import VersionRow, VersionStore
from clawbridge.trainer.deletions import OwedDeletions
from clawbridge.trainer.identity import CheckpointMismatch, describe_mismatch

log = logging.getLogger("clawbridge.trainer")


class NoCheckpoint(StoreError):
    """The requested version has no committed checkpoint to go back to."""


def check_identity(store: Store, identity: dict[str, Any] | None) -> VersionRow | None:
    """The store's newest committed version; `CheckpointMismatch` when it belongs to another
    identity than `identity` (None: not checked)."""
    last = VersionStore(store).last_committed()
    if last is not None and identity is not None and last.identity is not None:
        diff = describe_mismatch(last.identity, identity)
        if diff:
            raise CheckpointMismatch(diff)
    return last


def checkpoint_name(version: int, kind: str = "step") -> str:
    """The name a version's checkpoint is saved under (sorts by version)."""
    return f"v{version:08d}-{kind}"


class CheckpointKeeper:
    """The loop's checkpoint and version bookkeeping over one `TrainingBackend` (not thread-safe:
    the trainer loop calls it under its own lock)."""

    def __init__(
        self, store: Store, backend: TrainingBackend, identity: dict[str, Any] | None = None, keep: int = 3,
        lane: str = "",
    ) -> None:
        self.versions = VersionStore(store, lane)
        self.backend = backend
        self.identity = identity
        """What checkpoints written here belong to (None: not checked, e.g. fakes)."""
        self.keep = keep
        """Retention: checkpoints of the newest `keep` committed versions stay (`keep_checkpoints`)."""
        self.restoring: str | None = None
        """The checkpoint a restore is loading right now (never pruned)."""
        self.dirty = False
        """The trainer state may hold an uncommitted update: `undo` before the next step."""
        self.publish_attempted = False
        """Since the last commit, a publish was attempted (served weights may be uncommitted)."""
        self.trained: tuple[int, str] | None = None
        """The lane's newest committed version that is not its base, with its checkpoint (None:
        only the base so far); a user lane serves it to its user (`clawbridge.trainer.lanes`)."""

    # ------------------------------------------------------------------ start-up
    def check_identity(self) -> VersionRow | None:
        """The newest committed version, after checking it belongs to `identity`."""
        return check_identity(self.versions.store, self.identity)

    async def resume(self, serve: int | None = None) -> int:
        """Abandon reservations of an earlier process and serve the newest committed version (or
        committed `serve`, under its own number: a server that does not train serves the version
        promotion last promoted, whatever was trained after it); return the served version."""
        abandoned = await _to_thread(self.versions.abandon_reserved)
        if abandoned:
            log.warning("%d policy version(s) reserved by an earlier run never committed; not reused", abandoned)
        last = await _to_thread(self.check_identity) if not self.versions.lane else \
            await _to_thread(self.versions.last_committed)
        if last is not None and last.kind != "base" and last.checkpoint is not None:
            self.trained = (last.version, last.checkpoint)
        serving = self.backend.sampler().policy_version
        if last is not None and serve is not None and serve != last.version:
            row = await _to_thread(self.versions.get, serve)
            if row is not None and row.restorable and row.checkpoint is not None and row.lane == self.versions.lane:
                if serve == serving:  # e.g. the base, which a fresh backend serves already
                    return serving
                version = await self._restore(row.checkpoint, serve)
                log.info("restored checkpoint %s: serving the promoted v%d (newer v%d is not served)",
                         row.checkpoint, version, last.version)
                return version
            log.error("the promoted v%d cannot be restored (%s); serving the newest v%d", serve,
                      no_checkpoint_message(serve, row), last.version)
        if last is None or last.checkpoint is None or (last.version == 0 and serving == 0):
            return serving
        try:
            version = await self._restore(last.checkpoint, last.version)
        except CheckpointDamaged as exc:
            return await self._resume_older(last, exc)
        log.info("restored checkpoint %s: serving policy v%d", last.checkpoint, version)
        return version

    async def _resume_older(self, torn: VersionRow, damage: CheckpointDamaged) -> int:
        """The newest committed checkpoint is torn: restore the newest intact older one and serve
        it under a NEW version (kind `restore`; `torn`'s number named other weights). Raises
        `damage` when no older one is intact."""
        log.error("%s; policy v%d cannot be resumed, trying older checkpoints", damage, torn.version)
        older = [r for r in await _to_thread(self.versions.listing, 1_000_000)
                 if r.version < torn.version and r.restorable and r.checkpoint != torn.checkpoint]
        for row in older:
            assert row.checkpoint is not None
            version = await _to_thread(self.versions.reserve, "restore", None, row.version)
            try:
                await self._restore(row.checkpoint, version)
            except CheckpointDamaged as exc:
                await _to_thread(self.versions.abandon, version)
                log.error("%s; trying an older one", exc)
                continue
            await _to_thread(self.versions.commit, version, row.checkpoint, row.identity)
            self.trained = (version, row.checkpoint) if row.kind != "base" else None
            self.committed()
            log.warning("resumed from v%d's checkpoint %s (v%d's is torn), now served as v%d", row.version,
                        row.checkpoint, torn.version, version)
            return version
        raise damage

    # ------------------------------------------------------------------ steps
    async def ensure_base(self) -> None:
        """Save the untrained state as version 0 once, before the first step ever."""
        if await _to_thread(self.versions.last_committed) is not None:
            return
        path = await self.backend.save_checkpoint(checkpoint_name(0, "base"))
        await _to_thread(self.versions.commit_base, path, self.identity)

    def reserve_step(self, step: int) -> int:
        return self.versions.reserve("step", step=step)

    async def publish(self, version: int) -> None:
        self.publish_attempted = True
        served = await self.backend.publish(version)
        if served != version:
            raise RuntimeError(f"backend {self.backend.name} published v{served}, not the reserved v{version}")

    async def save(self, version: int) -> str:
        path = await self.backend.save_checkpoint(checkpoint_name(version))
        await _to_thread(self.versions.note_checkpoint, version, path)  # found by retention if never committed
        return path

    @property
    def trained_version(self) -> int | None:
        return self.trained[0] if self.trained is not None else None

    def committed(self, version: int | None = None, checkpoint: str | None = None) -> None:
        """The step (or the restore of `version` from `checkpoint`) committed: the trainer state
        and the served weights are the committed ones."""
        if version is not None and checkpoint is not None:
            self.trained = (version, checkpoint)
        self.dirty = False
        self.publish_attempted = False

    async def undo(self) -> None:
        """Reload the newest committed checkpoint into the trainer (see the module invariants).
        Raises when that fails; `dirty` stays set and the loop tries again before any step."""
        self.dirty = True
        last = await _to_thread(self.versions.last_committed)
        if last is None or last.checkpoint is None:
            self.dirty = False  # nothing was ever committed: the failure happened before the base save
            return
        if self.publish_attempted:
            version = await _to_thread(self.versions.reserve, "restore", None, last.version)
            await self._restore(last.checkpoint, version)
            await _to_thread(self.versions.commit, version, last.checkpoint, last.identity)
            log.warning("served weights reset to the committed v%d's, now as v%d", last.version, version)
            self.committed(version if last.kind != "base" else None, last.checkpoint)
            return
        await self._restore(last.checkpoint, self.backend.sampler().policy_version)
        log.warning("trainer state reset to the committed v%d's checkpoint", last.version)
        self.committed()

    # ------------------------------------------------------------------ rollback
    async def rollback(self, target: int) -> int:
        """Serve committed version `target`'s checkpoint under a new version and continue training
        from it; return the new version."""
        row = await _to_thread(self.versions.get, target)
        if row is None or not row.restorable or row.checkpoint is None:
            raise NoCheckpoint(no_checkpoint_message(target, row))
        version = await _to_thread(self.versions.reserve, "rollback", None, target)
        try:
            await self._restore(row.checkpoint, version)
        except BaseException:
            self.dirty = self.publish_attempted = True
            raise
        await _to_thread(self.versions.commit, version, row.checkpoint, row.identity)
        self.committed(version, row.checkpoint)
        await self.prune()
        return version

    # ------------------------------------------------------------------ retention
    async def prune(self) -> list[str]:
        """Delete the checkpoints retention no longer keeps (see the module invariants); returns
        the ones deleted (a hosted backend's: the ones pruned, their objects deleted or owed). Never
        raises: a failure is logged and retried after the next commit (or by the owed list)."""
        backend = self.backend
        if not isinstance(backend, CheckpointDeleter | RemoteCheckpoints):
            return []
        deleted: list[str] = []
        try:
            for path in await _to_thread(self.versions.prunable, self.keep):
                if path == self.restoring:
                    continue
                if isinstance(backend, RemoteCheckpoints):
                    owed, objects = OwedDeletions(self.versions.store, backend), backend.checkpoint_objects(path)
                    await owed.owe(objects, "prune", prune_checkpoint=path)
                    await owed.attempt(objects)
                else:
                    await backend.delete_checkpoint(path)
                    await _to_thread(self.versions.mark_pruned, path)
                deleted.append(path)
        except Exception as exc:
            log.warning("could not prune old checkpoints (will try again after the next step): %s", exc)
        if deleted:
            log.info("pruned %d checkpoint(s) older than the newest %d: %s", len(deleted), self.keep,
                     ", ".join(deleted))
        return deleted

    async def _restore(self, path: str, version: int | None) -> int:
        self.restoring = path
        try:
            return await self.backend.restore_checkpoint(path, version)
        finally:
            self.restoring = None


def no_checkpoint_message(version: int, row: VersionRow | None) -> str:
    """Why `version` cannot be restored or rolled back to."""
    if row is not None and row.status == "committed" and row.pruned_at is not None:
        return (f"policy version {version}'s checkpoint was pruned (only the newest keep_checkpoints are kept); "
                "see `clawbridge checkpoints list`")
    return f"policy version {version} has no committed checkpoint; see `clawbridge checkpoints list`"


async def _to_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)
