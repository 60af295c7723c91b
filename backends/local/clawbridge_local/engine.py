"""`TorchEngine`: an in-process torch `Sampler` over a transformers causal LM.

Threading:
- One worker thread owns the model and does all torch work. The asyncio side only validates,
  counts and enqueues (`sample`), and reads tokens from a per-request `asyncio.Queue` that the
  worker fills through `loop.call_soon_threadsafe`.
- Keys and values live in one preallocated `KVPool` (`kv_budget_tokens` positions; see
  `clawbridge_local.kvpool`). The worker admits a waiting request (FIFO) while fewer than
  `max_running` run and the pool can reserve its prompt + max_tokens (after reusing a cached
  prefix and evicting least-recently-used ones); otherwise it waits, however long: a full budget
  never refuses a request. Past `max_running + max_queued` accepted requests `sample` raises
  `SamplerOverloaded` (429) at once.
- A round gives every running request one step (its prefill, or one decode token), so all running
  requests progress together. Prefills run one request at a time. Decode steps of running
  requests on the same base weights run as one forward (each row adds its own version's adapter,
  `lora_serving.AdapterHooks`) whose attention reads each request's region of the pool in place,
  unless `batch_decode` is off. A request's logprobs then equal its unbatched ones up to float
  summation order (<= 1e-4), so a seeded request's tokens are reproducible alone, and with
  neighbours except where a draw falls within that distance of a boundary; with `batch_decode`
  off they are the same whether or not other requests run beside it.
- On CUDA (`graphs="auto"`) decode steps without adapters run with fixed shapes, replayed from
  CUDA graphs (`clawbridge_local.decode_graphs`), and the prefills of a round on the same weights
  and adapter run packed in one forward (`clawbridge_local.packed_prefill`); both keep a request's
  logprobs equal to its unbatched eager ones up to float summation order, as batching does (so a
  prompt repeated after its prefix was evicted matches its first prefill to that order, not bit
  for bit, when either ran packed; a repeat served from its kept end is still bit-identical).
  `graphs="static"` runs the same fixed shapes without capture on any device (tests); `"off"`
  and CPU under `"auto"` keep the eager steps. Sampling reads the device once per step for all
  rows without truncation or alternatives (`sampling.choose_rows`).
- A request that ends by stop or length leaves its cached tokens in the pool as a prefix for a
  later prompt on the same weights (`KVPool.take_prefix`); publishing drops the replaced weights'.
- Repeatable: a prefill runs the prompt's uncached tokens in one forward and keeps the prompt's
  end (`KVPool.prefill`) with its cached prefix. A prompt sent again (a retry, a probe) while that
  prefix is cached takes all its keys/values and its end, and runs no forward before its first
  token, so it gets bit-identical logprobs; with the prefix evicted it runs the forward a cold
  prefill runs. A prompt that extends an earlier answer reuses keys computed token by token, equal
  to a cold prefill's to float summation order (<= 1e-4). For a model whose logits are not the
  output layer's alone (`KVPool.ends_are_exact` false, e.g. soft-capped logits) a prefill runs the
  prompt but its last token, then that token alone, and keeps no ends: the same guarantees, one
  more forward per request.

Invariants:
- The slot count (`in flight`) is requests accepted and not yet released; a request is released
  exactly once: when it ends (stop, length, error), or at once when its stream is closed or its
  consuming task is cancelled. The worker checks the cancel flag before every step, so a cancelled
  request takes at most the step already running.
- Weight publishing (`swap_weights`) happens in the worker between steps, never during a forward.
  The policy version of a stream is that of the weights captured in `sample`, and those are the
  weights every one of its steps runs on:
  * a LoRA adapter (`clawbridge_local.lora_serving.LoraAdapter`) is never merged: the new version
    is the same base weights with the new adapter, so nothing is copied and old streams keep
    theirs (the adapter is what a version costs);
  * full weights: if no accepted request holds the current weights, they are updated in place;
    otherwise the model is copied, the copy is updated and becomes current, and the old copy is
    freed when its last stream ends (peak memory: two copies while old streams finish).
  Either way the cached prefixes of the replaced weights are dropped. An engine that serves
  adapters refuses full weights (they would change the base every adapter is added to).
- Pool accounting: an admitted request holds one region until it ends; when no request runs,
  `kv_used_tokens` is 0 (only evictable prefixes remain).
- `load_version` keeps another committed version beside the current weights (its adapter, or a
  model copy for full weights, held by the `TorchVersionSampler` it returns; the backend bounds
  how many, `max_loaded_versions`).
  Its streams share the slots and rounds of all others; publishing never touches it.
  A state dict that names `lm_head.weight` unties a tied-embedding model first, so the input
  embedding keeps its own values (LoRA on the unembedding changes the output layer only).
- Logprobs follow `clawbridge_local.sampling` (float32, tempered, untruncated).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from clawbridge.serving.sampler import (
    FinishReason,
    PromptTooLong,
    SampledToken,
    SamplerFailed,
    SamplerOverloaded,
    SamplerUnavailable,
    SamplingParams,
)
from clawbridge_local import packed_prefill
from clawbridge_local.decode_graphs import StaticDecode
from clawbridge_local.kvbudget import KVBudget, MemoryShare, choose_budget, dtype_name
from clawbridge_local.kvpool import KVPool, Row, install
from clawbridge_local.loading import load_causal_lm, resolve_device, resolve_dtype
from clawbridge_local.lora_serving import AdapterHooks, LoraAdapter
from clawbridge_local.sampling import Choice, choose_rows, make_generator
from clawbridge_local.serving import WeightSource

log = logging.getLogger("clawbridge.engine")
WeightUpdate = LoraAdapter | Mapping[str, torch.Tensor] | Callable[[torch.nn.Module], None]
"""A LoRA adapter (served unmerged), a new state (all or some parameters, by name) or a function
that updates a module in place."""


GraphMode = Literal["auto", "off", "static"]
"""Fixed-shape steps: `auto` CUDA graphs on CUDA (eager on CPU), `static` fixed shapes without
capture on any device, `off` eager steps only (module docstring)."""


@dataclass(eq=False)
class _Weights:
    """One published set of weights."""

    model: torch.nn.Module
    version: int
    adapter: LoraAdapter | None = None
    """Added to `model`'s output by the engine's hooks (LoRA served unmerged); None: `model` alone."""
    users: int = 0
    """Accepted, unreleased requests that run on these weights (guarded by the engine lock)."""


@dataclass(frozen=True)
class _End:
    """Last item of a request's output queue."""

    reason: FinishReason
    error: Exception | None = None


