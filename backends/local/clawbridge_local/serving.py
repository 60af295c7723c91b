"""`ServingEngine`: what `LocalBackend` needs of the engine that serves (torch or SGLang).

Invariants:
- An engine is a `clawbridge.serving.sampler.Sampler` with a `context_window`.
- `publish(weights, version)` makes the trainer's current weights the ones new streams sample
  from, labelled `version`, and returns the version served; streams already running finish on the
  weights they started with. Each engine takes the weights in the form it loads: the in-process
  torch engine swaps tensors or adds an adapter (`WeightSource.weight_update`), SGLang loads an exported folder
  (`WeightSource.export`: an adapter or full weights).
- `aclose()` stops the engine and frees what it holds; idempotent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from clawbridge.serving.sampler import Sampler
from clawbridge_local.lora_serving import LoraAdapter


class WeightSource(Protocol):
    """The trained weights, in either form an engine loads (`LocalTrainer` is one)."""

    def weight_update(self) -> dict[str, Any] | LoraAdapter:
        """The weights as tensors by parameter name, or a LoRA adapter to serve unmerged (blocking;
        call it off the event loop)."""
        ...

    def export(self) -> Path:
        """The weights written to a folder (LoRA adapter or full model; blocking)."""
        ...


@runtime_checkable
class ServingEngine(Sampler, Protocol):
    """A Sampler that `LocalBackend` can publish trained weights into (module invariants)."""

    context_window: int
    """Prompt + completion tokens the engine can hold."""

    async def publish(self, weights: WeightSource, version: int) -> int:
        """Serve `weights`' current weights as `version`; returns the version served."""
        ...

    async def aclose(self) -> None:
        """Stop the engine (idempotent)."""
        ...
