"""The checkpoint manifest: which `tinker://` states exist and where training resumes from.

Invariants:
- The file is replaced atomically (write a temp file in the same folder, fsync, `os.replace`),
  so a crash leaves either the old or the new manifest, never a torn one.
- `latest` is the state `clawbridge up` resumes from; its `step` and `policy_version` are the
  counters restored with it.
- Only `tinker://` paths are recorded: the weights themselves live in Tinker's storage.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST_FORMAT = 1


@dataclass(frozen=True)
class CheckpointEntry:
    """One saved training state (weights + optimizer)."""

    name: str
    """The name given to `save_state`."""
    path: str
    """The `tinker://.../weights/...` path Tinker returned."""
    step: int
    """Training steps completed when it was saved."""
    policy_version: int
    """The policy version served when it was saved."""
    saved_at: float
    """Unix time of the save."""
    sampler_path: str | None = None
    """The `tinker://.../sampler_weights/...` path of the same weights saved for sampling, which
    `NAME@N` samples from (`TinkerBackend.load_version`); None in manifests written before it."""


@dataclass
class Manifest:
    """Everything needed to resume a Tinker training run."""

    base_model: str
    lora_rank: int
    checkpoints: list[CheckpointEntry] = field(default_factory=list)
    format: int = MANIFEST_FORMAT

    @property
    def latest(self) -> CheckpointEntry | None:
        """The newest checkpoint, or None before the first save."""
        return self.checkpoints[-1] if self.checkpoints else None

    def find(self, path: str) -> CheckpointEntry | None:
        """The entry saved at `path` (newest first)."""
        for entry in reversed(self.checkpoints):
            if entry.path == path:
                return entry
        return None


def manifest_path(state_dir: Path) -> Path:
    """Where the Tinker manifest lives inside clawbridge's state dir."""
    return state_dir / "tinker" / "manifest.json"


def load_manifest(path: Path) -> Manifest | None:
    """Read a manifest, or None when there is none yet."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    if raw.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: unsupported manifest format {raw.get('format')!r}")
    return Manifest(
        base_model=raw["base_model"],
        lora_rank=int(raw["lora_rank"]),
        checkpoints=[CheckpointEntry(**c) for c in raw.get("checkpoints", [])],
    )


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Atomically replace `path` with `manifest`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(
        {
            "format": manifest.format,
            "base_model": manifest.base_model,
            "lora_rank": manifest.lora_rank,
            "checkpoints": [asdict(c) for c in manifest.checkpoints],
        },
        indent=2,
    )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