@dataclass(eq=False)
class _Request:
    """One accepted sample request. Fields below `out` belong to the worker thread."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    """With max_tokens already clamped to the context."""
    weights: _Weights
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[SampledToken | _End]
    cancelled: bool = False
    released: bool = False
    start: int = -1
    """Start of the request's pool region (-1: none reserved)."""
    reserved: int = 0
    """Tokens reserved at `start`: prompt + max_tokens - 1 (the last token's KV is never needed)."""
    cached: int = 0
    """Tokens of `tokens` whose keys/values are in the region."""
    tokens: list[int] = field(default_factory=list)
    """Prompt then sampled tokens."""
    waited: bool = False
    """Found the KV budget full at least once."""
    generator: torch.Generator | None = None
    last_token: int = -1
    generated: int = 0
    ends: dict[int, torch.Tensor] = field(default_factory=dict)
    """Prompt ends within the cached tokens (`KVPool.prefill`), kept with the prefix at the end."""


@dataclass(eq=False)
class _Swap:
    """A weight publish waiting for the worker."""

    update: WeightUpdate
    version: int
    done: concurrent.futures.Future[int] = field(default_factory=concurrent.futures.Future)
    pin: bool = False
    """Load beside the current weights (`load_version`) instead of replacing them."""
    pinned: _Weights | None = None
    """The weights loaded, when `pin`."""


@dataclass(eq=False)
class _Score:
    """A `score` waiting for the worker: the logprobs of `completion` after `prompt` on `weights`."""

    weights: _Weights
    prompt: list[int]
    completion: list[int]
    done: concurrent.futures.Future[list[float]] = field(default_factory=concurrent.futures.Future)


_SHUTDOWN = object()


