"""Decode steps of fixed shape for the torch engine, captured in CUDA graphs on CUDA (issue 36 §2).

Why: an eager decode step launches a kernel per op per layer (about 1,700 for a 28-layer model)
and on a GPU it was bound by the host launching them: 8-10 tokens/s at one stream on an H100,
where `cudaLaunchKernel` and `cudaMemcpyAsync` took 77% of the CPU time. A CUDA graph replays a
captured step's kernels with one launch; capture needs fixed shapes and fixed addresses, so a step
here has both:

- Buckets: the rows of a decode step are padded to the next of `BATCH_BUCKETS`, and every row
  attends over a window of L positions, L the next of `LENGTH_BUCKETS` at or above the longest
  row. One graph per (model, batch bucket, length bucket), captured the first time it is needed,
  replayed after; `MAX_WINDOW` bounds batch x L (the window's gathered keys and values).
- Fixed addresses: a step's inputs (token, position, region start, length, write index, whether
  the row is real) are one int64 buffer per graph, filled by one host-to-device copy before each
  replay from a pinned host buffer (which the next step may refill: every step's caller reads its
  logits back, after the copy, before the next step); the KV pool's tensors are preallocated and
  never move (a replay checks the pool's first tensor is where the graphs saw it, and drops them
  all if not); the logits come out in the graph's own output buffer, valid until its next replay.
- Attention (`_attend`): each layer writes row b's new key and value at its write index
  (`index_copy_`), gathers its window [start, start + L) with every position past its length
  reading its last one instead (the pool is `torch.empty`: unwritten memory may hold NaN, and a
  masked NaN still poisons SDPA's sum), and runs SDPA under the mask of its length. A padding row
  reads what position 0 holds and writes the same back, so it changes nothing; no real decode row
  writes position 0 (the first token of a region is a prompt token: cached >= 1).
- Exactness: a row's logits equal its unbatched eager ones up to float summation order (<= 1e-4
  in fp32; tests/test_decode_graphs.py on CPU, where the same steps run without capture), and a
  replayed graph runs the very kernels its eager run does (the GPU kit prints both differences).

Where it does not apply the engine's eager path runs instead: a step with a LoRA adapter on any
row (the hooks' per-row tensors are not captured), a model with sliding-window attention, a batch
or window past the largest bucket, and every step once a fixed-shape step has raised (`broken`).
A capture that fails after its eager warm-up worked is logged and capture stops: that bucket and
every later one run with fixed shapes eagerly.
A full-weight publish that moves a parameter (a tied output embedding untied) drops the model's
graphs (`forget`); one that copies in place keeps them (the addresses are the same).

Only the engine's worker thread calls into a `StaticDecode` (like the pool itself).
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from clawbridge_local.kvpool import KVPool, Row, StepPlan, run_planned

log = logging.getLogger("clawbridge.engine.graphs")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Padded batch sizes of a static decode step."""
LENGTH_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384)
"""Attention windows (positions per row) of a static decode step."""
MAX_WINDOW = 256 * 1024
"""Largest batch bucket x length bucket (gathered keys + values per layer: 2 x this x kv heads x head dim)."""
WARMUP_RUNS = 2
"""Eager runs of a bucket on a side stream before it is captured (lazy initialisations happen there)."""
_ROWS = 6
"""Rows of a graph's input buffer: token, position, region start, length (cached + 1), write index, real."""


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= n, None past the largest."""
    for b in buckets:
        if b >= n:
            return b
    return None


def sliding_window(model: torch.nn.Module) -> int | None:
    """The model's attention window when it uses one (then static steps do not apply), else None."""
    cfg: Any = getattr(model, "config", None)
    if cfg is None:
        return None
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return int(getattr(cfg, "sliding_window", 0) or 1)
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):
        return int(window)
    return None


