"""BASELINE for bench/engine_memory.py: LoRA published as merged full weights, as the torch engine
took it before adapters were served unmerged (not used by clawbridge).

`merged_update(trainer)` is what `LocalTrainer.weight_update` returned then: the trainer's export
merged into the base weights (W + (alpha/r)·B·A in float32, `clawbridge_local.training.merge_lora`),
each base matrix read from the model folder when needed (`LazyTensors`), never a second copy kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from clawbridge_local.training import LocalTrainer, load_safetensors_dir, merge_lora


class LazyTensors(Mapping[str, Any]):
    """The tensors of a folder's *.safetensors files, each read from disk when asked for and not
    kept: merging LoRA for the torch engine needs a few base matrices per publish, and holding a
    whole second fp32 copy of the base for it would double the resident weights."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self._file: dict[str, str] = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                self._file.update(dict.fromkeys(h.keys(), str(f)))

    def __getitem__(self, name: str) -> Any:
        from safetensors import safe_open

        with safe_open(self._file[name], framework="pt") as h:
            return h.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)


def merged_update(trainer: LocalTrainer) -> dict[str, Any]:
    """The trainer's current weights as full weights: LoRA merged into the base."""
    export = trainer.export()
    if not trainer.lora:
        return load_safetensors_dir(export)
    return merge_lora(export, LazyTensors(trainer.model_dir))
