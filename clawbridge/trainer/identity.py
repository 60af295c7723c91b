"""What a checkpoint belongs to: backend, base model (name and content hash), LoRA config.

Invariants:
- The model hash covers the folder's `config.json` and its weights index: the
  `*.safetensors.index.json` when there is one, else each safetensors file's header (names,
  shapes, dtypes, offsets); files up to `FULL_HASH_LIMIT` bytes are hashed whole, so two small
  models that differ only in their values differ too. A hub id or hosted model name has no local
  files: its name is its identity.
- The same settings on the same files give the same identity on any machine (paths are not part
  of it: moving the model folder is not a different model).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clawbridge.plugins import trained_model

if TYPE_CHECKING:
    from clawbridge.config import Settings

FULL_HASH_LIMIT = 64 * 1024 * 1024
"""Safetensors files up to this size are hashed whole."""

_FIELDS = ("backend", "model", "model_hash", "lora_rank", "lora_alpha", "lora_target_modules")


class CheckpointMismatch(RuntimeError):
    """The state dir's checkpoints belong to another model, LoRA config or backend."""


def model_hash(folder: Path) -> str:
    """sha256 over config.json and the weights index (see the module invariants)."""
    h = hashlib.sha256()
    config = folder / "config.json"
    if config.is_file():
        h.update(b"config\0" + config.read_bytes())
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    for index in indexes:
        h.update(b"index\0" + index.read_bytes())
    if not indexes:
        for f in sorted(folder.glob("*.safetensors")):
            h.update(f.name.encode() + b"\0")
            h.update(_file_digest(f) if f.stat().st_size <= FULL_HASH_LIMIT else _safetensors_header(f))
    return h.hexdigest()


def _file_digest(path: Path) -> bytes:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").digest()


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return fh.read(min(n, 100 * 1024 * 1024))


def checkpoint_identity(settings: Settings, backend: str) -> dict[str, Any]:
    """The identity recorded with every checkpoint trained under these settings."""
    model = trained_model(settings, backend)
    folder = Path(model).expanduser()
    local = folder.is_dir()
    lora = settings.lora_rank > 0
    return {
        "backend": backend,
        "model": folder.name if local else model,
        "model_hash": model_hash(folder) if local else None,
        "lora_rank": settings.lora_rank,
        "lora_alpha": settings.lora_alpha if lora else None,
        "lora_target_modules": sorted(settings.lora_target_modules) if lora and backend == "local" else None,
    }


def describe_mismatch(recorded: dict[str, Any], current: dict[str, Any]) -> str:
    """'' when they match, else a message saying what differs and how to start fresh."""
    diffs = [
        f"{k}: checkpoints have {recorded.get(k)!r}, this start has {current.get(k)!r}"
        for k in _FIELDS
        if recorded.get(k) != current.get(k)
    ]
    if not diffs:
        return ""
    return (
        "the state dir's checkpoints belong to another training setup; refusing to load them onto this one ("
        + "; ".join(diffs)
        + "). Start with the settings they were trained with, or start fresh with another --state-dir "
        "(recorded sessions stay in the old one)."
    )

