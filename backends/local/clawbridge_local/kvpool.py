"""`KVPool`: the torch engine's preallocated KV budget, read in place by every forward.

Why this shape (issue 22 §1): the engine used to give each request its own transformers
`DynamicCache` (grown by `torch.cat` every token) and batched a decode step by padding and
concatenating every running cache per layer, then cloning each back out: each token copied all
caches, and the allocator churn kept the process at 8-9 GB for a 0.54 GB model. Here:

- One pool per layer, `keys[layer]` / `values[layer]` of shape [kv_heads, budget_tokens, head_dim],
  allocated once with `torch.empty` (pages are committed as they are first written, so the
  resident size is bounded by the budget's high-water mark, never by tokens served;
  `high_water_tokens`). How many positions: `clawbridge_local.kvbudget`.
- The pool's dtype may be smaller than the model's (`kv_dtype`, issue 32 §1: bfloat16 halves a
  float32 model's cache on the CPU). New keys and values are rounded to it as they are written,
  and attention runs in it on exactly what the pool holds (the query cast to it, the output cast
  back: SDPA reads the stored values in place, no widened copy per step); so the logits, and the
  logprobs a request records, are those of the keys and values actually used.
  `bench/engine_memory.py` measures how far they move from a float32 pool's (docs/engine-memory.md:
  widening the values to float32 instead moved them about as far, and decoded slower).
- A request owns one contiguous region of the pool (first fit over a free list), reserved at
  admission for its prompt plus its max_tokens, so a running request never needs more room.
  A request that does not fit waits; nothing is refused for lack of room.
- Attention runs through `pool_attention`, registered as a transformers attention implementation:
  while the worker has a `StepPlan` active, each layer writes the new keys/values of row b into
  that row's region and attends over a *view* of it (no gather, no padding, no copy of past
  tokens); the linear layers still run batched over all rows. Without an active plan (any other
  caller of a model sharing the config, e.g. a trainer) it is exactly transformers' SDPA.
- Prefix reuse: a request that ends normally keeps its region (shrunk to its cached tokens) as a
  prefix entry keyed by its weights and tokens; a later request on the same weights whose prompt
  starts with those tokens copies them once into its own region and prefills only the rest.
  An entry also keeps its *prompt ends*: for each prompt its tokens began with (its own request's,
  and those it inherited from the entry that request reused), the output layer's input at that
  prompt's last position (`prefill`). The same prompt sent again then takes all its tokens and
  that end, and its first logits are the output layer's on it (`logits_at`): no forward, and
  bit-identical to the first time, where `ends_are_exact` holds for the model. Ends cost
  hidden_size values per prompt, at most one per cached token (~5% of the keys/values).
  Entries are evicted when an allocation needs their room: only the entries that make it fit
  (least recently used first), and none when evicting could not make it fit (the room is held by
  running requests), so a waiting request never costs the cached prefixes it cannot use. All
  entries of a set of weights are dropped when those weights change in place.

Invariants:
- Regions never overlap; free ranges are kept sorted and coalesced; `used + cached + free ==
  budget` at all times (`check`).
- Exactness: row b attends over exactly its own positions [0, cached + new) at positions given
  explicitly, so with a pool in the model's dtype its logits equal an unbatched forward's up to
  float summation order (<= 1e-4); in a smaller dtype, up to that order and the rounding of what
  is written (a value computed in a batched forward may round to the neighbouring bfloat16).
- Only the engine's worker thread touches a pool (no locks); `stats` is read from other threads
  as a snapshot of plain ints.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F

T = TypeVar("T")
ATTN_NAME = "clawbridge_pool"
"""The transformers attention implementation name that `install` gives an engine's model."""


@dataclass
class Row:
    """One row of a batched forward: its region start, tokens already cached, new tokens."""

    start: int
    cached: int
    new: int


@dataclass
class StepPlan:
    """What `pool_attention` needs for one forward: the pool and one `Row` per batch row."""

    pool: KVPool
    rows: Sequence[Row]
    attend: Callable[..., tuple[torch.Tensor, None]] | None = None
    """Another layout of the forward's rows (`clawbridge_local.decode_graphs`, `packed_prefill`):
    `pool_attention` hands each layer's (module, query, key, value, attention_mask, scaling,
    sliding_window) to it instead of attending row by row."""


def run_planned(plan: StepPlan, forward: Callable[[], T]) -> T:
    """`forward()` with `plan` active for `pool_attention` on this thread."""
    _active.plan = plan
    try:
        return forward()
    finally:
        _active.plan = None


_active = threading.local()