@dataclass(eq=False)
class _Graph:
    """One (batch, length) bucket of one model."""

    batch: int
    length: int
    meta: torch.Tensor
    """[_ROWS, batch] int64 on the model's device: the step's inputs (module docstring)."""
    host: torch.Tensor
    """The same shape on the host (pinned on CUDA): filled, then copied into `meta`."""
    out: torch.Tensor | None = None
    """Logits [batch, vocab] of the last run (a captured graph's static output)."""
    graph: Any = None
    """The `torch.cuda.CUDAGraph`, None when the bucket runs eagerly (no capture, CPU)."""


class StaticDecode:
    """Fixed-shape decode steps over one `KVPool` (see module docstring)."""

    def __init__(self, pool: KVPool, capture: bool) -> None:
        """`capture`: record CUDA graphs (the pool must be on CUDA); otherwise run the same fixed
        shapes eagerly (CPU, tests)."""
        self.pool = pool
        self.capture = capture
        self._graphs: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[int, int], _Graph]] = (
            weakref.WeakKeyDictionary())
        self._pool_at = pool.keys[0].data_ptr()
        self._mempool: Any = torch.cuda.graph_pool_handle() if capture else None
        self.captured = 0
        """Graphs captured so far."""
        self.replays = 0
        """Steps run by replaying a graph."""
        self.eager_runs = 0
        """Steps run with fixed shapes but no graph (capture off, or a bucket's warmup)."""
        self.failed: list[str] = []
        """Why a capture failed (capture is off after the first)."""
        self.broken: str | None = None
        """Why fixed-shape steps stopped (a step raised): every step runs eagerly since."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Whether static steps apply to `model` at all."""
        return sliding_window(model) is None and getattr(model, "config", None) is not None

    def forward(self, model: torch.nn.Module, tokens: list[int], rows: list[Row]) -> torch.Tensor | None:
        """The last-position logits [len(rows), vocab] of one decode token per row (no adapter on any
        row), writing each row's key/value into the pool; None where this step does not apply (the
        caller runs it eagerly). The result is a view valid until the next call."""
        if self.broken is not None:
            return None
        try:
            return self._forward(model, tokens, rows)
        except Exception as e:  # never fail a request for this: the eager step rewrites what it wrote
            self.broken = f"{type(e).__name__}: {e}"
            log.exception("fixed-shape decode steps stop; eager steps from now on")
            return None

    def _forward(self, model: torch.nn.Module, tokens: list[int], rows: list[Row]) -> torch.Tensor | None:
        n = len(rows)
        batch = bucket(n, BATCH_BUCKETS)
        length = bucket(max(r.cached for r in rows) + 1, LENGTH_BUCKETS)
        if batch is None or length is None or batch * length > MAX_WINDOW:
            return None
        if self.pool.keys[0].data_ptr() != self._pool_at:  # the pool was reallocated: no graph is valid
            self._graphs = weakref.WeakKeyDictionary()
            self._pool_at = self.pool.keys[0].data_ptr()
        graphs = self._graphs.setdefault(model, {})
        key = (batch, length)
        if key not in graphs:
            graphs[key] = self._build(model, batch, length)
        g = graphs[key]
        host = g.host
        host[:, n:] = torch.tensor([0, 0, 0, 1, 0, 0])[:, None]  # padding rows (module docstring)
        host[:, :n] = torch.tensor([tokens, [r.cached for r in rows], [r.start for r in rows],
                                    [r.cached + 1 for r in rows], [r.start + r.cached for r in rows], [1] * n])
        g.meta.copy_(host, non_blocking=True)
        if g.graph is not None:
            g.graph.replay()
            self.replays += 1
        else:
            g.out = self._run(model, g)
            self.eager_runs += 1
        assert g.out is not None
        return g.out[:n]

    def forget(self, model: torch.nn.Module) -> None:
        """Drop `model`'s graphs (its parameters moved)."""
        self._graphs.pop(model, None)

    # ------------------------------------------------------------------ building

    def _build(self, model: torch.nn.Module, batch: int, length: int) -> _Graph:
        device = self.pool.keys[0].device
        host = torch.zeros((_ROWS, batch), dtype=torch.long, pin_memory=device.type == "cuda")
        host[3] = 1
        g = _Graph(batch, length, host.to(device), host)
        if not self.capture:
            return g
        self._warm_up(model, g)  # raises (caught in `forward`) when the fixed-shape step itself fails
        try:
            self._capture(model, g)
        except Exception as e:  # this model or torch cannot be captured: fixed shapes, eagerly, from now on
            self.capture = False
            why = f"batch {batch} x length {length}: {type(e).__name__}: {e}"
            self.failed.append(why)
            log.warning("decode steps not captured in CUDA graphs (%s); they run eagerly", why)
            return g
        self.captured += 1
        return g

    def _warm_up(self, model: torch.nn.Module, g: _Graph) -> None:
        """Run `g` eagerly on a side stream (padding rows only: the pool is unchanged), where lazy
        initialisations (cuBLAS workspaces) happen before a capture."""
        device = g.meta.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._run(model, g)
        torch.cuda.current_stream(device).wait_stream(side)

    def _capture(self, model: torch.nn.Module, g: _Graph) -> None:
        """Capture `g`'s step into a CUDA graph (recorded, not run)."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: the in-process trainer may allocate on its own thread meanwhile.
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            out = self._run(model, g)
        g.graph, g.out = graph, out

    def _run(self, model: torch.nn.Module, g: _Graph) -> torch.Tensor:
        """One step of `g`'s shape from `g.meta` (eagerly, or recorded while capturing)."""
        batch, length, meta = g.batch, g.length, g.meta
        span = torch.arange(length, device=meta.device).unsqueeze(0)
        last = (meta[3] - 1).unsqueeze(1)
        gather = (meta[2].unsqueeze(1) + torch.minimum(span, last)).reshape(-1)
        mask = (span <= last).view(batch, 1, 1, length)  # 4-D: transformers passes it through untouched
        real = (meta[5] != 0).view(1, batch, 1)
        plan = StepPlan(self.pool, (), functools.partial(_attend, self.pool, batch, length, meta[4], gather, real))
        out = run_planned(plan, lambda: model(input_ids=meta[0].view(batch, 1), position_ids=meta[1].view(batch, 1),
                                              attention_mask=mask, use_cache=False, logits_to_keep=1))
        logits: torch.Tensor = out.logits[:, -1]
        return logits


