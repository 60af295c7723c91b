"""`SGLangEngine`: a `Sampler` over SGLang's native HTTP API (sglang 0.5.x), no sglang import.

Wire (checked against sglang 0.5.x `entrypoints/http_server.py` and `managers/io_struct.py`):
- `POST /generate` with `input_ids`, `sampling_params` (max_new_tokens, temperature, top_p, top_k,
  stop_token_ids, sampling_seed), `return_logprob: true`, `top_logprobs_num`, `lora_path` (a loaded
  adapter's name) and `stream: true`. Each SSE event `data: {...}` carries `meta_info` with
  `completion_tokens` (a running count), `output_token_logprobs` ([logprob, token_id, text] per
  sampled token; cumulative in 0.5.x, incremental accepted too) and `finish_reason` (null, then
  `{"type": "stop"|"length"|"abort", ...}`); `data: [DONE]` ends it. Errors inside a stream arrive
  as `data: {"error": {"message": ...}}` on an HTTP 200.
- Token ids come from `output_token_logprobs` (the ids the logprobs belong to); `output_ids`, whose
  streaming semantics changed within 0.5.x, is cross-checked when its length is unambiguous.
- Logprobs are SGLang's defaults: after temperature, before top-p/top-k (greedy: plain softmax),
  the same as `clawbridge.serving.sampler.SampledToken.logprob`, provided the server does not run with
  `SGLANG_RETURN_ORIGINAL_LOGPROB`. Sampling parameters are always sent in full, so the model's
  `generation_config.json` defaults (`--sampling-defaults model`) never apply. `sampling_seed` is
  honoured only by servers started with `--enable-deterministic-inference`.

Invariants:
- `sample` returns only after the first event arrived, so every failure to start (overload,
  rejection, timeout, unreachable server) is raised by `sample`, and a stream that was returned is
  inside SGLang (it holds SGLang's model-update reader lock).
- Policy version per stream: fixed in `sample`. LoRA: version v is adapter `v{v}` (`lora_path`);
  version 0 (and full fine-tuning) is the served base path. Streams are counted per version; a
  LoRA version is unloaded once it is neither current, nor held (`held`), nor used by a stream.
  A stream counts as using its adapter from the moment that adapter is loaded for it: a start that
  waits for a load never pins an adapter it does not run on yet (else two starts can each wait
  for the other's room).
- Which versions are kept beside the current one is recorded once, by their owner
  (`clawbridge.serving.versions.LoadedVersions`, which the engine asks through `held`); the engine keeps
  only what the server has loaded (`loaded_versions`), each kept version's adapter folder and the
  streams per version. `load_lora_version` makes a committed LoRA version (`NAME@N`, a user's
  adapter) servable beside the current one: its folder is remembered and loaded now; its sampler's
  streams run on that adapter; the owner `release`s it when it stops holding it. Full fine-tuning
  serves one set of weights per server, so only the current version is servable there.
- Many adapters (issue 32 §2) use SGLang's own multi-LoRA machinery: the server holds at most
  `max_loaded_loras` adapters in CPU memory (`--max-loaded-loras`, which refuses a load past it)
  and moves the ones running requests need into its `--max-loras-per-batch` GPU slots itself
  (`--lora-eviction-policy`). The engine never asks for more than that: before a load it unloads
  the least recently used adapter that no stream uses and that is not the current version, or
  waits for one (`SamplerOverloaded` after `read_timeout_s`). A kept version unloaded so is loaded
  again from its folder when a stream asks for it. `loaded_versions` is what the server holds.
- Full publish drains: new streams wait (no error) while `/update_weights_from_disk` runs; SGLang
  itself lets in-flight requests finish on the old weights before loading (its writer lock), so
  every stream finishes on the weights it started on. The wait is bounded by the longest stream.
- Replicas (several servers of one model, `sglang_urls`): each stream goes to the replica with
  the fewest streams of this engine. A publish reaches EVERY replica before the version is
  announced (new streams sample it). When it fails on one: LoRA: the adapter is unloaded again
  where it loaded (an adapter no request names is harmless if that fails too) and every replica
  serves the old version. Full weights: SGLang restores its old weights itself when a load fails;
  the replicas that did load are loaded back from the served folder; a replica whose state is not
  known (no answer, or the load back failed) is taken out of rotation, so no stream is ever
  sampled by weights other than its recorded version. The next full publish that succeeds on every
  replica brings them all back. sglang-router (0.3.2) has no weight-update routes (only
  /flush_cache and /get_loads reach every worker), which is why the engine addresses replicas itself.
- Cancelling (`aclose()` or cancelling the consuming task) closes the HTTP stream; SGLang aborts a
  request whose client disconnected. In flight streams are bounded (`max_in_flight`): past it
  `sample` raises `SamplerOverloaded` at once, as do SGLang's 429/503 and queue-full aborts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from clawbridge.serving.sampler import (
    PromptTooLong,
    SamplerError,
    SamplerOverloaded,
    SamplerUnavailable,
    SamplingParams,
)
from clawbridge_local.serving import WeightSource
from clawbridge_local.sglang_errors import error_message, request_error, response_json, transport_error
from clawbridge_local.sglang_stream import SGLangSampleStream

log = logging.getLogger("clawbridge.sglang")


def lora_name(version: int) -> str:
    """The adapter name a LoRA policy version is loaded under."""
    return f"v{version}"


class SGLangVersionSampler:
    """A `Sampler` of one pinned LoRA version (`SGLangEngine.load_lora_version`)."""

    def __init__(self, engine: SGLangEngine, version: int, adapter: str | None) -> None:
        self._engine = engine
        self._pinned = (version, adapter)

    @property
    def policy_version(self) -> int:
        return self._pinned[0]

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> SGLangSampleStream:
        return await self._engine._sample(prompt_ids, params, self._pinned)


class SGLangEngine:
    """A `Sampler` (and publisher) over one SGLang server or several replicas (see module docstring)."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        context_window: int,
        lora: bool = False,
        policy_version: int = 0,
        max_in_flight: int = 72,
        read_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        publish_timeout_s: float = 1800.0,
        retry_after_s: float = 1.0,
        transport: httpx.AsyncBaseTransport | None = None,
        served_path: str | None = None,
        max_loaded_loras: int | None = None,
        held: Callable[[int], bool] | None = None,
    ) -> None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        self.base_urls = [u.rstrip("/") for u in urls]
        """Every replica, e.g. [http://127.0.0.1:30000, http://10.0.0.2:30000]."""
        self.base_url = self.base_urls[0]
        """The first replica."""
        self.context_window = context_window
        """Maximum prompt + completion tokens (the server's max_model_len)."""
        self.lora = lora
        """Whether versions > 0 are LoRA adapters (else full weights loaded from disk)."""
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.publish_timeout_s = publish_timeout_s
        self._clients = [httpx.AsyncClient(
            base_url=url,
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
            transport=transport,
        ) for url in self.base_urls]
        self._client = self._clients[0]
        self._load = [0] * len(self._clients)
        """This engine's streams per replica."""
        self.down: set[int] = set()
        """Replicas out of rotation: a failed full publish left their weights unknown."""
        self._served_path = served_path
        """The folder the served full weights were loaded from (a failed publish loads it back)."""
        self._version = policy_version
        self._adapter: str | None = lora_name(policy_version) if lora and policy_version > 0 else None
        self._users: Counter[int] = Counter()
        """Streams returned or starting, per policy version."""
        self.max_loaded_loras = max_loaded_loras
        """Adapters the server may hold at once (its `--max-loaded-loras`; None: no limit)."""
        self.read_timeout_s = read_timeout_s
        self._loaded: OrderedDict[int, None] = OrderedDict.fromkeys([policy_version] if self._adapter else [])
        """LoRA versions loaded on the server, least recently used first."""
        self._folders: dict[int, str] = {}
        """The adapter folder of each kept LoRA version (to load it again after it was unloaded for room)."""
        self._room = asyncio.Event()
        """Set whenever a stream ends (an adapter may have become free to unload)."""
        self._load_lock = asyncio.Lock()
        """Loads and the unloads that make room for them never interleave."""
        self.lora_loads = 0
        """Adapters loaded on the server so far (a reload after an unload for room counts again)."""
        self._open = asyncio.Event()
        self._open.set()
        self._starting = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._publish_lock = asyncio.Lock()
        self._unloads: set[asyncio.Task[bool]] = set()
        self._held: Callable[[int], bool] = held if held is not None else (lambda _version: False)
        """Whether the owner of the versions served beside the current one keeps `version`
        (`clawbridge.serving.versions.LoadedVersions.holds`); such a version is unloaded only for room."""
        self._closed = False

    @classmethod
    async def connect(cls, base_url: str | Sequence[str], **kwargs: Any) -> SGLangEngine:
        """An engine for the server(s) at `base_url`, with the context window from `/v1/models`
        (the smallest of the replicas')."""
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        contexts, paths = [], []
        for url in urls:
            async with httpx.AsyncClient(
                base_url=url.rstrip("/"), timeout=30.0, transport=kwargs.get("transport")
            ) as client:
                try:
                    info = (await client.get("/get_model_info")).raise_for_status().json()
                    models = (await client.get("/v1/models")).raise_for_status().json()
                except httpx.HTTPError as exc:
                    raise transport_error(exc, f"connect to {url}") from None
            if not info.get("is_generation", True):
                raise SamplerUnavailable(f"{url} serves a non-generation model")
            contexts.append(int(models["data"][0]["max_model_len"]))
            paths.append(info.get("model_path"))
        kwargs.setdefault("served_path", paths[0] if len(set(paths)) == 1 else None)
        return cls(urls, context_window=min(contexts), **kwargs)

    @property
    def policy_version(self) -> int:
        """The version new streams will be sampled from."""
        return self._version

    @property
    def in_flight(self) -> int:
        """Streams started (also those waiting for their adapter to load) and not yet ended or closed."""
        return sum(self._load)

    @property
    def loaded_versions(self) -> set[int]:
        """LoRA versions currently loaded on the server (for tests and status)."""
        return set(self._loaded)

    def _body(self, prompt: list[int], params: SamplingParams, adapter: str | None) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "stop_token_ids": list(params.stop_token_ids),
        }
        if params.seed is not None:
            sp["sampling_seed"] = params.seed
        body: dict[str, Any] = {
            "input_ids": prompt,
            "sampling_params": sp,
            "return_logprob": True,
            "top_logprobs_num": params.top_logprobs,
            "stream": True,
        }
        if adapter is not None:
            body["lora_path"] = adapter
        return body

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> SGLangSampleStream:
        """Start sampling; raises PromptTooLong, SamplerOverloaded, SamplerTimeout or SamplerUnavailable."""
        return await self._sample(prompt_ids, params, None)

    async def _sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                      pinned: tuple[int, str | None] | None) -> SGLangSampleStream:
        """`sample` on a pinned (version, adapter), or on the current one when None."""
        if self._closed:
            raise SamplerUnavailable("the sglang engine is closed")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt must have at least one token")
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if len(prompt) + 1 > self.context_window:
            raise PromptTooLong(
                f"prompt has {len(prompt)} tokens; the context window is {self.context_window}"
            )
        params = dataclasses.replace(
            params, max_tokens=min(params.max_tokens, self.context_window - len(prompt))
        )
        if self.in_flight >= self.max_in_flight:
            raise SamplerOverloaded(
                f"{self.in_flight} sglang requests in flight (max {self.max_in_flight})",
                retry_after_s=self.retry_after_s,
            )
        await self._open.wait()  # a full-weight publish is loading
        version, adapter = pinned or (self._version, self._adapter)
        replica = self._pick()
        client = self._clients[replica]
        self._load[replica] += 1
        self._starting += 1
        self._idle.clear()
        response: httpx.Response | None = None
        counted = False
        try:
            if adapter is not None:
                await self._ensure_loaded(version)
            # Counted only once loaded (no await since): a start still waiting for `_load_lock` must
            # not keep a loaded adapter from being unloaded for room, or the holder of the lock may
            # wait for room that only that start could give back (a deadlock until read_timeout_s).
            self._users[version] += 1
            counted = True
            request = client.build_request(
                "POST", "/generate", json=self._body(prompt, params, adapter)
            )
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise transport_error(exc, "/generate") from None
            if response.status_code != 200:
                await response.aread()
                raise request_error(response.status_code, error_message(response_json(response)), self.retry_after_s)
            stream = SGLangSampleStream(response, version, params,
                                        release=functools.partial(self._release, version, replica),
                                        retry_after_s=self.retry_after_s)
            await stream._prime()
            return stream
        except BaseException:
            if response is not None:
                await response.aclose()
            if counted:
                self._release(version, replica)
            else:
                self._load[replica] -= 1
            raise
        finally:
            self._starting -= 1
            if self._starting == 0:
                self._idle.set()

    def _pick(self) -> int:
        """The replica in rotation with the fewest streams (the first of equals)."""
        up = [i for i in range(len(self._clients)) if i not in self.down]
        if not up:
            raise SamplerUnavailable("no sglang replica is in rotation (a failed publish left their weights "
                                     "unknown); the next successful publish brings them back")
        return min(up, key=lambda i: self._load[i])

    def _release(self, version: int, replica: int = 0) -> None:
        """A stream of `version` ended: unload that LoRA version if nothing needs it any more."""
        self._load[replica] -= 1
        self._users[version] -= 1
        self._room.set()
        if self._users[version] <= 0:
            del self._users[version]
            if version in self._loaded and version != self._version and not self._held(version) \
                    and not self._closed:
                task = asyncio.get_running_loop().create_task(self._unload_outside_a_load(version))
                self._unloads.add(task)
                task.add_done_callback(self._unloads.discard)

    async def _unload_outside_a_load(self, version: int) -> bool:
        """`_unload` under `_load_lock`: a load never counts room that an unload still in flight
        has not given back on the server yet (the server would refuse it past max_loaded_loras)."""
        async with self._load_lock:
            return await self._unload(version)

    async def _unload(self, version: int, for_room: bool = False) -> bool:
        """Unload `version` from the server unless a stream uses it or it is current; unless
        `for_room`, a kept version stays too. Whether it was unloaded."""
        if version not in self._loaded or self._users[version] > 0 or version == self._version \
                or (self._held(version) and not for_room):
            return False
        self._loaded.pop(version, None)
        failed = await self._post_each("/unload_lora_adapter", {"lora_name": lora_name(version)})
        if failed:  # stays loaded there; retried at the next publish
            self._loaded[version] = None
            for i, exc in failed.items():
                log.warning("could not unload LoRA %s from %s: %s", lora_name(version), self.base_urls[i], exc)
            return False
        return True

    async def _ensure_loaded(self, version: int) -> None:
        """Make sure LoRA `version` (used by a starting stream) is loaded on the server: it is, or
        it is loaded again from its folder after room is made (module invariants)."""
        if version in self._loaded:
            self._loaded.move_to_end(version)
            return
        async with self._load_lock:
            if version in self._loaded:
                self._loaded.move_to_end(version)
                return
            folder = self._folders.get(version)
            if folder is None:
                raise SamplerUnavailable(f"LoRA version {version} is no longer kept on the sglang server")
            await self._make_room(1)
            await self._load_adapter(folder, version)

    async def _make_room(self, n: int) -> None:
        """Unload least recently used adapters that no stream uses (not the current version) until
        `n` more fit under `max_loaded_loras`; wait for streams to end while none can go. Call it
        holding `_load_lock`."""
        limit = self.max_loaded_loras
        if limit is None:
            return
        deadline = time.monotonic() + self.read_timeout_s
        while len(self._loaded) + n > limit:
            idle = [v for v in self._loaded if self._users[v] == 0 and v != self._version]
            if idle:
                if not await self._unload(idle[0], for_room=True) and self._users[idle[0]] == 0:
                    raise SamplerUnavailable(f"the sglang server would not unload LoRA {lora_name(idle[0])} to make "
                                             f"room for another (max_loaded_loras {limit})")
                continue
            self._room.clear()
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                await asyncio.wait_for(self._room.wait(), left)
            except TimeoutError:
                raise SamplerOverloaded(
                    f"all {limit} LoRA adapters the sglang server holds (max_loaded_loras) are in use by "
                    "running streams", retry_after_s=self.retry_after_s) from None

    async def drain_unloads(self) -> None:
        """Wait for background unloads (tests, shutdown)."""
        while self._unloads:
            await asyncio.gather(*list(self._unloads), return_exceptions=True)

    async def _post_each(self, path: str, body: dict[str, Any],
                         replicas: Sequence[int] | None = None) -> dict[int, SamplerError]:
        """POST to every replica (or `replicas`) at once; the failures by replica."""
        targets = list(range(len(self._clients))) if replicas is None else list(replicas)
        results = await asyncio.gather(*(self._post(path, body, i) for i in targets), return_exceptions=True)
        failed: dict[int, SamplerError] = {}
        for i, result in zip(targets, results, strict=True):
            if isinstance(result, SamplerError):
                failed[i] = result
            elif isinstance(result, BaseException):
                raise result
        return failed

    def _publish_failed(self, version: int, failed: dict[int, SamplerError], state: str) -> SamplerError:
        """The error of a publish that failed on `failed` (one replica alone: its own error)."""
        if len(self._clients) == 1:
            return failed[0]
        where = "; ".join(f"{self.base_urls[i]}: {exc}" for i, exc in sorted(failed.items()))
        return SamplerUnavailable(f"publishing version {version} failed on {len(failed)} of "
                                  f"{len(self._clients)} sglang replicas ({where}); not announced: {state}")

    async def _post(self, path: str, body: dict[str, Any], replica: int = 0) -> Any:
        try:
            r = await self._clients[replica].post(path, json=body, timeout=self.publish_timeout_s)
        except httpx.HTTPError as exc:
            raise transport_error(exc, path) from None
        data = response_json(r)
        if r.status_code != 200 or (isinstance(data, dict) and data.get("success") is False):
            raise request_error(
                r.status_code if r.status_code != 200 else 500, error_message(data), self.retry_after_s
            )
        return data

    # ---- publishing ---------------------------------------------------------------------------
    async def publish(self, weights: WeightSource, version: int) -> int:
        """`ServingEngine.publish`: load `weights.export()` as an adapter or as full weights."""
        folder = await asyncio.to_thread(weights.export)
        if self.lora:
            return await self.publish_lora(folder, version)
        return await self.publish_full(folder, version)

    async def publish_lora(self, adapter_dir: str | Path, version: int) -> int:
        """Load the peft adapter folder as `v{version}` and serve it to new streams; return `version`."""
        if not self.lora:
            raise ValueError("this engine serves full weights; use publish_full")
        async with self._publish_lock:
            self._check_version(version)
            async with self._load_lock:
                await self._make_room(1)
                await self._load_adapter(adapter_dir, version)
            previous = self._version
            self._version, self._adapter = version, lora_name(version)
            self._folders[version] = str(adapter_dir)
            if not self._held(previous):
                self._folders.pop(previous, None)
            for old in [v for v in self._loaded if v != version]:
                if self._users[old] == 0:
                    await self._unload_outside_a_load(old)
        return version

    async def _load_adapter(self, adapter_dir: str | Path, version: int) -> None:
        """Load the adapter as `v{version}` on every replica, or on none (unloaded again where it
        loaded) and raise."""
        name = lora_name(version)
        failed = await self._post_each("/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)})
        if failed:
            loaded = [i for i in range(len(self._clients)) if i not in failed]
            for i, exc in (await self._post_each("/unload_lora_adapter", {"lora_name": name}, loaded)).items():
                log.warning("LoRA %s stays loaded (unused) on %s: %s", name, self.base_urls[i], exc)
            raise self._publish_failed(version, failed, f"every replica still serves version {self._version}")
        self._loaded[version] = None
        self.lora_loads += 1

    async def load_lora_version(self, adapter_dir: str | Path | None, version: int) -> SGLangVersionSampler:
        """A sampler of committed LoRA `version` (its peft adapter folder; None for version 0, the
        base), loaded now unless it is. Called by the owner of the versions kept (`held`), which
        `release`s it when it stops holding it (module invariants: it may be unloaded for room
        meanwhile, and is loaded again from its folder when sampled)."""
        if not self.lora:
            raise ValueError("this engine serves full weights: only the current version can be sampled")
        async with self._publish_lock:
            if self._closed:
                raise SamplerUnavailable("the sglang engine is closed")
            if version > 0:
                if adapter_dir is None and version not in self._folders:
                    raise ValueError(f"LoRA version {version} needs its adapter folder")
                folder = str(adapter_dir) if adapter_dir is not None else self._folders[version]
                async with self._load_lock:
                    if version not in self._loaded:
                        await self._make_room(1)
                        await self._load_adapter(folder, version)
                self._folders[version] = folder
        return SGLangVersionSampler(self, version, lora_name(version) if version > 0 else None)

    async def release(self, version: int) -> None:
        """The owner no longer holds `version`: unload it now, or when its last stream ends."""
        if version != self._version:
            self._folders.pop(version, None)
        if not self._closed and self._users[version] == 0:
            await self._unload_outside_a_load(version)

    async def unload_unknown(self, version: int) -> None:
        """Unload LoRA `version` from every replica although this engine did not load it (an
        earlier process may have, on a server that outlived it: a forgotten user's adapter).
        A replica that does not hold it answers an error, which is the expected answer."""
        if self._closed or version == self._version or version in self._loaded:
            return
        failed = await self._post_each("/unload_lora_adapter", {"lora_name": lora_name(version)})
        for i, exc in failed.items():
            log.debug("LoRA %s was not loaded on %s (%s)", lora_name(version), self.base_urls[i], exc)

    async def publish_full(self, model_dir: str | Path, version: int) -> int:
        """Load full weights from a transformers folder; new streams wait meanwhile; return `version`."""
        if self.lora:
            raise ValueError("this engine serves LoRA adapters; use publish_lora")
        async with self._publish_lock:
            self._check_version(version)
            self._open.clear()
            try:
                await self._idle.wait()  # every started stream is inside sglang (holds its reader lock)
                failed = await self._post_each(
                    "/update_weights_from_disk",
                    {"model_path": str(model_dir), "weight_version": str(version)},
                )
                if failed:
                    raise self._publish_failed(version, failed, await self._load_back(failed))
                self._version, self._served_path = version, str(model_dir)
                self.down.clear()  # every replica now serves `version`
                for client in self._clients:
                    try:
                        r = await client.post("/flush_cache", timeout=60.0)
                        if r.status_code != 200:
                            log.info("sglang /flush_cache answered %d (requests running)", r.status_code)
                    except httpx.HTTPError as exc:
                        log.warning("sglang /flush_cache failed: %r", exc)
            finally:
                self._open.set()
        return version

    async def _load_back(self, failed: dict[int, SamplerError]) -> str:
        """After a full publish failed on `failed`: the replicas that loaded it load the served
        folder again; any replica whose weights are then unknown leaves rotation. Says the state."""
        unknown = {i for i, exc in failed.items() if not isinstance(exc, SamplerUnavailable)
                   or "unreachable" in str(exc) or "timed out" in str(exc)}
        loaded = [i for i in range(len(self._clients)) if i not in failed]
        if loaded and self._served_path is None:
            unknown |= set(loaded)
        elif loaded:
            body = {"model_path": self._served_path, "weight_version": str(self._version)}
            unknown |= set(await self._post_each("/update_weights_from_disk", body, loaded))
        self.down |= unknown
        for i in sorted(unknown):
            log.error("sglang replica %s is out of rotation until a publish succeeds on every replica: its "
                      "weights may not be version %d's", self.base_urls[i], self._version)
        out = f" ({', '.join(self.base_urls[i] for i in sorted(self.down))} out of rotation)" if self.down else ""
        return f"the replicas in rotation serve version {self._version}{out}"

    def _check_version(self, version: int) -> None:
        if self._closed:
            raise SamplerUnavailable("the sglang engine is closed")
        if version <= self._version:
            raise ValueError(f"new policy version {version} must be > {self._version}")

    async def aclose(self) -> None:
        """Close the HTTP client (open streams end with SamplerUnavailable). Idempotent."""
        if self._closed:
            return
        await self.drain_unloads()
        self._closed = True
        for client in self._clients:
            try:
                await client.aclose()
            except Exception as exc:  # connections of an event loop that already ended
                log.debug("closing the sglang client: %r", exc)
