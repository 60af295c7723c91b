"""Prefills of several prompts in one forward, for the torch engine on CUDA (issue 36 §2).

Why: an eager forward on a GPU costs about the same whatever its length (it is bound by launching
~1,700 kernels for a 28-layer model), so admitting 32 requests cost 32 forwards before their first
tokens, most of a 32-stream run of 128 tokens once decoding is captured in graphs. Here the
uncached tokens of the prompts admitted in one round (same weights, same adapter) run as one
sequence of N positions: the linear layers see all N rows at once, and attention keeps every
prompt to its own pool region:

- Each layer writes the N new keys/values at their positions in their requests' regions (one
  `index_copy_`), gathers every prompt's whole region [start, start + cached + new) into one key
  sequence of M positions (one `index_select`), and runs SDPA under a block mask: a query of
  prompt i sees prompt i's cached positions and its new ones up to itself, nothing else.
- The first logits of each prompt come from its prompt end (the output layer's input at its last
  position, kept as `KVPool.prefill` keeps it) through `KVPool.logits_at`: the computation a repeat
  of the prompt takes from the kept end, so that repeat is bit-identical, as after a lone prefill.
- Exactness: every prompt's logits equal its lone prefill's up to float summation order (the
  linear layers' rows, a masked SDPA for the causal one): <= 1e-4 in fp32
  (tests/test_decode_graphs.py).
- `PACK_TOKENS` / `PACK_KEYS` bound N and M (the mask is N x M); the engine packs a prompt
  alone when it is larger.

Only the engine's worker thread runs it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from clawbridge_local.kvpool import KVPool, Row, StepPlan, _own_input, run_planned

PACK_TOKENS = 4096
"""Most new tokens in one packed prefill."""
PACK_KEYS = 16384
"""Most region positions (cached + new) one packed prefill attends over."""


def fits(rows: Sequence[Row]) -> bool:
    """Whether `rows` fit one packed prefill."""
    return sum(r.new for r in rows) <= PACK_TOKENS and sum(r.cached + r.new for r in rows) <= PACK_KEYS


def prefill_packed(pool: KVPool, model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                   rows: Sequence[Row]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run the `new` tokens `prompts[i]` of every `rows[i]` in one forward (module docstring);
    per prompt its first logits [1, vocab] and its prompt end [1, 1, hidden]."""
    device = pool.keys[0].device
    ids: list[int] = []
    positions: list[int] = []
    write: list[int] = []
    gather: list[int] = []
    q_seg: list[int] = []
    k_seg: list[int] = []
    k_pos: list[int] = []
    last: list[int] = []
    for i, (tokens, r) in enumerate(zip(prompts, rows, strict=True)):
        if len(tokens) != r.new or r.new < 1:
            raise ValueError("each prompt must give its row's new tokens")
        ids.extend(tokens)
        positions.extend(range(r.cached, r.cached + r.new))
        write.extend(range(r.start + r.cached, r.start + r.cached + r.new))
        gather.extend(range(r.start, r.start + r.cached + r.new))
        q_seg.extend([i] * r.new)
        k_seg.extend([i] * (r.cached + r.new))
        k_pos.extend(range(r.cached + r.new))
        last.append(len(ids) - 1)
    as_long = functools.partial(torch.tensor, dtype=torch.long, device=device)
    q_pos, qs, ks, kp = as_long(positions), as_long(q_seg), as_long(k_seg), as_long(k_pos)
    mask = ((qs[:, None] == ks[None, :]) & (kp[None, :] <= q_pos[:, None]))[None, None]  # [1, 1, N, M]
    attend = functools.partial(_attend, pool, as_long(write), as_long(gather))
    head = model.get_output_embeddings()  # type: ignore[operator]
    captured: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(functools.partial(_own_input, captured))
    try:
        run_planned(StepPlan(pool, (), attend), lambda: model(
            input_ids=as_long(ids)[None], position_ids=q_pos[None], attention_mask=mask, use_cache=False,
            logits_to_keep=as_long(last)))
    finally:
        handle.remove()
    hidden = captured[0]  # [1, len(rows), hidden]: the output layer's input at each prompt's last position
    out = []
    for i in range(len(rows)):
        end = hidden[:, i:i + 1].clone(memory_format=torch.contiguous_format)
        out.append((KVPool.logits_at(model, end), end))
    return out


def _attend(pool: KVPool, write: torch.Tensor, gather: torch.Tensor, module: torch.nn.Module, query: torch.Tensor,
            key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor, scaling: float | None,
            window: int | None) -> tuple[torch.Tensor, None]:
    """One layer of a packed prefill; query [1, heads, N, D], key/value [1, kv_heads, N, D]."""
    if window is not None:
        raise NotImplementedError("packed prefills have no sliding window")
    li = int(module.layer_idx)  # type: ignore[arg-type]
    pk, pv = pool.keys[li], pool.values[li]
    pk.index_copy_(1, write, key[0].to(pk.dtype))
    pv.index_copy_(1, write, value[0].to(pv.dtype))
    group = query.shape[1] // key.shape[1]
    k = pk.index_select(1, gather).unsqueeze(0).to(query.dtype)
    v = pv.index_select(1, gather).unsqueeze(0).to(query.dtype)
    if group > 1:  # whole heads: SDPA's memory-efficient kernel takes a mask, not grouped heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(query, k, v, attn_mask=attention_mask, scale=scaling)
    return o.transpose(1, 2), None
