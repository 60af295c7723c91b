"""The training half of the local backend: FSDP/LoRA steps, and publishing them to the torch engine.

Invariants:
- The trainer starts lazily (first step, or a checkpoint to restore): serving-only use pays nothing.
- Publishing hands the torch engine what it serves, under a new, strictly greater policy version:
  full weights as a state dict named like the served model's parameters; LoRA as the adapter itself
  (`clawbridge_local.lora_serving.LoraAdapter`), served unmerged beside the shared base weights,
  so a publish copies no model. Streams already running finish on the weights they started on.
  An in-process full fine-tuning trainer's state dict is a copy of its tensors made on their own
  device (`model.live_weights`), which the engine copies into its own in place: on a GPU nothing
  goes through the host or the disk (issue 36: the export and reload cost ~2.9 s for qwen3-0.6b).
  Otherwise (torchrun, LoRA) the trained weights are exported (a transformers folder, or a peft
  adapter) and read back.
- Checkpoints (weights or adapter + optimizer + step + policy version) go to
  `<state_dir>/checkpoints/local/<name>` (the trainer loop names them), written atomically by the
  trainer; the store records which one each committed version is. A write cut short by a kill
  leaves a hidden `.tmp-*` folder there; the next trainer removes them when it starts (one
  server per state dir, so nobody else is writing).
- Only the newest export is kept on disk.
- Every in-process trainer's steps, exports and checkpoint reads/writes run on one thread
  (`on_training_thread`), whatever backend or user lane calls them: glibc gives each thread that
  allocates its own malloc arena, and steps spread over the default executor's threads each grew
  a heap of their own.
"""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from clawbridge.backend import Datum, LossConfig, StepResult
from clawbridge.config import Settings
from clawbridge.runtime.durable import replace_dir
from clawbridge.store.users import USER_NAME_RE
from clawbridge_local.lora_serving import LoraAdapter
from clawbridge_local.settings import local_settings
from clawbridge_local.trainer.client import FsdpTrainerClient, Launcher, Nodes
from clawbridge_local.trainer.config import LoraSettings, TrainerConfig
from clawbridge_local.trainer.intact import STATE_FILE

CHECKPOINT_STATE = STATE_FILE
"""The file every complete checkpoint folder holds (written last, atomically)."""

T = TypeVar("T")
_TRAINING_THREAD_NAME = "clawbridge-train"
_TRAINING_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix=_TRAINING_THREAD_NAME)


async def on_training_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the one training thread (module invariants), awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_TRAINING_THREAD, functools.partial(fn, *args))


