"""`LocalBackend`: the `local` ServingBackend (entry point `clawbridge.backends:local`).

Invariants:
- `create(settings)` only checks settings; nothing loads until `start()`, which loads the model
  off the event loop (`asyncio.to_thread`) so the proxy stays responsive.
- `engine="auto"` serves with the in-process torch engine; `engine="sglang"` is refused with a clear
  message until SGLang serving lands together with local training.
- `model_info()` and `sampler()` are valid between `start()` and `close()`.
- Training (`train_step`, `publish`, checkpoints) goes through `LocalTrainer`, started lazily; a
  publish swaps the engine's weights under a new version, so serving never pauses. `start()`
  restores the newest checkpoint in the state dir and serves its weights under its version.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from clawbridge.backend import Datum, LossConfig, ModelInfo, StepResult
from clawbridge.config import Settings
from clawbridge_local.engine import TorchEngine
from clawbridge_local.training import LocalTrainer

log = logging.getLogger("clawbridge.local")


class EngineNotAvailable(RuntimeError):
    """The configured serving engine is not available in this build."""


def _check_engine(settings: Settings) -> str:
    """The engine to run for `settings` ('torch'), or raise EngineNotAvailable."""
    if settings.engine == "sglang":
        raise EngineNotAvailable(
            "engine 'sglang' is not available yet: SGLang serving arrives with local training. "
            "Use --engine torch (or auto) to serve with the in-process torch engine."
        )
    return "torch"


class LocalBackend:
    """Serves `settings.model` on this machine with `TorchEngine`."""

    name = "local"

    def __init__(self, settings: Settings, *, progress: bool = True) -> None:
        self.settings = settings
        """The resolved configuration this backend was created from."""
        self.engine_name = _check_engine(settings)
        """Which engine serves ('torch')."""
        if not settings.model:
            raise ValueError("the local backend needs a model: set --model (a folder or a cached HF id)")
        self._progress = progress
        self._engine: TorchEngine | None = None
        self._trainer: LocalTrainer | None = None
        self._publishes = 0

    async def start(self) -> None:
        """Load the model (with a progress bar) in a thread and start the engine's worker."""
        if self._engine is not None:
            return
        s = self.settings
        self._engine = await asyncio.to_thread(
            TorchEngine.load,
            s.model,
            device=s.device,
            dtype=s.dtype,
            max_running=s.max_running_requests,
            max_queued=s.max_queued_requests,
            progress=self._progress,
        )
        trainer = self._training()
        latest = trainer.latest()
        if latest is not None:
            version = await asyncio.to_thread(trainer.restore_checkpoint, latest)
            if version > 0:
                update = await asyncio.to_thread(trainer.weight_update)
                await self._engine.swap_weights(update, version)
            log.info("restored %s: serving policy v%d", latest, version)

    def _require(self) -> TorchEngine:
        if self._engine is None:
            raise RuntimeError("LocalBackend.start() has not been called (or close() was)")
        return self._engine

    def model_info(self) -> ModelInfo:
        """Name, tokenizer source, context window and default max_tokens of the served model."""
        engine = self._require()
        return ModelInfo(
            name=self.settings.model_name,
            tokenizer_path=self.settings.tokenizer_source,
            context_window=engine.context_window,
            max_output_tokens=self.settings.default_max_tokens,
        )

    def sampler(self) -> TorchEngine:
        """The engine, which is the Sampler."""
        return self._require()

    # ---- training ----------------------------------------------------------------------
    def _training(self) -> LocalTrainer:
        if self._trainer is None:
            self._trainer = LocalTrainer(self.settings)
        return self._trainer

    async def train_step(self, batch: Sequence[Datum], loss: LossConfig) -> StepResult:
        """One FSDP (or in-process) optimizer step; serving goes on meanwhile."""
        return await asyncio.to_thread(self._training().train_step, batch, loss)

    async def publish(self) -> int:
        """Swap the trained weights into the engine as the next policy version; checkpoint every
        `checkpoint_every` publishes."""
        engine = self._require()
        trainer = self._training()
        update = await asyncio.to_thread(trainer.weight_update)
        version = await engine.swap_weights(update, engine.policy_version + 1)
        trainer.client.policy_version = version
        self._publishes += 1
        every = self.settings.checkpoint_every
        if every > 0 and self._publishes % every == 0:
            await self.save_checkpoint(f"step-{trainer.client.step:08d}")
        return version

    async def save_checkpoint(self, name: str) -> str:
        trainer = self._training()
        path = await asyncio.to_thread(trainer.save_checkpoint, name, self._require().policy_version)
        return str(path)

    async def restore_checkpoint(self, path: str) -> int:
        """Load a checkpoint into the trainer and serve its weights under its version."""
        trainer = self._training()
        version = await asyncio.to_thread(trainer.restore_checkpoint, Path(path))
        engine = self._require()
        if version > engine.policy_version:
            update = await asyncio.to_thread(trainer.weight_update)
            await engine.swap_weights(update, version)
        return version

    async def close(self) -> None:
        """Stop the trainer and the engine's worker thread. Idempotent."""
        trainer, self._trainer = self._trainer, None
        if trainer is not None:
            await asyncio.to_thread(trainer.close)
        engine, self._engine = self._engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)


def create(settings: Settings) -> LocalBackend:
    """Entry-point factory: `clawbridge.backend.load_backend("local", settings)` calls this."""
    return LocalBackend(settings)