class TorchSampleStream:
    """The `SampleStream` of one `TorchEngine` request. Iterate it once."""

    def __init__(self, engine: TorchEngine, req: _Request) -> None:
        self._engine = engine
        self._req = req
        self.policy_version: int = req.weights.version
        """The version of the weights that sample this stream (fixed at creation)."""
        self.finish_reason: FinishReason | None = None
        """'stop', 'length' or 'cancelled' once the stream has ended."""

    def __aiter__(self) -> AsyncIterator[SampledToken]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[SampledToken]:
        try:
            while self.finish_reason is None:
                item = await self._req.out.get()
                if isinstance(item, _End):
                    if item.error is not None:
                        raise item.error
                    self.finish_reason = self.finish_reason or item.reason
                    return
                yield item
        finally:
            if self.finish_reason is None:  # consumer cancelled or left early: stop generating
                self.finish_reason = "cancelled"
                self._engine._cancel(self._req)

    async def aclose(self) -> None:
        """Stop sampling now and free the slot. Idempotent."""
        if self.finish_reason is None:
            self.finish_reason = "cancelled"
            self._engine._cancel(self._req)
            self._req.out.put_nowait(_End("cancelled"))  # wakes a consumer waiting in another task


class TorchVersionSampler:
    """A `Sampler` of one committed version that `TorchEngine.load_version` loaded beside the
    current weights; its streams run on the engine's worker and slots like any other."""

    def __init__(self, engine: TorchEngine, weights: _Weights) -> None:
        self._engine = engine
        self._weights = weights

    @property
    def policy_version(self) -> int:
        return self._weights.version

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> TorchSampleStream:
        return await self._engine._submit(prompt_ids, params, self._weights)

    async def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        """`SequenceScorer.score` on this version's weights."""
        return await self._engine._score(prompt_ids, completion_ids, self._weights)


