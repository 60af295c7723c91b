"""A user's trainer lane on the local backend: their own LoRA adapter over the engine's base.

`LocalBackend.user_lane(user)` makes one for `clawbridge.trainer.lanes`; it is a
`clawbridge.backend.TrainingBackend` (and `CheckpointDeleter`) whose steps train that user's
adapter only.

Invariants:
- A lane trains LoRA only, in this process, over the torch engine's served base tensors
  (`TorchEngine.lend_base`, `clawbridge_local.trainer.model.over_base`), or beside SGLang over one
  base copy every lane shares (`LocalBackend._lanes_base`): a user's lane adds their adapter, its
  optimizer state and a step's activations, never a copy of the model.
- `publish(v)` hands the engine the lane's adapter as version v (torch: `TorchEngine.load_version`,
  beside the shared base, no copy; SGLang: the exported adapter folder copied to the version's
  folder and loaded as `v{v}`, which calls name as their `lora_path`), loaded through the
  backend's cache of loaded versions (`LoadedVersions.adopt`; the least
  recently used are unloaded past the cache's size; the router reloads one from its checkpoint
  when its user calls again). The lane itself keeps only the number (`LaneVersion`), never the
  sampler, so an unloaded adapter is freed once its last stream ends. The engine's published
  weights, the shared policy, never change.
- Its files live apart from every other lane's: checkpoints under
  `<state dir>/checkpoints/local/users/<user>/`, the trainer's exports under
  `<state dir>/trainer/local/users/<user>/`; `forget()` closes the trainer and deletes both.
- At most `max_lane_trainers` lanes keep their trainer (adapter, optimizer state) in memory
  (`LaneTrainers`, issue 32 §2: a family or a team has 10-100 users, and lanes take turns anyway):
  before a lane uses its trainer, the least recently used other lane whose trainer holds nothing
  unsaved is parked (its trainer closed), and a parked lane restores its trainer from the
  checkpoint it last saved or restored before its next use. A lane holds something unsaved from
  its `train_step` until its `save_checkpoint` or `restore_checkpoint`, and is never parked then;
  so parking never changes what a lane trains (`tests/test_local_lanes.py`). When every other
  resident lane is busy, the lane starts anyway and the count goes over the bound until one parks.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol

from clawbridge.backend import Datum, LossConfig, ModelInfo, StepResult
from clawbridge.runtime.durable import replace_dir
from clawbridge.serving.sampler import Sampler, SamplerUnavailable, SampleStream, SamplingParams
from clawbridge.serving.versions import LoadedVersions
from clawbridge_local.engine import TorchEngine
from clawbridge_local.sglang_engine import SGLangEngine
from clawbridge_local.training import LocalTrainer, on_training_thread

log = logging.getLogger("clawbridge.local")


class LaneHost(Protocol):
    """What a lane needs of the backend that serves it (`clawbridge_local.backend.LocalBackend`)."""

    @property
    def loaded_versions(self) -> LoadedVersions: ...

    def sampler(self) -> Sampler: ...

    def model_info(self) -> ModelInfo: ...

    def version_dir(self, version: int) -> Path: ...

    @property
    def lane_trainers(self) -> LaneTrainers: ...


class LaneTrainers:
    """Which users' lane trainers are in memory (module invariants); event loop only."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("max_lane_trainers must be >= 1")
        self.limit = limit
        self._resident: OrderedDict[str, UserLaneBackend] = OrderedDict()
        self._lock = asyncio.Lock()
        self.parked = 0
        """Trainers parked so far."""

    @property
    def resident(self) -> list[str]:
        """Users whose lane trainer is in memory, least recently used first."""
        return list(self._resident)

    async def activate(self, lane: UserLaneBackend) -> None:
        """Count `lane`'s trainer in memory, parking least recently used idle ones past the bound."""
        async with self._lock:
            if lane.user in self._resident:
                self._resident.move_to_end(lane.user)
                return
            while len(self._resident) >= self.limit:
                victim = next((other for other in self._resident.values() if other.parkable), None)
                if victim is None:  # every other resident lane holds an unsaved update or is in use
                    break
                del self._resident[victim.user]
                await victim.park()
                self.parked += 1
            self._resident[lane.user] = lane

    def drop(self, lane: UserLaneBackend) -> None:
        """`lane`'s trainer was closed (forgotten, or the server stops)."""
        if self._resident.get(lane.user) is lane:
            del self._resident[lane.user]