@dataclass(eq=False)
class PrefixEntry:
    """The KV of a finished request kept for reuse: `tokens` are cached at [start, start+len)."""

    owner: weakref.ref[Any]
    tokens: tuple[int, ...]
    start: int
    ends: dict[int, torch.Tensor] = field(default_factory=dict)
    """Prompt ends: for the prompt `tokens[:k]`, the output layer's input at its last position."""

    def usable(self, prompt: Sequence[int]) -> int:
        """How many of `prompt`'s tokens this entry can give: all of them when it holds the prompt
        and its end, else the common prefix but the prompt's last token."""
        n = len(prompt)
        common = _common_prefix(self.tokens, prompt, n)
        return n if common == n and n in self.ends else min(common, n - 1)


@dataclass(frozen=True)
class PoolStats:
    """A snapshot for status pages (token counts)."""

    budget_tokens: int
    used_tokens: int
    """Reserved by admitted requests."""
    cached_tokens: int
    """Held by prefix entries (evictable)."""
    prefix_entries: int
    prefix_hits: int
    prefix_tokens_reused: int
    high_water_tokens: int
    """Positions below the highest end of any region so far: the part of the pool ever written, so
    the part whose memory is committed (pages are committed as they are first written)."""


class KVPool:
    """Per-layer key/value pools of `budget_tokens` positions (see module docstring)."""

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, budget_tokens: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if budget_tokens < 2:
            raise ValueError("the KV budget must hold at least 2 tokens")
        self.budget_tokens = budget_tokens
        shape = (kv_heads, budget_tokens, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self._free: list[tuple[int, int]] = [(0, budget_tokens)]
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self.used_tokens = 0
        self.cached_tokens = 0
        self.prefix_hits = 0
        self.prefix_tokens_reused = 0
        self.high_water_tokens = 0
        """The highest region end so far (`PoolStats.high_water_tokens`)."""

    @classmethod
    def for_model(cls, model: torch.nn.Module, budget_tokens: int, dtype: torch.dtype | None = None) -> KVPool:
        """A pool for `model`'s layers; keys and values in `dtype` (None: the model's own)."""
        layers, kv_heads, head_dim = _kv_shape(model)
        p = next(model.parameters())
        return cls(layers, kv_heads, head_dim, budget_tokens, dtype or p.dtype, p.device)

    @staticmethod
    def bytes_per_token(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
        """Bytes of keys + values for one token over all layers, in `dtype` (None: the model's)."""
        layers, kv_heads, head_dim = _kv_shape(model)
        size = (dtype or next(model.parameters()).dtype).itemsize
        return 2 * layers * kv_heads * head_dim * size

    @property
    def dtype(self) -> torch.dtype:
        """What keys and values are kept in."""
        return self.keys[0].dtype

    # ------------------------------------------------------------------ regions

    def allocate(self, n: int) -> int | None:
        """Start of a free region of `n` tokens, evicting prefix entries only where that makes it
        fit (`_victims`); None, with nothing evicted, if the pool cannot hold it now."""
        start = self._first_fit(n)
        if start is None:
            victims = self._victims(n)
            if victims is None:
                return None
            for key in victims:
                self._evict(key)
            start = self._first_fit(n)
            assert start is not None, "evicting the chosen entries frees a run of n tokens"
        self.used_tokens += n
        self.high_water_tokens = max(self.high_water_tokens, start + n)
        return start

    def free(self, start: int, n: int) -> None:
        """Give a region back (`n` == 0 is a no-op)."""
        if n > 0:
            self.used_tokens -= n
            self._give_back(start, n)

    def _first_fit(self, n: int) -> int | None:
        for i, (s, size) in enumerate(self._free):
            if size >= n:
                if size == n:
                    del self._free[i]
                else:
                    self._free[i] = (s + n, size - n)
                return s
        return None

    def _give_back(self, start: int, n: int) -> None:
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < start:
            i += 1
        free.insert(i, (start, n))
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:  # merge right
            free[i] = (free[i][0], free[i][1] + free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:  # merge left
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]

    def free_tokens(self) -> int:
        return sum(n for _, n in self._free)

    def check(self) -> None:
        """Assert the accounting invariant (tests)."""
        assert self.used_tokens + self.cached_tokens + self.free_tokens() == self.budget_tokens

    # ------------------------------------------------------------------ prefix entries

    def keep_prefix(self, owner: object, tokens: Sequence[int], start: int, reserved: int,
                    ends: dict[int, torch.Tensor] | None = None) -> None:
        """Turn a finished request's region (`reserved` tokens at `start`, the first
        len(tokens) of them cached) into a prefix entry with the prompt `ends` that lie within
        `tokens`; the rest goes back to the free list."""
        n = len(tokens)
        self.used_tokens -= reserved
        if n == 0:
            self._give_back(start, reserved)
            return
        if reserved > n:
            self._give_back(start + n, reserved - n)
        entry = PrefixEntry(weakref.ref(owner), tuple(tokens), start,
                            {k: h for k, h in (ends or {}).items() if k <= n})
        self._entries[id(entry)] = entry
        self.cached_tokens += n

    def take_prefix(self, owner: object, prompt: Sequence[int]) -> PrefixEntry | None:
        """The entry on `owner`'s weights that can give the most of `prompt` (`PrefixEntry.usable`,
        at least one token), removed from the LRU order for the caller to `reuse`; None if none
        matches."""
        best: PrefixEntry | None = None
        best_n = 0
        for entry in self._entries.values():
            if entry.owner() is not owner:
                continue
            n = entry.usable(prompt)
            if n > best_n:
                best, best_n = entry, n
        if best is None:
            return None
        del self._entries[id(best)]
        self.cached_tokens -= len(best.tokens)
        self.used_tokens += len(best.tokens)  # held by the caller until `reuse` frees it
        return best

    def reuse(self, entry: PrefixEntry, prompt: Sequence[int], dst: int) -> tuple[int, dict[int, torch.Tensor]]:
        """Copy what `entry` can give of `prompt` (`PrefixEntry.usable`) into the region at `dst`,
        free the entry's region, and return how many tokens were copied with the prompt ends that
        lie within them."""
        n = entry.usable(prompt)
        if dst != entry.start:
            for pool in (*self.keys, *self.values):
                pool[:, dst:dst + n].copy_(pool[:, entry.start:entry.start + n])
        self.free(entry.start, len(entry.tokens))
        self.prefix_hits += 1
        self.prefix_tokens_reused += n
        return n, {k: h for k, h in entry.ends.items() if k <= n}

    def drop_prefixes(self, owner: object | None = None) -> None:
        """Evict every entry of `owner` (all entries when None), e.g. when its weights change."""
        for key, entry in list(self._entries.items()):
            if owner is None or entry.owner() is owner or entry.owner() is None:
                del self._entries[key]
                self.cached_tokens -= len(entry.tokens)
                self._give_back(entry.start, len(entry.tokens))

    def _victims(self, n: int) -> list[int] | None:
        """The prefix entries to evict so that `n` contiguous tokens are free: those overlapping
        the best window of `n` tokens that lies in free ranges and entries only (never across a
        region an admitted request holds). Best: its most recently used victim is the least
        recently used of all windows' (LRU), then the fewest tokens evicted. None when no window
        exists: evicting would not make `n` fit, so nothing is evicted."""
        rank = {key: i for i, key in enumerate(self._entries)}  # 0: least recently used
        segs = sorted([(s, size, None) for s, size in self._free]
                      + [(e.start, len(e.tokens), key) for key, e in self._entries.items()])
        best: tuple[int, int, list[int]] | None = None
        for i in range(len(segs)):
            total, keys, end = 0, [], segs[i][0]
            for s, size, key in segs[i:]:
                if s != end:  # a request's region lies between: the window cannot span it
                    break
                total, end = total + size, s + size
                if key is not None:
                    keys.append(key)
                if total >= n:
                    cost = (max((rank[k] for k in keys), default=-1),
                            sum(len(self._entries[k].tokens) for k in keys), keys)
                    if best is None or cost[:2] < best[:2]:
                        best = cost
                    break
        return None if best is None else best[2]

    def _evict(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.cached_tokens -= len(entry.tokens)
        self._give_back(entry.start, len(entry.tokens))

    def stats(self) -> PoolStats:
        return PoolStats(self.budget_tokens, self.used_tokens, self.cached_tokens, len(self._entries),
                         self.prefix_hits, self.prefix_tokens_reused, self.high_water_tokens)

    # ------------------------------------------------------------------ forwards

    def forward(self, model: torch.nn.Module, tokens: list[list[int]], rows: Sequence[Row]) -> torch.Tensor:
        """Run `model` on `tokens` (one equal-length list per row) against this pool; return the
        last position's logits per row [B, vocab]. Writes each row's new keys/values in place."""
        device = self.keys[0].device
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        pos = torch.tensor([[r.cached + i for i in range(r.new)] for r in rows], dtype=torch.long, device=device)
        _active.plan = StepPlan(self, rows)
        try:
            out = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
        finally:
            _active.plan = None
        return out.logits[:, -1]

    def prefill(self, model: torch.nn.Module, tokens: list[int], row: Row) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` of one row, returning its last position's logits [1, vocab] with its prompt
        end: the output layer's input there [1, 1, hidden], a tensor of its own (`logits_at`)."""
        captured: list[torch.Tensor] = []
        handle = _output_layer(model).register_forward_pre_hook(functools.partial(_own_input, captured))
        try:
            logits = self.forward(model, [tokens], [row])
        finally:
            handle.remove()
        return logits, captured[0]

    @staticmethod
    def logits_at(model: torch.nn.Module, end: torch.Tensor) -> torch.Tensor:
        """The logits [1, vocab] a prompt `end` gives (the output layer, its hooks included)."""
        return _output_layer(model)(end)[:, -1]  # type: ignore[no-any-return]

    @staticmethod
    def ends_are_exact(model: torch.nn.Module) -> bool:
        """Whether `logits_at` of a prefill's end is bit-identical to the logits of that prefill
        (nothing after the output layer changes them, e.g. no logit soft-capping)."""
        captured: list[torch.Tensor] = []
        head = _output_layer(model)
        if head is None:
            return False
        vocab = int(model.get_input_embeddings().num_embeddings)  # type: ignore[operator]
        ids = torch.tensor([[i % vocab for i in (1, 7, 3, 5)]], device=next(model.parameters()).device)
        handle = head.register_forward_pre_hook(functools.partial(_own_input, captured))
        try:
            with torch.inference_mode():
                out = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1]
        finally:
            handle.remove()
        with torch.inference_mode():
            return bool(torch.equal(out, head(captured[0])[:, -1]))


def _kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a transformers causal LM."""
    cfg: Any = model.config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return int(cfg.num_hidden_layers), kv_heads, head_dim


def _output_layer(model: torch.nn.Module) -> Any:
    """The model's output layer (transformers' `get_output_embeddings`), None if it has none."""
    return cast(Any, model).get_output_embeddings()


def _own_input(into: list[torch.Tensor], _: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A forward pre-hook on the output layer: it runs on a contiguous copy of its input, kept in
    `into`, so that `KVPool.logits_at` later runs the same layer on the same memory layout."""
    own = args[0].clone(memory_format=torch.contiguous_format)
    into.append(own)
    return (own, *args[1:])


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pool_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function: SDPA over the pool regions of the active `StepPlan`
    (see module docstring), or plain transformers SDPA when no plan is active."""
    plan: StepPlan | None = getattr(_active, "plan", None)
    if plan is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,  # type: ignore[return-value]
                                      dropout=dropout, sliding_window=sliding_window, **kwargs)
    if plan.attend is not None:
        return plan.attend(module, query, key, value, attention_mask, scaling, sliding_window)
    li = int(module.layer_idx)  # type: ignore[arg-type]
    pk, pv = plan.pool.keys[li], plan.pool.values[li]
    batch, heads, q_n, dim = query.shape  # every row has the same number of new tokens
    kv_heads = key.shape[1]
    group = heads // kv_heads
    out_dtype = query.dtype
    query = query.to(pk.dtype)  # a pool in a smaller dtype: attention runs in it, on the values kept
    outs = []
    for b, r in enumerate(plan.rows):
        at = r.start + r.cached
        end = at + q_n
        pk[:, at:end].copy_(key[b])
        pv[:, at:end].copy_(value[b])
        k, v = pk[None, :, r.start:end], pv[None, :, r.start:end]  # views [1, kv_heads, L, D]
        # Always 4-D: CPU runs its fused (flash) kernel only for 4-D inputs.
        windowed = sliding_window is not None and r.cached + q_n > sliding_window
        if q_n == 1 and not windowed:  # decode: a key/value head's query heads attend as one block
            o = F.scaled_dot_product_attention(query[b].reshape(1, kv_heads, group, dim), k, v, scale=scaling)
        elif r.cached == 0 and not windowed:  # a cold prefill: causal, fully masked blocks skipped
            o = F.scaled_dot_product_attention(query[b:b + 1], k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:  # causal from position `cached` on (and the window)
            qpos = torch.arange(r.cached, r.cached + q_n, device=query.device)[:, None]
            kpos = torch.arange(0, r.cached + q_n, device=query.device)[None, :]
            mask = kpos <= qpos
            if sliding_window is not None:
                mask &= qpos - kpos < sliding_window
            o = F.scaled_dot_product_attention(query[b:b + 1], k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        outs.append(o.reshape(1, heads, q_n, dim))
    out = outs[0] if batch == 1 else torch.cat(outs)
    return out.transpose(1, 2).to(out_dtype), None  # [B, q_n, heads, D]


def install(model: torch.nn.Module) -> None:
    """Make `model` attend through `pool_attention` (plain SDPA outside an engine forward)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTN_NAME, pool_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    cfg: Any = model.config
    for c in [cfg, *(getattr(cfg, k) for k in ("text_config",) if hasattr(cfg, k))]:
        c._attn_implementation = ATTN_NAME