class TorchEngine:
    """A `Sampler` running a transformers causal LM in this process (see module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_running: int = 8,
        max_queued: int = 64,
        policy_version: int = 0,
        retry_after_s: float = 1.0,
        batch_decode: bool = True,
        kv_budget_tokens: int | None = None,
        graphs: GraphMode = "auto",
        kv_dtype: torch.dtype | None = None,
        kv_budget_rule: MemoryShare | None = None,
    ) -> None:
        if max_running < 1 or max_queued < 0:
            raise ValueError("max_running must be >= 1 and max_queued >= 0")
        cfg: Any = getattr(model, "config", None)
        window = int(cfg.max_position_embeddings)
        dtype = kv_dtype or next(model.parameters()).dtype
        per_token = KVPool.bytes_per_token(model, dtype)
        if kv_budget_tokens or kv_budget_rule is None:
            self.kv_budget: KVBudget = choose_budget(
                context_window=window, max_running=max_running, bytes_per_token=per_token, dtype=dtype, fraction=0.0,
                free_bytes=None, trainer_bytes=0, explicit=kv_budget_tokens or 0)
        else:
            self.kv_budget = kv_budget_rule(model, window, max_running, per_token, dtype)
        """The KV pool's size and why (`clawbridge_local.kvbudget`)."""
        budget = self.kv_budget.tokens
        self.pool = KVPool.for_model(model, budget, dtype)
        """Keys and values of every request (see `clawbridge_local.kvpool`); worker thread only."""
        self.context_window: int = min(window, budget)
        """Maximum prompt + completion tokens: the model's max_position_embeddings, or the KV
        budget if smaller (one request must fit the budget)."""
        install(model)
        self.vocab_size: int = int(model.get_input_embeddings().num_embeddings)  # type: ignore[operator]
        self.device: torch.device = next(model.parameters()).device
        self.max_running = max_running
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.batch_decode = batch_decode
        """Batch the decode steps of running requests on the same base weights, any adapters."""
        self.batched_steps = 0
        """Batched decode forwards run so far (each decodes one token for two or more requests)."""
        self.packed_prefills = 0
        """Forwards that ran the prefills of two or more requests (`clawbridge_local.packed_prefill`)."""
        self.waited = 0
        """Requests that found the KV budget full and waited for room (so far)."""
        model.eval()
        fixed = graphs == "static" or (graphs == "auto" and self.device.type == "cuda")
        self.static: StaticDecode | None = (
            StaticDecode(self.pool, capture=graphs == "auto") if fixed and StaticDecode.supports(model) else None)
        """Fixed-shape decode steps (CUDA graphs under `auto` on CUDA); None: eager decode steps only."""
        self.one_forward_prefill: bool = KVPool.ends_are_exact(model)
        """A prefill is one forward and keeps its prompt's end (see "Repeatable" above)."""
        self._lock = threading.Lock()
        self._current = _Weights(model, policy_version)
        self._hooks = AdapterHooks()
        """The LoRA hooks of `model` (installed at the first adapter published or loaded)."""
        self._base_lent = False
        """`lend_base` was called: the in-process trainer reads `model`'s tensors as its base."""
        self._base_replaced = False
        """Full weights were published: the served model is no longer the folder's base."""
        self._in_flight = 0
        self._closed = False
        self._ids = itertools.count()
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._worker = threading.Thread(target=self._run, name="clawbridge-torch-engine", daemon=True)
        self._worker.start()

    @classmethod
    def load(
        cls,
        model: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_running: int = 8,
        max_queued: int = 64,
        policy_version: int = 0,
        progress: bool = True,
        local_files_only: bool = True,
        batch_decode: bool = True,
        kv_budget_tokens: int | None = None,
        graphs: GraphMode = "auto",
        kv_dtype: torch.dtype | None = None,
        kv_budget_rule: MemoryShare | None = None,
    ) -> TorchEngine:
        """Load `model` (a folder, or a cached HF id) and start the engine. Blocking."""
        dev = resolve_device(device)
        lm = load_causal_lm(
            model, dev, resolve_dtype(dtype, dev), local_files_only=local_files_only, progress=progress
        )
        return cls(lm, max_running=max_running, max_queued=max_queued, policy_version=policy_version,
                   batch_decode=batch_decode, kv_budget_tokens=kv_budget_tokens, graphs=graphs,
                   kv_dtype=kv_dtype, kv_budget_rule=kv_budget_rule)

    # ------------------------------------------------------------------ asyncio side

    @property
    def policy_version(self) -> int:
        """The version new streams will be sampled from."""
        return self._current.version

    @property
    def in_flight(self) -> int:
        """Requests accepted and not yet released (running + waiting)."""
        return self._in_flight

    def engine_status(self) -> dict[str, Any]:
        """`EngineStatus`: how full the KV budget is and how many requests run and wait (a snapshot
        read from any thread)."""
        st = self.pool.stats()
        running = len(self._running)
        budget = self.kv_budget
        return {"kv_budget_tokens": st.budget_tokens, "kv_dtype": dtype_name(budget.dtype),
                "kv_budget_bytes": budget.bytes, "kv_budget_reason": budget.reason, "kv_budget": budget.describe(),
                "kv_high_water_tokens": st.high_water_tokens, "kv_used_tokens": st.used_tokens,
                "kv_cached_tokens": st.cached_tokens, "kv_used_fraction": round(st.used_tokens / st.budget_tokens, 4),
                "prefix_entries": st.prefix_entries, "prefix_hits": st.prefix_hits,
                "prefix_tokens_reused": st.prefix_tokens_reused, "running": running,
                "waiting": max(0, self._in_flight - running), "waited_for_budget": self.waited}

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> TorchSampleStream:
        """Start sampling; raises PromptTooLong, SamplerOverloaded or SamplerUnavailable."""
        return await self._submit(prompt_ids, params, None)

    async def _submit(self, prompt_ids: Sequence[int], params: SamplingParams,
                      pinned: _Weights | None) -> TorchSampleStream:
        """`sample` on `pinned` weights (a `load_version`), or on the current ones when None."""
        if self._closed:
            raise SamplerUnavailable("the torch engine is shut down")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt must have at least one token")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if len(prompt) + 1 > self.context_window:
            raise PromptTooLong(
                f"prompt has {len(prompt)} tokens; the context window is {self.context_window} "
                "(the model's, or kv_budget_tokens if smaller) and at least one must be left for the completion"
            )
        fits = self.context_window - len(prompt)
        if params.max_tokens > fits:
            params = dataclasses.replace(params, max_tokens=fits)
        with self._lock:
            if self._in_flight >= self.max_running + self.max_queued:
                raise SamplerOverloaded(
                    f"{self._in_flight} requests in flight (max {self.max_running} running "
                    f"+ {self.max_queued} queued)",
                    retry_after_s=self.retry_after_s,
                )
            self._in_flight += 1
            weights = pinned or self._current
            weights.users += 1
        req = _Request(next(self._ids), prompt, params, weights, asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(req)
        if not self._worker.is_alive():  # it stopped after the check above
            self._cancel(req)
            raise SamplerUnavailable("the torch engine is shut down")
        return TorchSampleStream(self, req)

    async def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        """`clawbridge.serving.sampler.SequenceScorer`: untempered logprobs of `completion_ids` after
        `prompt_ids` on the current weights (one forward by the worker, between steps)."""
        return await self._score(prompt_ids, completion_ids, None)

    async def _score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                     pinned: _Weights | None) -> list[float]:
        if self._closed:
            raise SamplerUnavailable("the torch engine is shut down")
        prompt, completion = [int(t) for t in prompt_ids], [int(t) for t in completion_ids]
        ids = prompt + completion
        if not prompt or (ids and (min(ids) < 0 or max(ids) >= self.vocab_size)):
            raise ValueError(f"score needs a prompt, and token ids in [0, {self.vocab_size})")
        if len(ids) > self.context_window:
            raise PromptTooLong(f"{len(ids)} tokens to score; the context window is {self.context_window}")
        if not completion:
            return []
        with self._lock:
            weights = pinned or self._current
            weights.users += 1  # held like a stream's: full weights are not updated in place under it
        job = _Score(weights, prompt, completion)
        self._inbox.put(job)
        try:
            return await asyncio.wrap_future(job.done)
        finally:
            with self._lock:
                weights.users -= 1

    async def swap_weights(self, update: WeightUpdate, new_version: int) -> int:
        """Publish new weights for new streams as `new_version` (> current); return it.

        Applied by the worker between steps. Streams already created keep their weights and version
        (see module docstring for when that costs a model copy). A state dict is checked (names,
        shapes) before anything changes; a callable that raises while updating weights in place
        leaves them partly updated under `new_version`, so a caller must not reuse that version.
        """
        if self._closed:
            raise SamplerUnavailable("the torch engine is shut down")
        swap = _Swap(update, new_version)
        self._inbox.put(swap)
        return await asyncio.wrap_future(swap.done)

    async def load_version(self, update: WeightUpdate, version: int) -> TorchVersionSampler:
        """A `Sampler` of the current model with `update` applied, served as `version` beside the
        current weights (a copy of the model, made by the worker between steps, freed when the
        caller drops the sampler and its last stream ends). The current weights are unchanged."""
        if self._closed:
            raise SamplerUnavailable("the torch engine is shut down")
        swap = _Swap(update, version, pin=True)
        self._inbox.put(swap)
        await asyncio.wrap_future(swap.done)
        assert swap.pinned is not None
        return TorchVersionSampler(self, swap.pinned)

    async def publish(self, weights: WeightSource, version: int) -> int:
        """`ServingEngine.publish`: swap in `weights.weight_update()` as `version`."""
        update = await asyncio.to_thread(weights.weight_update)
        return await self.swap_weights(update, version)

    async def aclose(self) -> None:
        """`ServingEngine.aclose`: `shutdown` off the event loop."""
        await asyncio.to_thread(self.shutdown)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the worker (open streams end with SamplerUnavailable) and join it. Blocking."""
        self._closed = True
        self._inbox.put(_SHUTDOWN)
        self._worker.join(timeout_s)

    def _cancel(self, req: _Request) -> None:
        """Mark `req` cancelled and free its slot now (any thread)."""
        req.cancelled = True
        self._release(req)

    def _release(self, req: _Request) -> None:
        with self._lock:
            if req.released:
                return
            req.released = True
            self._in_flight -= 1
            req.weights.users -= 1

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while self._drain_inbox(block=not self._running and not self._waiting):
                    for req in [r for r in self._running if r.cancelled]:
                        self._running.remove(req)
                        self._free_region(req)
                    self._admit()
                    self._round()
                    if not self._running and not self._waiting:
                        self._hooks.release()  # idle: adapters unloaded since are freed now
        finally:  # shutdown, or a bug in this loop: nobody may wait forever
            self._closed = True
            for req in [*self._running, *self._waiting]:
                self._finish(req, _End("cancelled", SamplerUnavailable("the torch engine shut down")))
            self._running.clear()
            self._waiting.clear()
            self._drain_inbox(block=False)

    def _drain_inbox(self, block: bool) -> bool:
        """Take in new requests and apply swaps; False once shutdown was asked."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is _SHUTDOWN or self._closed:
                if isinstance(item, _Request):
                    self._finish(item, _End("cancelled", SamplerUnavailable("the torch engine shut down")))
                elif isinstance(item, _Swap | _Score):
                    item.done.set_exception(SamplerUnavailable("the torch engine shut down"))
                if item is _SHUTDOWN:
                    return False
            elif isinstance(item, _Request):
                self._waiting.append(item)
            elif isinstance(item, _Swap):
                self._apply_swap(item)
            elif isinstance(item, _Score):
                self._run_score(item)

    def _admit(self) -> None:
        """Move waiting requests (FIFO) to running while a slot is free and the KV budget has room."""
        while self._waiting and len(self._running) < self.max_running:
            req = self._waiting[0]
            if req.cancelled:
                self._waiting.popleft()
                continue
            if not self._reserve(req):
                if not self._running:  # cannot happen (need <= budget, nothing else holds room): never spin
                    self._waiting.popleft()
                    self._finish(req, _End("cancelled", SamplerFailed("torch engine: the KV pool lost track of room")))
                    continue
                if not req.waited:
                    req.waited = True
                    self.waited += 1
                return
            self._waiting.popleft()
            self._running.append(req)

    def _reserve(self, req: _Request) -> bool:
        """Reserve `req`'s region, reusing a cached prefix of its prompt where one exists."""
        pool = self.pool
        need = len(req.prompt) + req.params.max_tokens - 1
        entry = pool.take_prefix(req.weights, req.prompt)
        start = pool.allocate(need)
        if start is None and entry is not None:  # the entry itself may be what is in the way
            pool.keep_prefix(req.weights, entry.tokens, entry.start, len(entry.tokens), entry.ends)
            entry, start = None, pool.allocate(need)
        if start is None:
            return False
        req.start, req.reserved, req.tokens = start, need, list(req.prompt)
        if entry is not None:
            req.cached, req.ends = pool.reuse(entry, req.prompt, start)
        return True

    def _free_region(self, req: _Request, keep: bool = False) -> None:
        """Give `req`'s region back (worker thread); with `keep`, as a reusable prefix."""
        if req.start < 0:
            return
        if keep:
            self.pool.keep_prefix(req.weights, req.tokens[:req.cached], req.start, req.reserved, req.ends)
        else:
            self.pool.free(req.start, req.reserved)
        req.start = -1

    def _round(self) -> None:
        """One step for every running request: prefills (one by one, or packed by weights and
        adapter with fixed-shape steps on), then the decode steps of requests on the same base
        weights in one forward, each with its own version's adapter (or one by one without
        `batch_decode`)."""
        decoders: dict[int, list[_Request]] = {}
        packs: dict[tuple[int, int], list[_Request]] = {}
        for req in list(self._running):
            if req.generated == 0 and self._packable(req):
                packs.setdefault((id(req.weights.model), id(req.weights.adapter)), []).append(req)
            elif req.generated == 0 or not self.batch_decode:
                self._step([req])
            else:
                decoders.setdefault(id(req.weights.model), []).append(req)
        for pack in packs.values():
            while pack:
                take = 1
                while take < len(pack) and packed_prefill.fits([_new_row(r) for r in pack[:take + 1]]):
                    take += 1
                if take == 1:
                    self._step(pack[:1])
                else:
                    self._prefill_packed(pack[:take])
                pack = pack[take:]
        for group in decoders.values():
            self._step(group)

    def _packable(self, req: _Request) -> bool:
        """Whether `req`'s prefill may run packed with others (not a repeat served from its kept
        end, and one forward gives a prefill's logits)."""
        n = len(req.prompt)
        return (self.static is not None and self.one_forward_prefill
                and not (req.cached == n and n in req.ends))

    def _prefill_packed(self, reqs: list[_Request]) -> None:
        """The prefills of `reqs` (same weights and adapter) in one forward; hand the first tokens over."""
        try:
            for r in reqs:
                r.generator = make_generator(r.params.seed, self.device)
            self._hooks.set_rows([reqs[0].weights.adapter], self.device)
            rows = [_new_row(r) for r in reqs]
            out = packed_prefill.prefill_packed(self.pool, reqs[0].weights.model,
                                                [r.prompt[r.cached:] for r in reqs], rows)
            for r, (_, end) in zip(reqs, out, strict=True):
                r.ends[len(r.prompt)] = end
                r.cached = len(r.prompt)
            choices = choose_rows(torch.cat([lg for lg, _ in out]), [r.params for r in reqs],
                                  [r.generator for r in reqs])
        except Exception as e:  # a bug in this engine, not an unreachable model
            log.exception("torch engine failed on a packed prefill")
            for r in reqs:
                self._finish(r, _End("cancelled", SamplerFailed(f"torch engine failed: {e!r}")))
            return
        self.packed_prefills += 1
        for r, choice in zip(reqs, choices, strict=True):
            self._accept(r, choice)

    def _step(self, reqs: list[_Request]) -> None:
        """One forward: the prefill of one request (its first step), or one decode token for each
        of `reqs` (same base model; each row adds its own version's adapter); hand the tokens over."""
        try:
            if reqs[0].generated == 0:
                req = reqs[0]
                req.generator = make_generator(req.params.seed, self.device)
                self._hooks.set_rows([req.weights.adapter], self.device)
                logits = self._prefill(req)
            else:
                rows = [Row(r.start, r.cached, 1) for r in reqs]
                adapters = [r.weights.adapter for r in reqs]
                self._hooks.set_rows(adapters, self.device)
                fixed = None
                if self.static is not None and all(a is None for a in adapters):
                    fixed = self.static.forward(reqs[0].weights.model, [r.last_token for r in reqs], rows)
                logits = fixed if fixed is not None else self.pool.forward(
                    reqs[0].weights.model, [[r.last_token] for r in reqs], rows)
                for r in reqs:
                    r.cached += 1
            choices = choose_rows(logits, [r.params for r in reqs], [r.generator for r in reqs])
            if len(reqs) > 1:
                self.batched_steps += 1
        except Exception as e:  # a bug in this engine, not an unreachable model
            log.exception("torch engine failed on a forward")
            for r in reqs:
                self._finish(r, _End("cancelled", SamplerFailed(f"torch engine failed: {e!r}")))
            return
        for r, choice in zip(reqs, choices, strict=True):
            self._accept(r, choice)

    def _prefill(self, req: _Request) -> torch.Tensor:
        """The logits [1, vocab] of `req`'s prompt's last position, its keys/values cached (see
        "Repeatable" in the module docstring)."""
        model, prompt = req.weights.model, req.prompt
        n = len(prompt)
        end = req.ends.get(n)
        if end is not None and req.cached == n:  # the same prompt again: its kept end
            return self.pool.logits_at(model, end)
        if not self.one_forward_prefill:
            head = n - 1 - req.cached
            if head > 0:
                self.pool.forward(model, [prompt[req.cached:-1]], [Row(req.start, req.cached, head)])
                req.cached += head
            logits = self.pool.forward(model, [prompt[-1:]], [Row(req.start, req.cached, 1)])
        else:
            logits, req.ends[n] = self.pool.prefill(model, prompt[req.cached:], Row(req.start, req.cached, n - req.cached))
        req.cached = n
        return logits

    def _accept(self, req: _Request, choice: Choice) -> None:
        """Hand `choice` to the request's stream and end the request if it stops here."""
        req.last_token = choice.token_id
        req.tokens.append(choice.token_id)
        req.generated += 1
        self._emit(req, choice.to_sampled())
        if choice.token_id in req.params.stop_token_ids:
            self._finish(req, _End("stop"))
        elif req.generated >= req.params.max_tokens:
            self._finish(req, _End("length"))

    def _finish(self, req: _Request, end: _End) -> None:
        if req in self._running:
            self._running.remove(req)
        self._free_region(req, keep=end.error is None and end.reason in ("stop", "length") and not req.cancelled)
        self._release(req)
        self._emit(req, end)

    def _emit(self, req: _Request, item: SampledToken | _End) -> None:
        try:
            req.loop.call_soon_threadsafe(req.out.put_nowait, item)
        except RuntimeError:  # the request's event loop is closed: nobody is listening
            self._cancel(req)

    def _run_score(self, job: _Score) -> None:
        """One forward over prompt + completion on the job's weights (its adapter applied, plain
        attention: no pool region), then float32 log-softmax of the untempered logits."""
        try:
            ids = torch.tensor([job.prompt + job.completion], dtype=torch.long, device=self.device)
            n = len(job.completion)
            self._hooks.set_rows([job.weights.adapter], self.device)
            logits = job.weights.model(input_ids=ids, use_cache=False, logits_to_keep=n + 1).logits[0, :-1].float()
            target = ids[0, -n:].unsqueeze(-1)
            job.done.set_result(torch.log_softmax(logits, dim=-1).gather(-1, target).squeeze(-1).tolist())
        except Exception as e:
            log.exception("torch engine failed to score a sequence")
            job.done.set_exception(SamplerFailed(f"torch engine failed to score: {e!r}"))

    def _apply_swap(self, swap: _Swap) -> None:
        try:
            with torch.inference_mode(False), torch.no_grad():
                swap.done.set_result(self._pin(swap) if swap.pin else self._publish(swap.update, swap.version))
        except Exception as e:
            swap.done.set_exception(e)

    def _pin(self, swap: _Swap) -> int:
        """Load `swap.update` into a copy of the current model, kept apart as `swap.version` (an
        adapter: beside the shared base, no copy)."""
        if isinstance(swap.update, LoraAdapter):
            model = self._current.model
            swap.pinned = _Weights(model, swap.version, self._hooks.prepare(model, swap.update))
            return swap.version
        self._refuse_full_weights()
        if isinstance(swap.update, Mapping):
            _check_state(self._current.model, swap.update)
        fresh = copy.deepcopy(self._current.model)
        _apply_update(fresh, swap.update)
        swap.pinned = _Weights(fresh, swap.version)
        return swap.version

    def lend_base(self) -> torch.nn.Module | None:
        """The base model, whose tensors the in-process LoRA trainer's frozen weights are
        (`clawbridge_local.trainer.model.over_base`); None once full weights were published (it
        is no longer the base). From now on only adapters are published or loaded: full weights
        would change the trainer's base."""
        if self._base_replaced:
            return None
        self._base_lent = True
        return self._current.model

    def _refuse_full_weights(self) -> None:
        if self._hooks.installed or self._base_lent:
            raise ValueError("this engine serves LoRA adapters over shared base weights; publish an adapter, "
                             "not full weights")

    def _publish(self, update: WeightUpdate, version: int) -> int:
        if isinstance(update, LoraAdapter):
            cur = self._current
            if version <= cur.version:
                raise ValueError(f"new policy version {version} must be > {cur.version}")
            served = _Weights(cur.model, version, self._hooks.prepare(cur.model, update))
            with self._lock:
                self._current = served
            self.pool.drop_prefixes(cur)
            return version
        self._refuse_full_weights()
        if isinstance(update, Mapping):
            _check_state(self._current.model, update)
        self._base_replaced = True
        with self._lock:
            cur = self._current
            if version <= cur.version:
                raise ValueError(f"new policy version {version} must be > {cur.version}")
            in_place = cur.users == 0
            if in_place:  # nobody holds these weights: new requests get the new version right away
                self._current = _Weights(cur.model, version)
        self.pool.drop_prefixes(cur)  # their keys/values came from the weights being replaced
        if in_place:
            before = _addresses(cur.model)
            _apply_update(cur.model, update)  # copies into the tensors: the decode graphs stay valid
            if self.static is not None and _addresses(cur.model) != before:  # e.g. an output layer untied
                self.static.forget(cur.model)
            return version
        fresh = copy.deepcopy(cur.model)
        _apply_update(fresh, update)
        with self._lock:
            self._current = _Weights(fresh, version)
        return version


