"""`FakeTrainingBackend`: a `TrainingBackend` over a `FakeSampler`, for tests, demos of the loop
and benchmarks of everything but the model.

Invariants:
- `train_step` records the batch and loss config it got (in `batches`, `losses`) before it can
  fail, so a test can see what a failed step was sent. Its metrics are computed from the batch
  exactly as a token-sum backend would at ratio 1: `loss = -sum(mask * advantage)`.
- `publish()` bumps the sampler's `version` by one and returns it: the next stream the proxy
  starts is sampled (and recorded) at the new version.
- Failures on demand: `fail_train` / `fail_publish` make the next N calls raise `FakeStepError`;
  `crash_after_train` makes the next `publish()` raise `SimulatedCrash`, a BaseException that no
  `except Exception` catches, standing in for a process killed between a step and its commit;
  `crash_at` does the same at a named moment ("train": after the update applied, "publish": after
  the new version serves, "checkpoint": during the checkpoint write, nothing saved).
- `FakeHostedBackend` keeps its checkpoints on a fake service (`RemoteCheckpoints`), where
  deleting can be refused or crash.
- The trainer state is modelled: `applied` lists the turn ids of every batch whose update the
  weights hold (a failed `train_step` with `fail_after_apply` still applies it, like a hosted step
  that timed out); a checkpoint snapshots `applied` and `restore_checkpoint` brings it back. The
  `disk` dict is where checkpoints live: hand the same one to the fake of a restarted process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from clawbridge.backend import Datum, FakeServingBackend, LossConfig, ModelInfo, RemoteObject, StepResult
from clawbridge.serving.sampler import FakeSampler


class FakeStepError(RuntimeError):
    """A training step the fake was told to fail."""


class SimulatedCrash(BaseException):
    """Stands in for `kill -9` between train_step and the step's commit."""


class FakeTrainingBackend(FakeServingBackend):
    """Serves `sampler`; trains by recording; publishes by bumping `sampler.version`."""

    name = "fake-training"

    def __init__(
        self,
        sampler: FakeSampler,
        info: ModelInfo,
        step_delay_s: float = 0.0,
        disk: dict[str, tuple[int, tuple[str, ...]]] | None = None,
    ) -> None:
        super().__init__(sampler, info)
        self.fake_sampler = sampler
        self.step_delay_s = step_delay_s
        """Seconds each train_step sleeps (to show that serving goes on meanwhile)."""
        self.batches: list[list[Datum]] = []
        self.losses: list[LossConfig] = []
        self.published: list[int] = []
        self.disk: dict[str, tuple[int, tuple[str, ...]]] = {} if disk is None else disk
        """Checkpoints by name: (policy version, applied turn ids); survives a simulated restart."""
        self.applied: list[str] = []
        """Turn ids whose update the trainer state holds, in the order applied."""
        self.restores: list[tuple[str, int]] = []
        self.fail_train = 0
        self.fail_after_apply = False
        """`fail_train` failures happen after the update was applied (a timed-out hosted step)."""
        self.fail_publish = 0
        self.crash_after_train = False
        self.crash_at: str | None = None

    async def train_step(self, batch: Sequence[Datum], loss: LossConfig) -> StepResult:
        self.batches.append(list(batch))
        self.losses.append(loss)
        if self.step_delay_s:
            await asyncio.sleep(self.step_delay_s)
        if self.fail_train > 0 and not self.fail_after_apply:
            self.fail_train -= 1
            raise FakeStepError("fake train_step failure (asked for)")
        self.applied.extend(t for d in batch for t in d.turn_ids)
        if self.fail_train > 0:
            self.fail_train -= 1
            raise FakeStepError("fake train_step failure after the update applied (asked for)")
        if self.crash_at == "train":
            self.crash_at = None
            raise SimulatedCrash("simulated kill after train_step")
        tokens = sum(sum(d.mask) for d in batch)
        pg = -sum(a * m for d in batch for a, m in zip(d.advantages, d.mask, strict=True))
        return StepResult(metrics={"loss": pg, "tokens": float(tokens), "kl": 0.0, "clip_fraction": 0.0})

    async def publish(self, version: int | None = None) -> int:
        if self.crash_after_train:
            self.crash_after_train = False
            raise SimulatedCrash("simulated kill between train_step and commit")
        if self.fail_publish > 0:
            self.fail_publish -= 1
            raise FakeStepError("fake publish failure (asked for)")
        new = self.fake_sampler.version + 1 if version is None else version
        if new <= self.fake_sampler.version:
            raise ValueError(f"new policy version {new} must be > {self.fake_sampler.version}")
        self.fake_sampler.version = new
        self.published.append(new)
        if self.crash_at == "publish":
            self.crash_at = None
            raise SimulatedCrash("simulated kill after publish")
        return new

    async def save_checkpoint(self, name: str) -> str:
        if self.crash_at == "checkpoint":
            self.crash_at = None
            raise SimulatedCrash("simulated kill during the checkpoint write")
        self.disk[name] = (self.fake_sampler.version, tuple(self.applied))
        return f"fake://{name}"

    async def delete_checkpoint(self, path: str) -> None:
        self.disk.pop(path.removeprefix("fake://"), None)

    async def restore_checkpoint(self, path: str, version: int | None = None) -> int:
        saved_version, applied = self.disk[path.removeprefix("fake://")]
        self.applied = list(applied)
        serve = saved_version if version is None else version
        if serve != self.fake_sampler.version:
            if serve < self.fake_sampler.version:
                raise ValueError(f"cannot serve v{serve} after v{self.fake_sampler.version}")
            self.fake_sampler.version = serve
            self.published.append(serve)
        self.restores.append((path, serve))
        return serve


