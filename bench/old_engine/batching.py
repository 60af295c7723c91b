"""BASELINE COPY for bench/engine_memory.py (the engine before the KV pool; not used by clawbridge).

One decode step for several requests at once: their KV caches left-padded into one batch.

Every running request of `TorchEngine` owns a transformers `DynamicCache` of batch size 1. A
decode step of a small model on CPU is mostly per-layer overhead, not arithmetic, so running the
decode steps of B requests as one forward costs little more than one of them
(`python bench/engine_batching.py --model smollm2`, 8 sampled requests x 32 tokens, one thread, quiet
2-core box: 34.4 vs 12.7 tokens/s unbatched, 2.71x; logprobs within 3.2e-05).

Invariants:
- Exactness: request b's logits come from attention over exactly its own cached positions (the
  padding is masked out) at its own positions (explicit `position_ids`), so they equal its
  unbatched logits up to float summation order (measured: log-probability differences <= 1e-4).
  The token is always chosen from, and its logprob taken from, the logits of the forward that
  produced it: batching never separates a token from the distribution that sampled it.
- Ownership: after the step each request's own cache holds its keys and values (cloned out of the
  batch: no request keeps the padded batch tensors alive), one position longer than before.
- Only plain full-attention `DynamicLayer` caches batch (`can_batch`); anything else (sliding
  windows, quantised or static caches) runs unbatched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

MAX_PADDED_TOKENS = 65_536
"""A batch's padded cache length x batch size is at most this; a group past it is split (the
padding copy of very long contexts would cost more than it saves)."""


def can_batch(cache: Any) -> bool:
    """True for a filled `DynamicCache` whose layers are all plain `DynamicLayer`s."""
    from transformers.cache_utils import DynamicLayer

    layers: Any = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)


def plan_batches(lengths: Sequence[int], max_padded_tokens: int = MAX_PADDED_TOKENS) -> list[list[int]]:
    """Indices into `lengths` grouped so that each group's batch size x longest length fits the
    budget; similar lengths go together (less padding). A single index always forms a group."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * (lengths[i] + 1) <= max_padded_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def decode_batch(model: torch.nn.Module, caches: Sequence[Any], last_tokens: Sequence[int],
                 device: torch.device) -> torch.Tensor:
    """Run one decode step for every (cache, last token) pair; return logits [B, vocab] and extend
    every cache in place by one position (see the module invariants)."""
    from transformers import DynamicCache

    lengths = [int(c.get_seq_length()) for c in caches]
    longest = max(lengths)
    n_layers = len(caches[0].layers)
    padded = []
    for li in range(n_layers):
        keys = torch.cat([F.pad(c.layers[li].keys, (0, 0, longest - n, 0)) for c, n in zip(caches, lengths, strict=True)])
        values = torch.cat([F.pad(c.layers[li].values, (0, 0, longest - n, 0)) for c, n in zip(caches, lengths, strict=True)])
        padded.append((keys, values))
    batch_cache: Any = DynamicCache(ddp_cache_data=padded)  # its layers are DynamicLayers (can_batch)
    mask = torch.zeros(len(caches), longest + 1, dtype=torch.long, device=device)
    for b, n in enumerate(lengths):
        mask[b, longest - n:] = 1
    out = model(
        input_ids=torch.tensor([[t] for t in last_tokens], dtype=torch.long, device=device),
        attention_mask=mask,
        position_ids=torch.tensor([[n] for n in lengths], dtype=torch.long, device=device),
        past_key_values=batch_cache,
        use_cache=True,
        logits_to_keep=1,
    )
    for b, (cache, n) in enumerate(zip(caches, lengths, strict=True)):
        for li in range(n_layers):
            cache.layers[li].keys = batch_cache.layers[li].keys[b:b + 1, :, longest - n:, :].clone()
            cache.layers[li].values = batch_cache.layers[li].values[b:b + 1, :, longest - n:, :].clone()
    return out.logits[:, -1]
