"""One rank's trainer: the step code shared by the in-process mode and every torchrun rank.

Invariants:
- `TrainerCore` is used identically with `distributed=False` (plain module, world size 1) and
  `distributed=True` (FSDP2, one per rank); only the wrapping differs, so the two produce the
  same step to float tolerance.
- A train step = zero grads; for each micro-batch: forward, token-sum loss, backward (FSDP
  reduces gradients with SUM, only after the last micro-batch); clip global grad norm; AdamW
  step. Metrics are all-reduced sums, identical on every rank.
- A step waits for the device once, at its end (the metrics; under FSDP on CUDA once more, when
  the ranks agree on activation checkpointing): loss sums, the gradient norm and the clipping stay
  on the device until then (issue 36: per-micro-batch `.item()`s and a host-side
  clip decision each stalled the GPU's queue).
- Activation checkpointing `auto` decides per step (`_recompute`): on CUDA it keeps activations
  when the largest micro-batch's estimate (`model.activation_bytes`) fits half the free memory (on
  every rank: the ranks agree), and an in-process step that runs out of memory keeping them runs
  again recomputing (nothing was applied: the optimizer had not stepped); on CPU it recomputes.
  Gradients are the same either way.
- Collective methods (`train_step`, `export`, `save_checkpoint`, `restore_checkpoint`) must be
  called on every rank in the same order with the same arguments. Only rank 0 writes files.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from clawbridge.backend import Datum, LossConfig
from clawbridge.runtime.durable import replace_dir
from clawbridge.runtime.faults import fault_point_sync
from clawbridge_local.losses import SUM_KEYS, LossInputs, LossSums, compute_loss, finalize_metrics
from clawbridge_local.trainer import model as model_io
from clawbridge_local.trainer.batch import Collated, collate, micro_batches, validate_datum
from clawbridge_local.trainer.config import TrainerConfig
from clawbridge_local.trainer.intact import OPTIMIZER_FILE, STATE_FILE, WEIGHTS_FILE
from clawbridge_local.trainer.logprobs import available_bytes, token_logprobs


def resolve_device(config: TrainerConfig, local_rank: int) -> torch.device:
    """`auto`: this rank's GPU when CUDA is available, else CPU."""
    if config.device == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(config.device)


