"""Configuration of the FSDP/LoRA trainer, shared verbatim by the client and every worker rank.

Invariants:
- A `TrainerConfig` round-trips through JSON (`to_json`/`from_json`); the client writes it once
  into the run directory and every rank reads the same file, so all ranks build the same model,
  optimizer and micro-batch schedule.
- `lora is None` means full fine-tuning; otherwise only the LoRA parameters train and exports are
  peft adapter folders.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Precision = Literal["auto", "fp32", "bf16"]
Checkpointing = bool | Literal["auto"]


@dataclass(frozen=True)
class LoraSettings:
    """LoRA through peft."""

    rank: int = 16
    """LoRA rank r."""
    alpha: float = 32.0
    """LoRA alpha (scaling = alpha / rank); a float, never rounded (16.5 stays 16.5)."""
    dropout: float = 0.0
    """LoRA dropout; keep 0 for exact trainer/sampler logprob agreement."""
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "lm_head",
    )
    """Module names LoRA wraps (peft `target_modules`); as Tinker: attention, MLP, unembedding."""


@dataclass(frozen=True)
class TrainerConfig:
    """Everything a trainer rank needs to build itself."""

    model_path: str
    """Local folder with a transformers causal LM (config + safetensors). Never downloaded."""
    lora: LoraSettings | None = None
    """None: full fine-tuning. Otherwise LoRA settings."""
    learning_rate: float = 1e-5
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 or less: no clipping; the norm is still reported)."""
    micro_batch_size: int = 8
    """Datums per forward/backward on one rank; larger batches are accumulated."""
    activation_checkpointing: Checkpointing = "auto"
    """Recompute each decoder layer's activations in the backward pass instead of keeping them.
    auto: on CUDA, keep them when a micro-batch's estimated activations fit half the free GPU
    memory (and recompute after an out-of-memory error); on CPU, recompute (the in-process trainer
    shares the proxy's memory: docs/engine-memory.md)."""
    precision: Precision = "auto"
    """auto: bf16 mixed precision on GPU, fp32 on CPU. Master weights and optimizer stay fp32."""
    device: str = "auto"
    """auto: cuda (rank's local device) when available, else cpu."""
    seed: int = 0
    cpu_threads: int = 0
    """torch CPU threads of each torchrun rank (0: OMP_NUM_THREADS if set, else cores // world size).
    The in-process trainer shares the proxy's setting."""
    """Seed for any randomness in model setup (LoRA init)."""
    step_timeout_s: float = 3600.0
    """Client side: a request without a response after this long kills the group."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form knobs for tests (`pause_while_exists`: a path; train steps pause while it exists)."""

    def to_json(self) -> str:
        """Serialize to JSON."""
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> TrainerConfig:
        """Inverse of `to_json`."""
        raw = json.loads(text)
        lora = raw.pop("lora", None)
        raw["betas"] = tuple(raw["betas"])
        if lora is not None:
            lora["target_modules"] = tuple(lora["target_modules"])
            raw["lora"] = LoraSettings(**lora)
        return TrainerConfig(**raw)