def _addresses(model: torch.nn.Module) -> list[int]:
    """Where `model`'s parameters and buffers are (a captured graph reads them there)."""
    return [t.data_ptr() for t in (*model.parameters(), *model.buffers())]


def _new_row(req: _Request) -> Row:
    """The pool row of `req`'s prefill: its prompt's uncached tokens."""
    return Row(req.start, req.cached, len(req.prompt) - req.cached)


def _check_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Raise before anything changes if `state` names unknown tensors or has wrong shapes."""
    own = model.state_dict()
    unknown = [k for k in state if k not in own]
    if unknown:
        raise ValueError(f"unknown weight names: {unknown[:5]}")
    bad = [k for k, v in state.items() if tuple(v.shape) != tuple(own[k].shape)]
    if bad:
        raise ValueError(f"shape mismatch for: {bad[:5]}")


def untie_output_embeddings(model: torch.nn.Module) -> bool:
    """Give a tied-embedding model its own output matrix (a copy of the shared one), so a new
    `lm_head.weight` (e.g. a merged LoRA of the unembedding) leaves the input embedding as it is.
    Returns whether anything was untied."""
    lm: Any = model
    out, inp = lm.get_output_embeddings(), lm.get_input_embeddings()
    if out is None or inp is None or out.weight is not inp.weight:
        return False
    out.weight = torch.nn.Parameter(inp.weight.detach().clone(), requires_grad=False)
    lm.config.tie_word_embeddings = False
    return True


def _apply_update(model: torch.nn.Module, update: WeightUpdate) -> None:
    if isinstance(update, LoraAdapter):
        raise TypeError("an adapter is served beside the weights (AdapterHooks), never applied to them")
    if isinstance(update, Mapping):
        if any(k.endswith("lm_head.weight") for k in update):
            untie_output_embeddings(model)
        model.load_state_dict(dict(update), strict=False)
    else:
        update(model)
