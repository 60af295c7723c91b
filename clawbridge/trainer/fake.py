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
  `except Exception` catches, standing in for a process killed between a step and its commit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from clawbridge.backend import Datum, FakeServingBackend, LossConfig, ModelInfo, StepResult
from clawbridge.sampler import FakeSampler


class FakeStepError(RuntimeError):
    """A training step the fake was told to fail."""


class SimulatedCrash(BaseException):
    """Stands in for `kill -9` between train_step and the step's commit."""


class FakeTrainingBackend(FakeServingBackend):
    """Serves `sampler`; trains by recording; publishes by bumping `sampler.version`."""

    name = "fake-training"

    def __init__(self, sampler: FakeSampler, info: ModelInfo, step_delay_s: float = 0.0) -> None:
        super().__init__(sampler, info)
        self.fake_sampler = sampler
        self.step_delay_s = step_delay_s
        """Seconds each train_step sleeps (to show that serving goes on meanwhile)."""
        self.batches: list[list[Datum]] = []
        self.losses: list[LossConfig] = []
        self.published: list[int] = []
        self.checkpoints: dict[str, int] = {}
        self.fail_train = 0
        self.fail_publish = 0
        self.crash_after_train = False

    async def train_step(self, batch: Sequence[Datum], loss: LossConfig) -> StepResult:
        self.batches.append(list(batch))
        self.losses.append(loss)
        if self.step_delay_s:
            await asyncio.sleep(self.step_delay_s)
        if self.fail_train > 0:
            self.fail_train -= 1
            raise FakeStepError("fake train_step failure (asked for)")
        tokens = sum(sum(d.mask) for d in batch)
        pg = -sum(a * m for d in batch for a, m in zip(d.advantages, d.mask, strict=True))
        return StepResult(metrics={"loss": pg, "tokens": float(tokens), "kl": 0.0, "clip_fraction": 0.0})

    async def publish(self) -> int:
        if self.crash_after_train:
            self.crash_after_train = False
            raise SimulatedCrash("simulated kill between train_step and commit")
        if self.fail_publish > 0:
            self.fail_publish -= 1
            raise FakeStepError("fake publish failure (asked for)")
        self.fake_sampler.version += 1
        self.published.append(self.fake_sampler.version)
        return self.fake_sampler.version

    async def save_checkpoint(self, name: str) -> str:
        self.checkpoints[name] = self.fake_sampler.version
        return f"fake://{name}"

    async def restore_checkpoint(self, path: str) -> int:
        version = self.checkpoints[path.removeprefix("fake://")]
        self.fake_sampler.version = version
        return version