class UserLaneBackend:
    """The training backend of one user's adapter (module invariants)."""

    name = "local"

    def __init__(self, parent: LaneHost, user: str, trainer: LocalTrainer) -> None:
        self.parent = parent
        self.user = user
        self.trainer = trainer
        self._version = 0
        """The lane's newest published version (0: nothing published yet)."""
        self._parked = False
        """The trainer was closed to free memory; restore `client.last_checkpoint` before using it."""
        self._unsaved = False
        """The trainer holds an update not yet in a checkpoint (from `train_step` until saved or restored)."""
        self._busy = 0
        """Operations on the trainer running now."""

    @property
    def parkable(self) -> bool:
        """Whether the trainer may be closed now: started, idle, nothing unsaved, a checkpoint to come back to."""
        client = self.trainer.client
        return client.alive and not self._unsaved and self._busy == 0 and client.last_checkpoint is not None

    async def park(self) -> None:
        """Close the trainer (its memory goes); the next use restores it from its last checkpoint."""
        await on_training_thread(self.trainer.client.close)
        self._parked = True
        log.info("user %s: lane trainer parked (restored from its checkpoint at its next step)", self.user)

    async def _ready(self, restore: bool = True) -> None:
        """Before the trainer is used (with `_busy` held): counted in memory, and restored if parked."""
        await self.parent.lane_trainers.activate(self)
        if self._parked and restore:
            checkpoint = self.trainer.client.last_checkpoint
            assert checkpoint is not None
            await on_training_thread(self.trainer.restore_checkpoint, checkpoint)
        self._parked = False

    async def start(self) -> None:
        """Nothing to start: the trainer starts with the lane's first step (or restore)."""

    def model_info(self) -> ModelInfo:
        return self.parent.model_info()

    def sampler(self) -> Sampler:
        """The lane's newest published version (`LaneVersion`), or, before its first, the shared one."""
        return LaneVersion(self.parent, self._version) if self._version else self.parent.sampler()

    async def train_step(self, batch: Sequence[Datum], loss: LossConfig) -> StepResult:
        self._busy += 1
        try:
            await self._ready()
            self._unsaved = True
            return await on_training_thread(self.trainer.train_step, batch, loss)
        finally:
            self._busy -= 1

    async def publish(self, version: int | None = None) -> int:
        """Serve the trained adapter as `version` beside every other (the shared weights stay)."""
        target = self._version + 1 if version is None else version
        await self._serve(target)
        return target

    async def _serve(self, version: int) -> None:
        self._busy += 1
        try:
            await self._ready()
            await self._serve_ready(version)
        finally:
            self._busy -= 1

    async def _serve_ready(self, version: int) -> None:
        engine = self.parent.sampler()
        load: Callable[[], Awaitable[Sampler]]
        if isinstance(engine, TorchEngine):
            torch_engine = engine

            async def load() -> Sampler:
                update = await on_training_thread(self.trainer.weight_update)
                return await torch_engine.load_version(update, version)
        elif isinstance(engine, SGLangEngine) and engine.lora:
            sglang, folder = engine, self.parent.version_dir(version)

            async def load() -> Sampler:
                await on_training_thread(lambda: _copy_export(self.trainer.export(), folder))
                return await sglang.load_lora_version(folder, version)
        else:
            raise RuntimeError("per-user adapters need LoRA on the torch engine or on SGLang")
        await self.parent.loaded_versions.adopt(version, load)  # held while it loads: never unloaded under it
        self._version = version
        self.trainer.client.policy_version = version

    async def save_checkpoint(self, name: str) -> str:
        self._busy += 1
        try:
            await self._ready()
            path = await on_training_thread(self.trainer.save_checkpoint, name, self._version)
            self._unsaved = False
            return str(path)
        finally:
            self._busy -= 1

    async def restore_checkpoint(self, path: str, version: int | None = None) -> int:
        """Load the lane's checkpoint into its trainer and serve it as `version` (default: its own)."""
        self._busy += 1
        try:
            await self._ready(restore=False)
            recorded = await on_training_thread(self.trainer.restore_checkpoint, Path(path))
            self._unsaved = False
            target = recorded if version is None else version
            if target != self.sampler().policy_version:  # the version served now: only the trainer state reloads
                await self._serve_ready(target)
            return target
        finally:
            self._busy -= 1

    async def delete_checkpoint(self, path: str) -> None:
        """`CheckpointDeleter`: refuses anything outside this lane's checkpoint folder."""
        root = self.trainer.checkpoint_dir.resolve()
        target = Path(path).resolve()
        if target.parent != root:
            raise ValueError(f"{path} is not a checkpoint of {self.user}'s lane ({root})")
        await asyncio.to_thread(shutil.rmtree, target, True)

    async def close(self) -> None:
        self.parent.lane_trainers.drop(self)
        await asyncio.to_thread(self.trainer.close)

    async def forget(self) -> int:
        """Close the trainer and delete the lane's checkpoints and exports; the checkpoints deleted."""
        await self.close()
        folders = [self.trainer.checkpoint_dir, self.trainer.work_dir]
        n = sum(1 for p in folders[0].iterdir() if p.is_dir()) if folders[0].is_dir() else 0
        for folder in folders:
            await asyncio.to_thread(shutil.rmtree, folder, True)
        log.info("deleted %s's adapter: %d checkpoint(s)", self.user, n)
        return n


class LaneVersion:
    """A lane's newest published version as its trainer loop sees it (staleness, checkpoints): the
    number, and sampling while the engine keeps that version loaded. Users' calls get their version
    through the router (`clawbridge.serving.versions`), which reloads it from its checkpoint if unloaded."""

    def __init__(self, parent: LaneHost, version: int) -> None:
        self.parent = parent
        self.version = version

    @property
    def policy_version(self) -> int:
        return self.version

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> SampleStream:
        sampler = self.parent.loaded_versions.peek(self.version)
        if sampler is None:
            raise SamplerUnavailable(f"policy version {self.version} is not loaded now; call it through the proxy, "
                                     "which loads it from its checkpoint")
        return await sampler.sample(prompt_ids, params)


def _copy_export(export: Path, folder: Path) -> None:
    """The trainer's newest export (replaced at its next export) copied to a version's own folder,
    whole or not at all (`clawbridge.runtime.durable.replace_dir`)."""
    tmp = folder.with_name(f".{folder.name}.copying")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(export, tmp)
    replace_dir(tmp, folder)
