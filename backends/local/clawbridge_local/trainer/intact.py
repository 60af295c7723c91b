"""Whether a trainer checkpoint folder is whole: read before a restore loads anything from it.

A checkpoint (`step.TrainerCore.save_checkpoint`) is `model.safetensors` (trainable weights),
`optimizer.pt` (torch's zip format) and `trainer_state.json`, written to a hidden folder, flushed
and renamed into place (`clawbridge.runtime.durable.replace_dir`). A folder written before that flush
existed, or damaged since, may hold a file cut short: a power loss before the data reached the
disk leaves the names but not all the bytes.

Invariant: `check_intact` raises `clawbridge.backend.CheckpointDamaged` naming the first problem
when a file is missing, `trainer_state.json` is not a JSON object, the safetensors file is not
exactly as long as its header says, or the optimizer file has no readable zip directory (which
sits at the end, so a truncated file has none). It reads the headers only, never the tensors.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

from clawbridge.backend import CheckpointDamaged

STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"


def check_intact(path: Path) -> None:
    """`CheckpointDamaged` unless the checkpoint folder `path` is whole (module invariant)."""
    for name in (STATE_FILE, WEIGHTS_FILE, OPTIMIZER_FILE):
        if not (path / name).is_file():
            raise CheckpointDamaged(f"checkpoint {path} is damaged: {name} is missing")
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointDamaged(f"checkpoint {path} is damaged: {STATE_FILE} cannot be read ({exc})") from None
    if not isinstance(state, dict) or not {"step", "policy_version", "lora"} <= set(state):
        raise CheckpointDamaged(f"checkpoint {path} is damaged: {STATE_FILE} lacks step, policy_version or lora")
    problem = _safetensors_problem(path / WEIGHTS_FILE)
    if problem is not None:
        raise CheckpointDamaged(f"checkpoint {path} is damaged: {WEIGHTS_FILE} {problem}")
    try:
        with zipfile.ZipFile(path / OPTIMIZER_FILE) as z:
            if not z.namelist():
                raise zipfile.BadZipFile("no entries")
    except (OSError, zipfile.BadZipFile) as exc:
        raise CheckpointDamaged(f"checkpoint {path} is damaged: {OPTIMIZER_FILE} is not a whole file ({exc})") from None


def _safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file's length (None: it is as long as its header says)."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is {size} bytes, shorter than its header"
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            return f"is {size} bytes, shorter than its {n}-byte header"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "has a header that is not JSON"
    if not isinstance(header, dict):
        return "has a header that is not a JSON object"
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        return f"is {size} bytes; its header says {expected}"
    return None
