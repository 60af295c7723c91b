"""Building the trained model (full or LoRA), FSDP2 wrapping, and what is written to disk.

Invariants:
- Every rank builds the same model from `TrainerConfig.model_path` with the same seed, then
  `fully_shard` wraps each decoder layer and the root; gradients are SUM-reduced (divide factor
  1), matching the token-sum normalization in `clawbridge_local.losses`.
- Master weights are fp32; on GPU with precision bf16/auto, FSDP casts params to bf16 for compute
  and reduces gradients in fp32 (`MixedPrecisionPolicy`).
- State dicts leave the group as FULL tensors on CPU (`get_model_state_dict(full_state_dict=True,
  cpu_offload=True)`), with the same keys in 1-process and FSDP runs, so exports and checkpoints
  written by any world size load into any other. Only rank 0 writes; callers rename into place.
- Activations: with `activation_checkpointing` (the default) a decoder layer keeps only its input
  for the backward pass and recomputes the rest, so a step's memory grows with one layer's
  activations, not all of them; the gradients are the same.
- In-process LoRA beside the torch engine, the frozen base is the engine's tensors (`over_base`),
  never a second copy; the trained LoRA matrices are initialized exactly as over a loaded copy.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from clawbridge_local.trainer.config import LoraSettings, TrainerConfig

log = logging.getLogger("clawbridge.trainer")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
"""Files copied from the base folder into full exports so they are self-contained."""


def use_bf16(config: TrainerConfig, device: torch.device) -> bool:
    """Whether compute runs in bf16 (GPU only; CPU always fp32)."""
    return device.type == "cuda" and config.precision in ("auto", "bf16")


def build_model(config: TrainerConfig, device: torch.device, base: nn.Module | None = None) -> nn.Module:
    """Load the causal LM in fp32 on CPU, add LoRA if configured; not yet sharded or moved.

    `base`: LoRA only, the served model of the same folder (the in-process trainer beside the torch
    engine). Where its weights are fp32 on `device`, the trained model's frozen weights are its
    tensors (`over_base`): one copy of the base serves and trains, and none is loaded here."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(config.seed)
    model: Any = None
    if base is not None and config.lora is not None:
        model = over_base(config, base, device)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=torch.float32, local_files_only=True)
    model.config.use_cache = False
    if config.lora is not None:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(config.lora))
    if config.activation_checkpointing:
        checkpoint_activations(model)
    model.train()
    return model


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward `checkpoint_activations` made recompute (transformers'
    `gradient_checkpointing` flag set), for `set_checkpointing` to turn on and off step by step."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", None) is True]


def set_checkpointing(layers: list[nn.Module], on: bool) -> None:
    """Recompute (`on`) or keep the activations of `layers` in the forwards that follow; the
    gradients are the same either way (transformers reads the flag at every forward)."""
    for m in layers:
        setattr(m, "gradient_checkpointing", on)  # noqa: B010 - a plain attribute transformers reads


def activation_bytes(model: nn.Module, tokens: int) -> int:
    """An upper estimate of the bytes a forward keeps for the backward pass without activation
    checkpointing, for `tokens` positions (padded batch x length). Per token and decoder layer a
    Qwen3/Llama layer keeps about 11 hidden-sized and 4 intermediate-sized vectors plus its query
    and key/value projections; counted at 4 bytes each (fp32) although bf16 autocast keeps most in
    2. Measured with saved-tensor hooks on CPU in fp32 (one layer's difference, weights left out):
    qwen3-0.6b 123,048 bytes per token and layer (this gives 135,168), qwen3-1.7b 196,776 (229,376)."""
    cfg: Any = getattr(model, "config", None)
    if cfg is None:
        return 0
    h = int(cfg.hidden_size)
    inter = int(getattr(cfg, "intermediate_size", 4 * h))
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or h // heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads) * head_dim
    per_layer = 11 * h + 4 * inter + 3 * heads * head_dim + 4 * kv
    return 4 * tokens * per_layer * int(cfg.num_hidden_layers)


