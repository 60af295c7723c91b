"""How many token positions the torch engine's KV pool holds, when the settings do not say.

Why (issue 32 §1): the pool's positions are committed as they are first written, and finished
requests keep theirs as reusable prefixes, so over a normal run the pool's high-water mark becomes
its whole budget. The budget is what the engine's memory grows to; it is chosen, like SGLang's
`--mem-fraction-static` and vLLM's `gpu_memory_utilization`, as a share of the memory that is free
once the weights are loaded, less what the trainer will take, and no larger than the configured
concurrency can use.

Invariants:
- `choose_budget` is a pure function of its inputs (tests pass the free memory in); `free_memory`
  is the only place that reads the machine.
- A budget always holds one request of the whole context window (else the engine's context window
  shrinks to it, as with an explicit `kv_budget_tokens`), and never more than `max_running`
  requests of `PER_REQUEST` positions each (or of the context window, if smaller).
- `KVBudget.reason` says which bound chose the figure, in words a user can act on; `clawbridge
  status` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

PER_REQUEST = 2048
"""Positions per running request that the automatic budget provides for (prompt + completion; a
longer request still runs, with fewer beside it)."""

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class KVBudget:
    """The KV pool's size and why."""

    tokens: int
    dtype: torch.dtype
    bytes_per_token: int
    reason: str
    """Which bound chose `tokens` (a sentence for `clawbridge status`)."""

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def describe(self) -> str:
        """`KV budget N positions (X MiB, bf16): <reason>`."""
        return (f"KV budget {self.tokens:,} positions ({self.bytes / MIB:,.0f} MiB, {dtype_name(self.dtype)}): "
                f"{self.reason}")


def resolve_kv_dtype(setting: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`kv_dtype`: auto is bfloat16 for a float32 model on the CPU, else the model's dtype."""
    if setting == "auto":
        return torch.bfloat16 if model_dtype == torch.float32 and device.type == "cpu" else model_dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[setting]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def choose_budget(*, context_window: int, max_running: int, bytes_per_token: int, dtype: torch.dtype,
                  fraction: float, free_bytes: int | None, trainer_bytes: int, explicit: int = 0) -> KVBudget:
    """The pool's budget: `explicit` when > 0; else `fraction` of (`free_bytes` - `trainer_bytes`),
    between one whole context window and `max_running` requests of `PER_REQUEST` positions.
    `free_bytes` None: the free memory is not known (the ceiling then decides)."""
    if explicit > 0:
        return KVBudget(explicit, dtype, bytes_per_token, "kv_budget_tokens as configured")
    ceiling = max(context_window, max_running * min(context_window, PER_REQUEST))
    ceiling_says = (f"max_running_requests {max_running} x {min(context_window, PER_REQUEST):,} positions"
                    if ceiling > context_window else f"one request of the whole {context_window:,}-token context")
    if free_bytes is None:
        return KVBudget(ceiling, dtype, bytes_per_token, f"{ceiling_says} (free memory not known)")
    room = max(0, free_bytes - trainer_bytes)
    share = int(fraction * room) // bytes_per_token
    memory_says = (f"{fraction:.0%} of the {room / GIB:.1f} GiB free after weights and trainer "
                   f"({free_bytes / GIB:.1f} GiB free, trainer {trainer_bytes / GIB:.2f} GiB)")
    if share >= ceiling:
        return KVBudget(ceiling, dtype, bytes_per_token,
                        f"{ceiling_says}; {memory_says} would allow {share:,}")
    if share >= context_window:
        return KVBudget(share, dtype, bytes_per_token, memory_says)
    return KVBudget(context_window, dtype, bytes_per_token,
                    f"one request of the whole {context_window:,}-token context, more than {memory_says} "
                    f"({share:,} positions): set kv_budget_tokens, or a smaller context, to use less")


@dataclass(frozen=True)
class MemoryShare:
    """The automatic budget's rule (`choose_budget` with the machine's free memory, read when the
    engine starts, after its weights are loaded): `fraction` of what is free less the trainer's
    estimate (`trainer_estimate`) for these training settings."""

    fraction: float
    training: bool = False
    lora: bool = True
    trainer_in_process: bool = True

    def __call__(self, model: torch.nn.Module, context_window: int, max_running: int, bytes_per_token: int,
                 dtype: torch.dtype) -> KVBudget:
        device = next(model.parameters()).device
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        return choose_budget(context_window=context_window, max_running=max_running, bytes_per_token=bytes_per_token,
                             dtype=dtype, fraction=self.fraction, free_bytes=free_memory(device),
                             trainer_bytes=trainer_estimate(weights, self.lora, self.trainer_in_process, self.training))


def free_memory(device: torch.device) -> int | None:
    """Bytes free for the pool on `device` now: CUDA's free memory; on the CPU the memory the OS
    can give without swapping (`MemAvailable`), or less under a cgroup memory limit. None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except (ImportError, OSError):
        return None
    limit = _cgroup_room()
    return available if limit is None else min(available, limit)


def _cgroup_room() -> int | None:
    """cgroup v2: memory.max - memory.current of this process's group; None without a limit."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        group = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((group / "memory.current").read_text()))
    except (OSError, IndexError, ValueError):
        return None


def trainer_estimate(weight_bytes: int, lora: bool, in_process: bool, training: bool) -> int:
    """What the trainer will take beside the engine, roughly: nothing without training; LoRA over
    the engine's own base (in process): one more weights' worth (activations, the adapter and its
    optimizer state, the loss's logits chunks); LoRA in its own process: a base copy as well; full
    fine-tuning: four weights' worth (a copy, its gradients and Adam's two moments)."""
    if not training:
        return 0
    if lora:
        return weight_bytes * (1 if in_process else 2)
    return 4 * weight_bytes