def _attend(pool: KVPool, batch: int, length: int, write: torch.Tensor, gather: torch.Tensor, real: torch.Tensor,
            module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor, scaling: float | None, window: int | None) -> tuple[torch.Tensor, None]:
    """One layer of a static decode step (module docstring); query [B, heads, 1, D]."""
    if window is not None:
        raise NotImplementedError("static decode steps have no sliding window")
    li = int(module.layer_idx)  # type: ignore[arg-type]
    pk, pv = pool.keys[li], pool.values[li]
    heads, kv_heads, dim = query.shape[1], key.shape[1], key.shape[3]
    for dst, new in ((pk, key), (pv, value)):
        fresh = new[:, :, 0].transpose(0, 1).to(dst.dtype)  # [kv_heads, B, D]
        dst.index_copy_(1, write, torch.where(real, fresh, dst.index_select(1, write)))
    k = pk.index_select(1, gather).view(kv_heads, batch, length, dim).transpose(0, 1).to(query.dtype)
    v = pv.index_select(1, gather).view(kv_heads, batch, length, dim).transpose(0, 1).to(query.dtype)
    # A key/value head's query heads attend as one block of `group` queries (as the eager decode does).
    o = F.scaled_dot_product_attention(query.reshape(batch, kv_heads, heads // kv_heads, dim), k, v,
                                       attn_mask=attention_mask, scale=scaling)
    return o.reshape(batch, heads, 1, dim).transpose(1, 2), None