def checkpoint_activations(model: nn.Module) -> None:
    """Recompute each decoder layer's forward in the backward pass (transformers' activation
    checkpointing, non-reentrant: frozen inputs need no grad, and it composes with FSDP2)."""
    peft_or_lm: Any = model
    lm: Any = peft_or_lm.get_base_model() if hasattr(peft_or_lm, "get_base_model") else peft_or_lm
    if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def over_base(config: TrainerConfig, base: nn.Module, device: torch.device) -> nn.Module | None:
    """The architecture of `config.model_path` built without weights (meta device), its parameters
    and persistent buffers then set to `base`'s own tensors (shared, not copied) and its other
    buffers (rotary frequencies) to copies; None where `base` is not fp32 on `device` (the fp32
    master weights rule). Both sides only read the shared tensors: LoRA trains its adapters alone,
    and the engine that lent `base` publishes adapters only (`TorchEngine.lend_base`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tensors = [*base.parameters(), *base.buffers()]
    if any(t.dtype != torch.float32 or t.device != device for t in tensors if t.is_floating_point()):
        log.info("the served base is not fp32 on %s: the trainer loads its own copy", device)
        return None
    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.model_path,
                                                                                  local_files_only=True),
                                                      dtype=torch.float32)
    model.load_state_dict(base.state_dict(), strict=True, assign=True)
    for name, buf in base.named_buffers():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if module._buffers.get(leaf) is not None and module._buffers[leaf].is_meta:  # not in the state dict
            module._buffers[leaf] = buf.clone()
    model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"the served base lacks {left[:3]}: not the model of {config.model_path}")
    return model


def lora_config(lora: LoraSettings) -> Any:
    """The peft `LoraConfig` of the trained adapter (also written beside adapters made from checkpoints)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int; scaling is alpha / r
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )


def build_reference(config: TrainerConfig) -> nn.Module:
    """A frozen copy of the base model (full fine-tuning with a KL penalty)."""
    from transformers import AutoModelForCausalLM

    ref: Any = AutoModelForCausalLM.from_pretrained(
        config.model_path, dtype=torch.float32, local_files_only=True
    )
    ref.config.use_cache = False
    ref.eval().requires_grad_(False)
    return ref


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the children of the first ModuleList named `layers`."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            return list(mod)
    raise ValueError("no decoder `layers` ModuleList found; cannot shard per layer")


def shard_model(model: nn.Module, bf16: bool) -> None:
    """FSDP2: `fully_shard` each decoder layer, then the root; SUM gradient reduction."""
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.set_gradient_divide_factor(1.0)
            mod.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


def live_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter of an unsharded full fine-tuning model, made on its device, named
    as in a full export (a tied output layer once, as the input embedding): what the torch engine
    copies into its own weights in place."""
    with torch.no_grad():
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full CPU tensors of the trainable parameters (collective under FSDP: call on all ranks)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    sd: dict[str, torch.Tensor] = dict(get_model_state_dict(model, options=opts))  # type: ignore[arg-type]
    # A tied input embedding reappears under LoRA's lm_head.base_layer name (frozen, shared with the
    # embedding); keep exactly the trainable parameters, as restore_checkpoint expects.
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in sd.items() if k in trainable}


def _save_sharded(sd: dict[str, torch.Tensor], out: Path, max_shard: str = "5GB") -> None:
    """save_pretrained-compatible safetensors (+ index when more than one shard)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(
        sd, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard
    )
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: sd[k].contiguous() for k in keys}, str(out / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_full_export(
    model: nn.Module, sd: dict[str, torch.Tensor], config: TrainerConfig, out: Path
) -> None:
    """A folder `AutoModelForCausalLM.from_pretrained` loads: config, weights, tokenizer files."""
    hf_config: Any = model.config
    if getattr(hf_config, "tie_word_embeddings", False):
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    hf_config.save_pretrained(out)
    _save_sharded(sd, out)
    for name in TOKENIZER_FILES:
        src = Path(config.model_path) / name
        if src.exists():
            shutil.copy2(src, out / name)


def write_lora_export(model: nn.Module, sd: dict[str, torch.Tensor], out: Path) -> None:
    """A peft adapter folder (`PeftModel.from_pretrained(base, out)` loads it): the LoRA matrices
    only. With `lm_head` targeted peft would also copy the whole (frozen, unresized) embedding
    matrices into the adapter; `save_embedding_layers=False` keeps them out."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    peft_model: Any = model
    adapter = get_peft_model_state_dict(peft_model, state_dict=sd, save_embedding_layers=False)
    save_file(
        {k: v.contiguous() for k, v in adapter.items()},
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    peft_model.peft_config["default"].save_pretrained(str(out))
