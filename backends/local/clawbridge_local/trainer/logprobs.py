"""Target-token logprobs for the trainer without a whole [B, T, V] fp32 logits tensor.

Invariants:
- `token_logprobs(model, c)[b, t]` = log_softmax(logits[b, t])[targets[b, t]] in fp32, the same
  numbers (to float tolerance) whichever path computes them.
- Chunked path (plain modules: the in-process trainer, world size 1): the decoder runs once; the
  output head, the fp32 cast, the log-sum-exp and the gather run per chunk of positions under
  activation checkpointing, so at most one chunk's logits exists at a time, in the forward and
  again (recomputed) in the backward. Only the [B, T, H] hidden states and the [B, T] results are
  kept for the backward. A chunk holds `default_chunk_elements(device)` logits: `CHUNK_ELEMENTS` (16 MB)
  on CPU, where the trainer shares the proxy's memory; on CUDA as many as half the free memory
  holds at `BYTES_PER_LOGIT` each (issue 36: 16 MB chunks were 3 positions of a 151,936-token
  vocabulary, 171 small head matmuls and their recompute per step, 4x slower than one). When one
  chunk holds every position the head runs once, without recompute.
- FSDP-wrapped models (and any model whose decoder/head this module cannot find) take the plain
  path: the whole model's forward, then one fp32 log-softmax over all positions. Calling an FSDP
  root's head outside its forward would read sharded parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

from clawbridge_local.trainer.batch import Collated

CHUNK_ELEMENTS = 4 * 1024 * 1024
"""Logits elements per chunk on CPU (4 Mi fp32 = 16 MB); a chunk is at least one position."""
BYTES_PER_LOGIT = 16
"""What one logit costs at most while a chunk's loss runs forward and backward on CUDA: its fp32
value kept for the backward, its bf16 matmul output, and their gradients."""


def available_bytes(device: torch.device) -> int:
    """Bytes a new tensor can take on `device` now: CUDA's free memory plus what torch's caching
    allocator holds unused; 0 for other devices (the caller's CPU rules apply)."""
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def default_chunk_elements(device: torch.device) -> int:
    """Logits per chunk on `device` (module invariants)."""
    if device.type != "cuda":
        return CHUNK_ELEMENTS
    return max(CHUNK_ELEMENTS, available_bytes(device) // (2 * BYTES_PER_LOGIT))


def _decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The decoder stack and output head of a causal LM (peft-wrapped or not), or None."""
    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        return None
    get_base: Any = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    decoder = getattr(base, "model", None)
    head = getattr(base, "lm_head", None)
    if not isinstance(decoder, nn.Module) or not isinstance(head, nn.Module):
        return None
    return decoder, head


def _chunk_logprobs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def full_token_logprobs(model: nn.Module, c: Collated) -> torch.Tensor:
    """The plain path: one forward, one [B, T, V] fp32 log-softmax."""
    logits = model(input_ids=c.input_ids, attention_mask=c.attention_mask).logits.float()
    return logits.gather(-1, c.targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_logprobs(model: nn.Module, c: Collated, chunk_elements: int | None = None) -> torch.Tensor:
    """[B, T] logprob of each target token (fp32 log-softmax over the vocabulary); see invariants.
    `chunk_elements`: logits per chunk (default: `default_chunk_elements` of the targets' device)."""
    parts = _decoder_and_head(model)
    if parts is None:
        return full_token_logprobs(model, c)
    decoder, head = parts
    hidden = decoder(input_ids=c.input_ids, attention_mask=c.attention_mask).last_hidden_state
    batch, length = c.targets.shape
    weight: Any = getattr(head, "weight", None)
    vocab = int(getattr(head, "out_features", 0)) or (int(weight.shape[0]) if weight is not None else 0)
    if vocab <= 0:
        return full_token_logprobs(model, c)
    step = max(1, (chunk_elements or default_chunk_elements(c.targets.device)) // max(1, batch * vocab))
    if step >= length:  # one chunk: nothing to bound, nothing to recompute
        return _chunk_logprobs(head, hidden, c.targets)
    out = []
    for start in range(0, length, step):
        h, t = hidden[:, start:start + step], c.targets[:, start:start + step]
        if torch.is_grad_enabled():
            out.append(checkpoint(_chunk_logprobs, head, h, t, use_reentrant=False))
        else:
            out.append(_chunk_logprobs(head, h, t))
    return torch.cat(out, dim=1)