def on_training_thread_sync(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the one training thread (blocking; at once when called there): it runs
    between steps, never during one."""
    if threading.current_thread().name.startswith(_TRAINING_THREAD_NAME):
        return fn(*args)
    return _TRAINING_THREAD.submit(fn, *args).result()


def trainer_config(settings: Settings, model_path: str, cpu_threads: int = 0) -> TrainerConfig:
    """The FSDP trainer's configuration from clawbridge settings (and `[backends.local]`)."""
    options = local_settings(settings)
    lora = None
    if settings.lora_rank > 0:
        lora = LoraSettings(rank=settings.lora_rank, alpha=float(settings.lora_alpha),
                            target_modules=tuple(settings.lora_target_modules))
    return TrainerConfig(model_path=model_path, lora=lora, learning_rate=settings.effective_learning_rate,
                         max_grad_norm=options.max_grad_norm, micro_batch_size=options.micro_batch_size,
                         activation_checkpointing=options.activation_checkpointing, cpu_threads=cpu_threads)


def lane_dir(root: Path, lane: str) -> Path:
    """Where a lane's files go under `root`: `root` itself for the shared lane, else `root/users/<lane>`
    (a user name is letters, digits, `.`, `_`, `-`, never `..`: `clawbridge.store.users`)."""
    if not lane:
        return root
    if not USER_NAME_RE.match(lane):
        raise ValueError(f"not a user name: {lane!r}")
    return root / "users" / lane


def resolve_model_folder(model: str) -> Path:
    """A local folder for `model` (a folder, or an already-cached Hugging Face id)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, local_files_only=True))


def load_safetensors_dir(folder: Path) -> dict[str, Any]:
    """Every tensor in the folder's *.safetensors files."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _base_weight(base: Mapping[str, Any], module: str) -> Any:
    """The base weight of `module`; `lm_head` of a tied-embedding model is the input embedding."""
    name = f"{module}.weight"
    if name in base:
        return base[name]
    if module.rsplit(".", 1)[-1] == "lm_head":
        tied = [k for k in base if k.endswith("embed_tokens.weight")]
        if len(tied) == 1:
            return base[tied[0]]
    raise KeyError(f"adapter module {module!r} has no base weight {name!r}")


def adapter_scale(adapter_dir: Path) -> float:
    """The LoRA scale of a peft adapter folder: alpha / r (alpha / sqrt(r) with rslora)."""
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    r = float(cfg["r"])
    return float(cfg["lora_alpha"]) / (r**0.5 if cfg.get("use_rslora") else r)


def merge_lora(adapter_dir: Path, base: Mapping[str, Any]) -> dict[str, Any]:
    """Merged weights for every module the adapter touches: W + (alpha / r) * B @ A (float32;
    alpha / sqrt(r) with rslora). A merged `lm_head.weight` of a tied-embedding model is its own
    tensor: the engine unties it (`engine.untie_output_embeddings`) before loading it."""
    return merge_lora_tensors(load_safetensors_dir(adapter_dir), adapter_scale(adapter_dir), base, str(adapter_dir))


def merge_lora_tensors(tensors: dict[str, Any], scale: float, base: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`merge_lora` of LoRA matrices already loaded (an adapter's, or a checkpoint's peft names,
    `...lora_A.default.weight`); `where` names their source in errors."""
    merged: dict[str, Any] = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        w0 = _base_weight(base, module)
        merged[f"{module}.weight"] = (w0.float() + scale * (b.float() @ a.float())).to(w0.dtype)
    if not merged:
        raise ValueError(f"{where} has no LoRA weights")
    return merged


class LocalTrainer:
    """Owns the `FsdpTrainerClient` and makes engine weight updates from its exports. Blocking:
    async callers use `asyncio.to_thread`."""

    def __init__(self, settings: Settings, launcher: Launcher = "auto", cpu_threads: int = 0,
                 base_weights: Callable[[], Any] | None = None, lane: str = "") -> None:
        """`base_weights`: the served base model, shared with an in-process LoRA trainer. `lane`: a
        user's adapter (`clawbridge_local.user_lane`), whose files go under `users/<lane>/`."""
        self.settings = settings
        self.model_dir = resolve_model_folder(settings.model)
        self.work_dir = lane_dir(settings.state_path / "trainer" / "local", lane)
        self.checkpoint_dir = lane_dir(settings.state_path / "checkpoints" / "local", lane)
        options = local_settings(settings)
        self.world_size = options.train_world_size
        """Trainer processes (`[backends.local] train_world_size`), over all nodes."""
        nodes = Nodes(options.train_nnodes, options.train_master_addr, options.train_master_port)
        self.client = FsdpTrainerClient(trainer_config(settings, str(self.model_dir), cpu_threads), self.work_dir,
                                        launcher=launcher, nodes=nodes, base_weights=base_weights)
        for partial in self.checkpoint_dir.glob(".tmp-*"):  # left by a process killed mid-write
            shutil.rmtree(partial, ignore_errors=True)
        self._last_export: Path | None = None

    @property
    def lora(self) -> bool:
        return self.settings.lora_rank > 0

    def ensure_started(self) -> None:
        if self.client.alive:
            return
        self.client.start(self.world_size)

    def train_step(self, batch: Sequence[Datum], loss: LossConfig) -> StepResult:
        self.ensure_started()
        return self.client.train_step(batch, loss)

    def weight_update(self) -> dict[str, Any] | LoraAdapter:
        """The current trained weights for the torch engine: a state dict (in-process full
        fine-tuning: copies made on the trainer's device), or the LoRA adapter."""
        self.ensure_started()
        core = self.client.core
        if core is not None and not self.lora:
            from clawbridge_local.trainer.model import live_weights

            return on_training_thread_sync(live_weights, core.model)
        export = self.export()
        if self.lora:
            return LoraAdapter.from_peft(load_safetensors_dir(export), adapter_scale(export), str(export))
        return load_safetensors_dir(export)

    def export(self) -> Path:
        """Export the current trained weights for a server that loads folders (SGLang): a
        transformers folder, or a peft adapter folder for LoRA. The previous export is deleted."""
        self.ensure_started()
        export = self.client.export_weights(self.work_dir / "exports")
        if self._last_export is not None and self._last_export != export:
            shutil.rmtree(self._last_export, ignore_errors=True)
        self._last_export = export
        return export

    def checkpoint_update(self, checkpoint: Path) -> dict[str, Any] | LoraAdapter:
        """The served weights of a committed version for the torch engine, read from its
        checkpoint without touching the trainer: a state dict, or the LoRA adapter."""
        from safetensors.torch import load_file

        state = json.loads((checkpoint / CHECKPOINT_STATE).read_text())
        if bool(state["lora"]) != self.lora:
            raise ValueError(f"checkpoint {checkpoint} is {'LoRA' if state['lora'] else 'full'}; the served model is not")
        if not self.lora:
            tensors: dict[str, Any] = load_file(str(checkpoint / "model.safetensors"))
            return tensors
        s = self.settings
        return LoraAdapter.from_safetensors(checkpoint / "model.safetensors", float(s.lora_alpha) / s.lora_rank,
                                            str(checkpoint))

    def checkpoint_adapter(self, checkpoint: Path, out: Path) -> Path:
        """A peft adapter folder (what `export` writes for LoRA) at `out`, made from a LoRA
        checkpoint's tensors without touching the trainer (SGLang loads committed versions so)."""
        from safetensors.torch import load_file, save_file

        from clawbridge_local.trainer.model import lora_config

        cfg = trainer_config(self.settings, str(self.model_dir)).lora
        if cfg is None:
            raise ValueError("checkpoint_adapter needs LoRA (lora_rank > 0)")
        tensors = load_file(str(checkpoint / "model.safetensors"))
        adapter = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
                   for k, v in tensors.items() if ".lora_A." in k or ".lora_B." in k}
        if not adapter:
            raise ValueError(f"{checkpoint} has no LoRA weights")
        tmp = out.with_name(f".{out.name}.writing")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in adapter.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        lcfg = lora_config(cfg)
        lcfg.base_model_name_or_path = str(self.model_dir)
        lcfg.save_pretrained(str(tmp))
        replace_dir(tmp, out)  # SGLang never loads half a folder
        return out

    def save_checkpoint(self, name: str, policy_version: int) -> Path:
        self.ensure_started()  # the base checkpoint is saved before the first step
        return self.client.save_checkpoint(self.checkpoint_dir / name, policy_version)

    def restore_checkpoint(self, path: Path) -> int:
        self.ensure_started()
        return self.client.restore_checkpoint(path).policy_version

    def close(self) -> None:
        self.client.close()