class TrainerCore:
    """Model + optimizer + step counter of one rank."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        distributed: bool = False,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
        base: nn.Module | None = None,
    ) -> None:
        """`base`: in-process LoRA, the served model whose tensors are the frozen base (`model.build_model`)."""
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.distributed = distributed
        """True under torchrun: FSDP2-wrapped, collectives on every call."""
        self.device = resolve_device(config, local_rank)
        self.bf16 = model_io.use_bf16(config, self.device)
        self.model = model_io.build_model(config, self.device, base)
        self._checkpointed = model_io.checkpointed_layers(self.model)
        """The layers whose recompute `_recompute` turns on and off (empty: checkpointing off)."""
        self._keep_failed = False
        """`auto` ran out of memory keeping activations once: recompute from then on."""
        self._place(self.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=config.learning_rate,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
            fused=True if self.device.type == "cuda" and not distributed else None,  # one kernel per step
        )
        self.step = 0
        """Optimizer steps taken (restored from checkpoints)."""
        self._reference: nn.Module | None = None

    def _place(self, module: nn.Module) -> None:
        if self.distributed:
            model_io.shard_model(module, self.bf16)
            module.to(self.device)
        else:
            module.to(self.device)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        # FSDP's MixedPrecisionPolicy does the casting when distributed; plain modules use autocast.
        if self.bf16 and not self.distributed:
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _reference_logprobs(self, c: Collated) -> torch.Tensor:
        """Base-policy logprobs: LoRA disabled, or a frozen copy of the base for full fine-tuning."""
        with torch.no_grad(), self._autocast():
            if self.config.lora is not None:
                peft_model: Any = self.model
                # peft's disable_adapter() turns requires_grad off on the adapters and back on when it
                # exits, but under FSDP2 it left a tied lm_head's adapter frozen: that adapter stopped
                # training after the first KL step and fell out of every checkpoint. Restore it here.
                trainable = [p for p in self.model.parameters() if p.requires_grad]
                try:
                    with peft_model.disable_adapter():
                        return token_logprobs(self.model, c)
                finally:
                    for p in trainable:
                        p.requires_grad_(True)
            if self._reference is None:
                self._reference = model_io.build_reference(self.config)
                self._place(self._reference)
            return token_logprobs(self._reference, c)

    def _set_grad_sync(self, enabled: bool) -> None:
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(enabled)

    def _grad_norm_and_clip(self) -> torch.Tensor:
        """Global L2 norm of the gradients (a float64 device scalar: per-tensor norms, their squares
        summed in float64, over all shards); scale them to max_grad_norm. Nothing waits for the
        device: the scale is min(1, max / (norm + 1e-6)), a multiplication by exactly 1 below it."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if local:
            # CPU: float64 per tensor, as torch.linalg.vector_norm(dtype=float64) (the tests compare world
            # sizes to 1e-5); CUDA: the fused fp32 norms (one kernel, not one per tensor), then float64.
            wide = torch.float64 if self.device.type != "cuda" else None
            sq = torch.stack(torch._foreach_norm(local, 2.0, dtype=wide)).to(torch.float64).square().sum()
        if self.distributed:
            dist.all_reduce(sq)  # FSDP shards are disjoint: the squares add up
        norm = sq.sqrt()
        if self.config.max_grad_norm > 0 and local:
            coef = (self.config.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            with torch.no_grad():  # views of the (sharded) .grad tensors
                torch._foreach_mul_(local, coef.to(local[0].dtype))
        return norm

    def _all_reduce_sums(self, totals: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(totals)
        return totals

    def _recompute(self, micros: Sequence[Sequence[Datum]]) -> bool:
        """Whether this step's forwards recompute activations (see invariants); sets the layers.
        `auto` keeps them where the device reports free memory (CUDA; `available_bytes` is 0 on
        CPU) and the largest micro-batch's estimate fits half of it."""
        if not self._checkpointed:
            return False
        on = True
        if self.config.activation_checkpointing == "auto" and not self._keep_failed:
            free = available_bytes(self.device)
            tokens = max((len(m) * max(len(d.tokens) - 1 for d in m) for m in micros if m), default=1)
            on = free == 0 or model_io.activation_bytes(self.model, tokens) > free // 2
            if self.distributed and free > 0:  # every rank the same (a recompute runs FSDP's collectives again)
                flag = torch.tensor([int(on)], device=self.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                on = bool(flag.item())
        model_io.set_checkpointing(self._checkpointed, on)
        return on

    def _fault_pause(self) -> None:
        """Fault injection for tests: inside a step, wait while `extra["pause_while_exists"]` exists."""
        marker = self.config.extra.get("pause_while_exists")
        deadline = time.monotonic() + 120.0
        while marker and os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)

    def train_step(self, batch: Sequence[Datum], loss: LossConfig) -> dict[str, float]:
        """Forward/backward over this rank's shard of `batch` and one optimizer step."""
        t0 = time.perf_counter()
        for d in batch:
            validate_datum(d)
        self._fault_pause()
        micros = micro_batches(batch, self.rank, self.world_size, self.config.micro_batch_size)
        recompute = self._recompute(micros)
        try:
            totals = self._forward_backward(micros, loss)
        except torch.OutOfMemoryError:
            if recompute or self.config.activation_checkpointing != "auto" or self.distributed:
                raise
            # Keeping activations did not fit after all: nothing was applied yet, so run it again recomputing.
            self._keep_failed = True
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            recompute = self._recompute(micros)
            totals = self._forward_backward(micros, loss)
        grad_norm = self._grad_norm_and_clip()
        learning_rate = self.config.learning_rate * loss.lr_scale  # this step's rate (LossConfig.lr_scale)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        totals = self._all_reduce_sums(totals)
        values = torch.cat([totals, grad_norm.reshape(1)]).tolist()  # the step's one wait for the device
        metrics = finalize_metrics(LossSums.from_tensor(torch.tensor(values[:-1], dtype=torch.float64)))
        metrics.update(
            grad_norm=values[-1],
            step=float(self.step),
            learning_rate=learning_rate,
            datums=float(len(batch)),
            micro_batches=float(len(micros)),
            world_size=float(self.world_size),
            activation_checkpointing=float(recompute),
            step_seconds=time.perf_counter() - t0,
        )
        return metrics

    def _forward_backward(self, micros: Sequence[Sequence[Datum]], loss: LossConfig) -> torch.Tensor:
        """Zero the gradients, then forward + backward every micro-batch; the loss totals (device)."""
        self.optimizer.zero_grad(set_to_none=True)
        totals = torch.zeros(len(SUM_KEYS), dtype=torch.float64, device=self.device)
        for k, micro in enumerate(micros):
            self._set_grad_sync(k == len(micros) - 1)
            c = collate(micro).to(self.device)
            ref = self._reference_logprobs(c) if loss.kl_coef > 0 else None
            with self._autocast():
                logp = token_logprobs(self.model, c)
            out = compute_loss(loss, LossInputs(logp, c.sampler_logprobs, c.advantages, c.mask, ref))
            out.loss.backward()
            totals += out.totals
        return totals

    def export(self, out_dir: Path, name: str) -> Path:
        """Write weights (full: HF folder; LoRA: peft adapter) to `out_dir/name` atomically."""
        sd = model_io.trainable_state_dict(self.model)
        final = out_dir / name
        if self.rank == 0:
            with _tmp_dir(out_dir, name) as tmp:
                if self.config.lora is not None:
                    model_io.write_lora_export(self.model, sd, tmp)
                else:
                    model_io.write_full_export(self.model, sd, self.config, tmp)
                replace_dir(tmp, final)
        return final

    def save_checkpoint(self, path: Path, policy_version: int) -> Path:
        """Trainable weights + full optimizer state + step + policy version, atomically."""
        from safetensors.torch import save_file

        sd = model_io.trainable_state_dict(self.model)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        osd = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        if self.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _tmp_dir(path.parent, path.name) as tmp:
                save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp / WEIGHTS_FILE))
                fault_point_sync("checkpoint.mid")
                torch.save(osd, tmp / OPTIMIZER_FILE)
                state = {
                    "step": self.step,
                    "policy_version": policy_version,
                    "lora": self.config.lora is not None,
                }
                (tmp / STATE_FILE).write_text(json.dumps(state))
                replace_dir(tmp, path)
        return path

    def restore_checkpoint(self, path: Path) -> dict[str, int]:
        """Load what `save_checkpoint` wrote (by any world size); returns step and policy version."""
        from safetensors.torch import load_file

        state = json.loads((path / STATE_FILE).read_text())
        if bool(state["lora"]) != (self.config.lora is not None):
            raise ValueError(f"checkpoint {path} is {'LoRA' if state['lora'] else 'full'}; trainer is not")
        sd = load_file(str(path / WEIGHTS_FILE))
        expected = {n for n, p in self.model.named_parameters() if p.requires_grad}
        if set(sd) != expected:
            missing, extra = sorted(expected - set(sd))[:3], sorted(set(sd) - expected)[:3]
            raise ValueError(
                f"checkpoint {path} does not match the model (missing {missing}, unexpected {extra})"
            )
        loaded: dict[str, Any] = dict(sd)
        set_model_state_dict(self.model, loaded, options=StateDictOptions(full_state_dict=True, strict=False))
        osd = torch.load(path / OPTIMIZER_FILE, weights_only=True)
        set_optimizer_state_dict(
            self.model, self.optimizer, osd, options=StateDictOptions(full_state_dict=True)
        )
        self.step = int(state["step"])
        return {"step": self.step, "policy_version": int(state["policy_version"])}


@contextlib.contextmanager
def _tmp_dir(parent: Path, name: str) -> Iterator[Path]:
    """A fresh hidden sibling directory; removed if the block fails before renaming it."""
    import shutil

    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