class FakeHostedBackend(FakeTrainingBackend):
    """A `FakeTrainingBackend` whose checkpoints live on a fake service
    (`clawbridge.backend.RemoteCheckpoints`): each is two objects there, its state (the path) and
    its sampler weights (`path#sampler`), in `service`. `refuse` makes every delete fail (a
    service that is down); `crash_on_delete` makes the next one raise `SimulatedCrash`."""

    name = "fake-hosted"

    def __init__(self, sampler: FakeSampler, info: ModelInfo,
                 disk: dict[str, tuple[int, tuple[str, ...]]] | None = None,
                 service: set[str] | None = None) -> None:
        super().__init__(sampler, info, disk=disk)
        self.service: set[str] = set() if service is None else service
        """The objects the fake service holds; hand the same set to the fake of a restarted process."""
        self.refuse = False
        self.crash_on_delete = False
        self.deletes: list[str] = []
        """Every delete asked for, in order (refused ones too)."""

    async def save_checkpoint(self, name: str) -> str:
        path = await super().save_checkpoint(name)
        self.service |= {path, f"{path}#sampler"}
        return path

    def checkpoint_objects(self, path: str) -> list[RemoteObject]:
        return [RemoteObject(path, "state"), RemoteObject(f"{path}#sampler", "sampler")]

    def remote_objects(self) -> list[RemoteObject]:
        return [RemoteObject(p, "sampler" if p.endswith("#sampler") else "state") for p in sorted(self.service)]

    async def delete_remote(self, obj: RemoteObject) -> None:
        self.deletes.append(obj.path)
        if self.crash_on_delete:
            self.crash_on_delete = False
            raise SimulatedCrash("simulated kill while deleting on the service")
        if self.refuse:
            raise RuntimeError(f"the service refused to delete {obj.path}")
        self.service.discard(obj.path)  # one already gone counts as deleted
        if obj.kind == "state":
            self.disk.pop(obj.path.removeprefix("fake://"), None)


class FakeLaneBackend(FakeTrainingBackend):
    """One user's lane of `FakePerUserBackend` (`clawbridge.trainer.lanes.LaneBackend`)."""

    name = "fake-lane"

    def __init__(self, user: str, sampler: FakeSampler, info: ModelInfo, step_delay_s: float = 0.0) -> None:
        super().__init__(sampler, info, step_delay_s)
        self.user = user
        self.forgotten = False

    async def close(self) -> None:
        self.closed = True

    async def forget(self) -> int:
        """Close and delete every checkpoint; how many there were."""
        n = len(self.disk)
        self.disk.clear()
        self.closed = self.forgotten = True
        return n


class FakePerUserBackend(FakeTrainingBackend):
    """A `FakeTrainingBackend` that trains a `FakeLaneBackend` per user
    (`clawbridge.trainer.lanes.PerUserTraining`); `lanes` holds every lane it made, in order."""

    name = "fake-per-user"

    def __init__(self, sampler: FakeSampler, info: ModelInfo, step_delay_s: float = 0.0) -> None:
        super().__init__(sampler, info, step_delay_s)
        self.lanes: list[FakeLaneBackend] = []
        self.unloaded: list[int] = []
        """Versions `unload_versions` was told to stop serving."""

    def user_lanes_unsupported(self) -> str | None:
        return None

    def user_lane(self, user: str) -> FakeLaneBackend:
        lane = FakeLaneBackend(user, FakeSampler(list(self.fake_sampler.script)), self._info, self.step_delay_s)
        self.lanes.append(lane)
        return lane

    async def unload_versions(self, versions: list[int]) -> None:
        self.unloaded.extend(versions)
