"""BASELINE COPY for bench/engine_memory.py (the engine before the KV pool; not used by clawbridge).

`TorchEngine`: an in-process torch `Sampler` over a transformers causal LM.

Threading:
- One worker thread owns the model and does all torch work. The asyncio side only validates,
  counts and enqueues (`sample`), and reads tokens from a per-request `asyncio.Queue` that the
  worker fills through `loop.call_soon_threadsafe`.
- The worker admits up to `max_running` requests; each has its own transformers `DynamicCache`.
  A round gives every running request one step (its prefill, or one decode token), so all running
  requests progress together. Requests past `max_running` wait, up to `max_queued` of them; past
  that `sample` raises `SamplerOverloaded` at once.
- Prefills run one request at a time. Decode steps of running requests on the same weights run
  as one batched forward (`clawbridge_local.batching`: left-padded caches, masked, explicit
  positions) unless `batch_decode` is off. A request's logprobs then equal its unbatched ones up
  to float summation order (<= 1e-4), so a seeded request's tokens are reproducible alone, and
  with neighbours except where a draw falls within that distance of a boundary; with
  `batch_decode` off they are the same whether or not other requests run beside it.

Invariants:
- The slot count (`in flight`) is requests accepted and not yet released; a request is released
  exactly once: when it ends (stop, length, error), or at once when its stream is closed or its
  consuming task is cancelled. The worker checks the cancel flag before every step, so a cancelled
  request takes at most the step already running.
- Weight publishing (`swap_weights`) happens in the worker between steps, never during a forward.
  The policy version of a stream is that of the weights captured in `sample`, and those are the
  weights every one of its steps runs on:
  * if no accepted request holds the current weights, they are updated in place;
  * otherwise the model is copied, the copy is updated and becomes current, and the old copy is
    freed when its last stream ends (peak memory: two copies while old streams finish).
- `load_version` keeps another committed version beside the current weights (a model copy held
  by the `TorchVersionSampler` it returns; the backend bounds how many, `max_loaded_versions`).
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
from typing import Any

import torch
from clawbridge_local.loading import load_causal_lm, resolve_device, resolve_dtype
from clawbridge_local.sampling import Choice, choose, make_generator
from clawbridge_local.serving import WeightSource

from clawbridge.serving.sampler import (
    FinishReason,
    PromptTooLong,
    SampledToken,
    SamplerFailed,
    SamplerOverloaded,
    SamplerUnavailable,
    SamplingParams,
)
from old_engine.batching import can_batch, decode_batch, plan_batches

log = logging.getLogger("clawbridge.engine")
WeightUpdate = Mapping[str, torch.Tensor] | Callable[[torch.nn.Module], None]
"""A new state (all or some parameters, by name) or a function that updates a module in place."""


@dataclass(eq=False)
class _Weights:
    """One published set of weights."""

    model: torch.nn.Module
    version: int
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
    cache: Any = None
    generator: torch.Generator | None = None
    last_token: int = -1
    generated: int = 0


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
    ) -> None:
        if max_running < 1 or max_queued < 0:
            raise ValueError("max_running must be >= 1 and max_queued >= 0")
        cfg: Any = getattr(model, "config", None)
        self.context_window: int = int(cfg.max_position_embeddings)
        """Maximum prompt + completion tokens (the model's max_position_embeddings)."""
        self.vocab_size: int = int(model.get_input_embeddings().num_embeddings)  # type: ignore[operator]
        self.device: torch.device = next(model.parameters()).device
        self.max_running = max_running
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.batch_decode = batch_decode
        """Batch the decode steps of running requests on the same weights (see `batching`)."""
        self.batched_steps = 0
        """Batched decode forwards run so far (each decodes one token for two or more requests)."""
        model.eval()
        self._lock = threading.Lock()
        self._current = _Weights(model, policy_version)
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
    ) -> TorchEngine:
        """Load `model` (a folder, or a cached HF id) and start the engine. Blocking."""
        dev = resolve_device(device)
        lm = load_causal_lm(
            model, dev, resolve_dtype(dtype, dev), local_files_only=local_files_only, progress=progress
        )
        return cls(lm, max_running=max_running, max_queued=max_queued, policy_version=policy_version,
                   batch_decode=batch_decode)

    # ------------------------------------------------------------------ asyncio side

    @property
    def policy_version(self) -> int:
        """The version new streams will be sampled from."""
        return self._current.version

    @property
    def in_flight(self) -> int:
        """Requests accepted and not yet released (running + waiting)."""
        return self._in_flight

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
                "and at least one must be left for the completion"
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
        # The old engine only loads full weights: LoRA merged as it was before adapters were served unmerged.
        from old_engine.merged import merged_update

        update = await asyncio.to_thread(merged_update, weights)  # type: ignore[arg-type]  # a LocalTrainer
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
                    while self._waiting and len(self._running) < self.max_running:
                        req = self._waiting.popleft()
                        if not req.cancelled:
                            self._running.append(req)
                    for req in [r for r in self._running if r.cancelled]:
                        self._running.remove(req)
                        req.cache = None
                    self._round()
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
                elif isinstance(item, _Swap):
                    item.done.set_exception(SamplerUnavailable("the torch engine shut down"))
                if item is _SHUTDOWN:
                    return False
            elif isinstance(item, _Request):
                self._waiting.append(item)
            elif isinstance(item, _Swap):
                self._apply_swap(item)

    def _round(self) -> None:
        """One step for every running request: prefills one by one, then the decode steps of
        requests on the same weights batched (`batching`), or one by one where they cannot be."""
        decoders: dict[int, list[_Request]] = {}
        for req in list(self._running):
            if req.cache is None or not (self.batch_decode and can_batch(req.cache)):
                self._step(req)
            else:
                decoders.setdefault(id(req.weights), []).append(req)
        for group in decoders.values():
            for part in plan_batches([r.cache.get_seq_length() for r in group]):
                batch = [group[i] for i in part]
                if len(batch) == 1:
                    self._step(batch[0])
                else:
                    self._step_batch(batch)

    def _step_batch(self, reqs: list[_Request]) -> None:
        """Decode one token for each of `reqs` (same weights) in one forward."""
        try:
            logits = decode_batch(reqs[0].weights.model, [r.cache for r in reqs], [r.last_token for r in reqs],
                                  self.device)
            choices = [choose(logits[b], r.params, r.generator) for b, r in enumerate(reqs)]
            self.batched_steps += 1
        except Exception as e:  # a bug in this engine, not an unreachable model
            log.exception("torch engine failed on a batched decode step")
            for r in reqs:
                self._finish(r, _End("cancelled", SamplerFailed(f"torch engine failed: {e!r}")))
            return
        for r, choice in zip(reqs, choices, strict=True):
            self._accept(r, choice)

    def _step(self, req: _Request) -> None:
        """Prefill (first call) or decode one token for `req`, and hand the token over."""
        model = req.weights.model
        try:
            if req.cache is None:
                from transformers import DynamicCache

                req.cache = DynamicCache(config=model.config)  # type: ignore[arg-type]
                req.generator = make_generator(req.params.seed, self.device)
                ids = torch.tensor([req.prompt], dtype=torch.long, device=self.device)
            else:
                ids = torch.tensor([[req.last_token]], dtype=torch.long, device=self.device)
            out = model(input_ids=ids, past_key_values=req.cache, use_cache=True, logits_to_keep=1)
            choice = choose(out.logits[0, -1], req.params, req.generator)
        except Exception as e:  # a bug in this engine, not an unreachable model
            log.exception("torch engine failed on a decode step")
            self._finish(req, _End("cancelled", SamplerFailed(f"torch engine failed: {e!r}")))
            return
        self._accept(req, choice)

    def _accept(self, req: _Request, choice: Choice) -> None:
        """Hand `choice` to the request's stream and end the request if it stops here."""
        req.last_token = choice.token_id
        req.generated += 1
        self._emit(req, choice.to_sampled())
        if choice.token_id in req.params.stop_token_ids:
            self._finish(req, _End("stop"))
        elif req.generated >= req.params.max_tokens:
            self._finish(req, _End("length"))

    def _finish(self, req: _Request, end: _End) -> None:
        if req in self._running:
            self._running.remove(req)
        req.cache = None
        self._release(req)
        self._emit(req, end)

    def _emit(self, req: _Request, item: SampledToken | _End) -> None:
        try:
            req.loop.call_soon_threadsafe(req.out.put_nowait, item)
        except RuntimeError:  # the request's event loop is closed: nobody is listening
            self._cancel(req)

    def _apply_swap(self, swap: _Swap) -> None:
        try:
            with torch.inference_mode(False), torch.no_grad():
                swap.done.set_result(self._pin(swap) if swap.pin else self._publish(swap.update, swap.version))
        except Exception as e:
            swap.done.set_exception(e)

    def _pin(self, swap: _Swap) -> int:
        """Load `swap.update` into a copy of the current model, kept apart as `swap.version`."""
        if isinstance(swap.update, Mapping):
            _check_state(self._current.model, swap.update)
        fresh = copy.deepcopy(self._current.model)
        _apply_update(fresh, swap.update)
        swap.pinned = _Weights(fresh, swap.version)
        return swap.version

    def _publish(self, update: WeightUpdate, version: int) -> int:
        if isinstance(update, Mapping):
            _check_state(self._current.model, update)
        with self._lock:
            cur = self._current
            if version <= cur.version:
                raise ValueError(f"new policy version {version} must be > {cur.version}")
            in_place = cur.users == 0
            if in_place:  # nobody holds these weights: new requests get the new version right away
                self._current = _Weights(cur.model, version)
        if in_place:
            _apply_update(cur.model, update)
            return version
        fresh = copy.deepcopy(cur.model)
        _apply_update(fresh, update)
        with self._lock:
            self._current = _Weights(fresh, version)
        return version


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
    if isinstance(update, Mapping):
        if any(k.endswith("lm_head.weight") for k in update):
            untie_output_embeddings(model)
        model.load_state_dict(dict(update), strict=False)
    else:
        update(model)
