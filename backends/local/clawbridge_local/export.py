"""`clawbridge export-weights DIR` for the local backend: the policy of a checkpoint as a folder
other servers load.

The checkpoint (default: the newest committed version's, the one `clawbridge up` restores, as the
store records it; see `clawbridge checkpoints list`) is loaded into the trainer in this process and written by the trainer's
own export (`FsdpTrainerClient.export_weights`), so the files are the ones publishing makes:
- full fine-tuning: a transformers folder (config, safetensors, tokenizer files);
- LoRA, `adapter=True`: a peft adapter folder (`PeftModel.from_pretrained(base, DIR)`);
- LoRA, default: merged into the base weights (W + alpha/r · B·A, `merge_lora`, in float32 then
  the base dtype), written as a transformers folder with the base's config and tokenizer files.

Invariant: DIR is written atomically (a temporary sibling renamed into place) and never
half-written; an existing non-empty DIR is refused rather than overwritten.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from clawbridge.config import Settings
from clawbridge_local.trainer.client import FsdpTrainerClient
from clawbridge_local.trainer.model import TOKENIZER_FILES
from clawbridge_local.training import (
    CHECKPOINT_STATE,
    load_safetensors_dir,
    merge_lora,
    resolve_model_folder,
    trainer_config,
)


class ExportError(RuntimeError):
    """Nothing to export, or the output folder is in the way."""


@dataclass(frozen=True)
class Exported:
    path: Path
    kind: str
    """'full', 'merged' (LoRA merged into the base) or 'adapter'."""
    policy_version: int
    checkpoint: Path


def latest_checkpoint(settings: Settings) -> Path | None:
    """The newest committed version's checkpoint (`clawbridge.store.versions`), if any."""
    from clawbridge.store import DB_FILENAME, Store
    from clawbridge.store.versions import VersionStore

    if not (settings.state_path / DB_FILENAME).is_file():
        return None
    store = Store.open(settings.state_path)
    try:
        last = VersionStore(store).last_committed()
    finally:
        store.close()
    return Path(last.checkpoint) if last is not None and last.checkpoint else None


def export_weights(settings: Settings, out: Path, checkpoint: Path | None = None, adapter: bool = False) -> Exported:
    """Write the checkpoint's policy to `out` (see the module docstring)."""
    ckpt = checkpoint or latest_checkpoint(settings)
    if ckpt is None:
        raise ExportError(f"no checkpoint committed in {settings.state_path}; the server saves one with "
                          "every training step (see `clawbridge checkpoints list`)")
    if not (ckpt / CHECKPOINT_STATE).is_file():
        raise ExportError(f"{ckpt} is not a checkpoint (no {CHECKPOINT_STATE})")
    state = json.loads((ckpt / CHECKPOINT_STATE).read_text())
    if adapter and not state["lora"]:
        raise ExportError(f"{ckpt} is a full fine-tuning checkpoint; there is no adapter to export (drop --adapter)")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; choose a new folder")
    model_dir = resolve_model_folder(settings.model)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        work = Path(tmp)
        client = FsdpTrainerClient(trainer_config(settings, str(model_dir)), work / "trainer")
        client.start(1)
        try:
            info = client.restore_checkpoint(ckpt)
            written = client.export_weights(work, "export")
        finally:
            client.close()
        kind = "full"
        if state["lora"] and not adapter:
            kind = "merged"
            written = _merged_folder(model_dir, written, work / "merged")
        elif state["lora"]:
            kind = "adapter"
        if out.exists():
            out.rmdir()
        written.rename(out)
    return Exported(out, kind, info.policy_version, ckpt)


def _merged_folder(model_dir: Path, adapter_dir: Path, dest: Path) -> Path:
    """The base model folder with the adapter merged into its weights."""
    from safetensors.torch import save_file

    base = load_safetensors_dir(model_dir)
    base.update(merge_lora(adapter_dir, base))
    dest.mkdir()
    for name in ("config.json", "generation_config.json", *TOKENIZER_FILES):
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, dest / name)
    save_file({k: v.contiguous() for k, v in base.items()}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest
