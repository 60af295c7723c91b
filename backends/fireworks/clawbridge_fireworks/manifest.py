"""The Fireworks backend's manifest: what clawbridge created, and which snapshot is which version.

Invariants:
- Written atomically (temp file in the same folder, fsync, `os.replace`), so a crash leaves the
  previous manifest or the new one, never a torn file. Mode 0600.
- `versions` maps every published policy version (an int, strictly increasing) to the hot-load
  snapshot identity the deployment served for it; version 0 is the base model (no snapshot).
- `created_trainer_job` / `created_deployment` name only resources clawbridge created; resources
  the user named are never recorded there, so shutdown never deletes them.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_NAME = "fireworks_manifest.json"


@dataclass
class CheckpointRecord:
    """One `save_state` checkpoint."""

    name: str
    path: str
    """What the trainer returned; `load_state_with_optimizer` takes it."""
    step: int
    version: int


@dataclass
class Manifest:
    """Persistent state of the Fireworks backend (see module invariants)."""

    base_model: str = ""
    trainer_job_id: str = ""
    deployment_id: str = ""
    created_trainer_job: str = ""
    """Trainer job id clawbridge created (empty when reused)."""
    created_deployment: str = ""
    """Deployment id clawbridge created (empty when reused)."""
    version: int = 0
    """The latest published policy version."""
    step: int = 0
    """Optimizer steps taken."""
    versions: dict[int, str] = field(default_factory=dict)
    """Policy version -> hot-load snapshot identity."""
    checkpoints: list[CheckpointRecord] = field(default_factory=list)

    @staticmethod
    def path_in(state_dir: Path) -> Path:
        return state_dir / MANIFEST_NAME

    @classmethod
    def load(cls, path: Path) -> Manifest:
        """Read the manifest, or an empty one when the file does not exist."""
        if not path.exists():
            return cls()
        raw: dict[str, Any] = json.loads(path.read_text())
        return cls(
            base_model=raw.get("base_model", ""),
            trainer_job_id=raw.get("trainer_job_id", ""),
            deployment_id=raw.get("deployment_id", ""),
            created_trainer_job=raw.get("created_trainer_job", ""),
            created_deployment=raw.get("created_deployment", ""),
            version=int(raw.get("version", 0)),
            step=int(raw.get("step", 0)),
            versions={int(k): str(v) for k, v in raw.get("versions", {}).items()},
            checkpoints=[CheckpointRecord(**c) for c in raw.get("checkpoints", [])],
        )

    def save(self, path: Path) -> None:
        """Write atomically (see module invariants)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        data["versions"] = {str(k): v for k, v in sorted(self.versions.items())}
        fd, tmp = tempfile.mkstemp(prefix=".manifest-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def latest_checkpoint(self) -> CheckpointRecord | None:
        return self.checkpoints[-1] if self.checkpoints else None
