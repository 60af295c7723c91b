"""A stand-in for `python -m sglang.launch_server` (sglang 0.5.x HTTP API) that checks request shapes.

Runs in-process (`FakeSGLang(...).start()`, for tests that inspect its state) or as a program with
launch_server's arguments (`python tests/sglang_server.py --model-path M --port P ...`), so the
launcher can start it as "sglang". Binds 127.0.0.1 only.

What it checks, from sglang 0.5.x `managers/io_struct.py` (GenerateReqInput, LoadLoRAAdapterReqInput,
UnloadLoRAAdapterReqInput, UpdateWeightFromDiskReqInput), `sampling/sampling_params.py`
(SamplingParams.__init__/verify) and `entrypoints/http_server.py`:
- Field names and types. Unknown top-level fields get 400 here although SGLang's dataclass parsing
  silently drops them: a misspelt field must fail a test, not be ignored in production. Unknown
  sampling params get 400 (SGLang: `SamplingParams(**d)` raises). Values as `verify()` checks them.
- `lora_path` must name a loaded adapter; LoRA endpoints need `--enable-lora`; an adapter's rank and
  target modules must fit `--max-lora-rank` / `--lora-target-modules`.
- Multi-LoRA as 0.5.x serves it (`managers/tokenizer_manager.py`, `lora/lora_manager.py`,
  `lora/mem_pool.py`): `--max-loaded-loras N` refuses a load past N adapters ("Maximum number of
  loaded LoRA adapters is N", 400; it must be >= `--max-loras-per-batch`); `--max-loras-per-batch M`
  GPU slots hold the adapters of running requests, a request whose adapter has no slot takes one
  from an adapter no running request uses (`--lora-eviction-policy` lru or fifo; `pinned`
  adapters keep theirs, at most M - 1 pinned) or waits for one.
- Output as 0.5.x streams it: `text` cumulative, `output_ids` incremental, `meta_info` with
  `completion_tokens` and cumulative `output_token_logprobs` [[logprob, id, None], ...],
  `finish_reason` {"type": "stop", "matched": id} / {"type": "length", "length": n}; `data: [DONE]`.

The "model" is deterministic: a `script` (ids) if set, else ids from the prompt, position and the
served weights (a digest of the adapter's files, or the weights version), so a publish visibly
changes the output and an answer from the wrong adapter differs from the right one's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import threading
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

GENERATE_FIELDS = {  # sglang 0.5.x GenerateReqInput (+ BaseReq rid, http_worker_ipc)
    "rid", "http_worker_ipc", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data",
    "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
    "return_text_in_logprobs", "stream", "log_metrics", "return_hidden_states", "modalities", "session_params",
    "lora_path", "lora_id", "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "bootstrap_pair_key", "validation_time", "data_parallel_rank", "background", "conversation_id", "priority",
    "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy",
}  # fmt: skip
SAMPLING_FIELDS = {  # sglang 0.5.x SamplingParams.__init__
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed",
}  # fmt: skip
LOAD_LORA_FIELDS = {"lora_name", "lora_path", "pinned", "lora_id", "rid", "http_worker_ipc"}
UNLOAD_LORA_FIELDS = {"lora_name", "lora_id", "rid", "http_worker_ipc"}
UPDATE_DISK_FIELDS = {
    "model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
    "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "rid", "http_worker_ipc",
}  # fmt: skip


class Invalid(ValueError):
    """A request SGLang would reject with 400."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise Invalid(msg)


def _fields(body: Any, allowed: set[str], required: tuple[str, ...], what: str) -> dict[str, Any]:
    _check(isinstance(body, dict), f"{what}: the body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    _check(not unknown, f"{what}: unknown fields {unknown}")
    missing = [k for k in required if k not in body]
    _check(not missing, f"{what}: missing fields {missing}")
    return dict(body)


@dataclass
class FakeSGLang:
    """The fake server's state; tests read and script it directly when it runs in-process."""

    model_path: Path
    port: int = 0
    enable_lora: bool = False
    max_lora_rank: int = 0
    lora_target_modules: tuple[str, ...] = ()
    max_running: int = 64
    max_queued: int = 64
    token_delay_s: float = 0.0
    tokens_per_event: int = 1
    startup_s: float = 0.0
    script: list[int] | None = None
    """Ids every request samples (up to its stop or length), else the deterministic rule."""
    overload: str = ""
    """'status': /generate answers 503; 'event': an abort event with status_code 503; '': off."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    """Every accepted /generate body, in order."""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """(path, body) of every LoRA / weight / cache call."""
    adapters: dict[str, str] = field(default_factory=dict)
    max_loaded_loras: int | None = None
    """`--max-loaded-loras` (None: no limit)."""
    max_loras_per_batch: int = 8
    """`--max-loras-per-batch`: GPU slots for adapters."""
    lora_eviction_policy: str = "lru"
    adapter_tags: dict[str, str] = field(default_factory=dict)
    """Per loaded adapter, a digest of its folder's files: what its answers are made from."""
    pinned: set[str] = field(default_factory=set)
    slots: OrderedDict[str, None] = field(default_factory=OrderedDict)
    """Adapters in a GPU slot, in eviction order (first out first)."""
    slot_loads: int = 0
    """Adapters copied into a slot so far (a swap from CPU memory)."""
    most_loaded: int = 0
    """The most adapters loaded at once so far."""
    refused_loads: list[str] = field(default_factory=list)
    """Names of the adapters whose load was refused (400)."""
    lora_users: Counter[str] = field(default_factory=Counter)
    unload_waits: list[str] = field(default_factory=list)
    """Adapters whose unload had to wait for running requests (clawbridge should never cause one)."""
    aborted: list[str] = field(default_factory=list)
    """rids of requests whose client went away before they finished."""
    weights_tag: str = "base"
    running: int = 0
    refuse_updates: str = ""
    """When set, /update_weights_from_disk answers 400 with this message (and keeps its weights, as
    SGLang restores its old weights when a load fails)."""

    def __post_init__(self) -> None:
        cfg = json.loads((self.model_path / "config.json").read_text())
        self.vocab_size = int(cfg["vocab_size"])
        self.context_len = int(cfg.get("max_position_embeddings", 4096))
        self.started_at = time.monotonic()
        self._updating = False
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = self._build()

    # ---- the "model" ---------------------------------------------------------------------
    def token(self, prompt: list[int], k: int, tag: str, seed: int | None) -> tuple[int, float]:
        if self.script is not None:
            return self.script[k % len(self.script)], -0.25 - 0.01 * k
        h = (sum(prompt) * 31 + k * 7 + sum(map(ord, tag)) * 13 + (seed or 0)) % self.vocab_size
        return h, -(k % 5 + 1) / 8.0

    # ---- validation ----------------------------------------------------------------------
    def check_generate(self, body: Any) -> dict[str, Any]:
        b = _fields(body, GENERATE_FIELDS, ("input_ids",), "GenerateReqInput")
        ids = b["input_ids"]
        _check(isinstance(ids, list) and len(ids) > 0, "input_ids cannot be empty.")
        _check(all(_is_int(t) for t in ids), "input_ids must be a single list of ints (clawbridge never batches)")
        _check(all(0 <= t < self.vocab_size for t in ids), "input_ids out of the vocabulary")
        _check(b.get("text") is None, "send input_ids, not text")
        for k in ("return_logprob", "stream", "return_text_in_logprobs"):
            _check(isinstance(b.get(k, False), bool), f"{k} must be a bool")
        _check(_is_int(b.get("top_logprobs_num", 0)) and b.get("top_logprobs_num", 0) >= 0, "top_logprobs_num")
        lora = b.get("lora_path")
        _check(lora is None or isinstance(lora, str), "lora_path must be a string (one request)")
        if lora is not None:
            _check(self.enable_lora, "LoRA is not enabled. Please set `--enable-lora` to True.")
            _check(lora in self.adapters, f"The following requested LoRA adapters are not loaded: {lora}")
        sp = b.get("sampling_params") or {}
        _check(isinstance(sp, dict), "sampling_params must be an object")
        unknown = sorted(set(sp) - SAMPLING_FIELDS)
        _check(not unknown, f"SamplingParams.__init__() got unexpected keyword arguments {unknown}")
        mnt = sp.get("max_new_tokens", 128)
        _check(_is_int(mnt) and mnt >= 0, "max_new_tokens must be at least 0")
        _check(_is_num(sp.get("temperature", 1.0)) and sp.get("temperature", 1.0) >= 0, "temperature must be >= 0")
        _check(_is_num(sp.get("top_p", 1.0)) and 0 < sp.get("top_p", 1.0) <= 1, "top_p must be in (0, 1]")
        top_k = sp.get("top_k", -1)
        _check(_is_int(top_k) and (top_k == -1 or top_k >= 1), "top_k must be -1 (disable) or at least 1")
        stops = sp.get("stop_token_ids") or []
        _check(isinstance(stops, list) and all(_is_int(t) for t in stops), "stop_token_ids must be a list of ints")
        _check(sp.get("sampling_seed") is None or _is_int(sp["sampling_seed"]), "sampling_seed must be an int")
        _check(len(ids) < self.context_len, f"The input ({len(ids)} tokens) is longer than the model's "
               f"context length ({self.context_len} tokens).")  # fmt: skip
        _check(len(ids) + mnt <= self.context_len, "Requested token count exceeds the model's maximum context length")
        return b

    # ---- app -----------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI()

        def bad(exc: Exception) -> JSONResponse:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)

        @app.get("/health")
        @app.get("/health_generate")
        async def health() -> Response:
            up = time.monotonic() - self.started_at >= self.startup_s
            return Response(status_code=200 if up else 503)

        @app.get("/get_model_info")
        async def model_info() -> dict[str, Any]:
            return {"model_path": str(self.model_path), "tokenizer_path": str(self.model_path),
                    "is_generation": True, "preferred_sampling_params": None, "weight_version": self.weights_tag}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            card = {"id": str(self.model_path), "object": "model", "created": int(time.time()), "owned_by": "sglang",
                    "root": str(self.model_path), "max_model_len": self.context_len}
            return {"object": "list", "data": [card]}

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache() -> Response:
            self.calls.append(("/flush_cache", {}))
            return Response("Cache flushed.\n", status_code=400 if self.running else 200)

        @app.post("/load_lora_adapter")
        async def load_lora(request: Request) -> JSONResponse:
            body = await request.json()
            try:
                b = _fields(body, LOAD_LORA_FIELDS, ("lora_name", "lora_path"), "LoadLoRAAdapterReqInput")
                _check(isinstance(b["lora_name"], str) and isinstance(b["lora_path"], str), "lora_name/lora_path: str")
                self.calls.append(("/load_lora_adapter", b))
                _check(self.enable_lora, "LoRA is not enabled. Please set `--enable-lora` to True.")
                _check(self.max_loaded_loras is None or len(self.adapters) < self.max_loaded_loras,
                       f"Cannot load LoRA adapter {b['lora_name']} at path {b['lora_path']}. Maximum number of "
                       f"loaded LoRA adapters is {self.max_loaded_loras}. Please unload some LoRA adapters before "
                       "loading new ones.")
                _check(b["lora_name"] not in self.adapters, f"LoRA adapter {b['lora_name']} is already loaded")
                _check(not b.get("pinned") or len(self.pinned) < self.max_loras_per_batch - 1,
                       f"Already have {len(self.pinned)} pinned adapters, max allowed is "
                       f"{self.max_loras_per_batch - 1} (reserving 1 slot for dynamic use).")
                tag = self._check_adapter(Path(b["lora_path"]))
            except Invalid as exc:
                self.refused_loads.append(str(body.get("lora_name")) if isinstance(body, dict) else "")
                return JSONResponse({"success": False, "error_message": str(exc)}, status_code=400)
            self.adapters[b["lora_name"]] = b["lora_path"]
            self.adapter_tags[b["lora_name"]] = tag
            if b.get("pinned"):
                self.pinned.add(b["lora_name"])
            self.most_loaded = max(self.most_loaded, len(self.adapters))
            return JSONResponse({"success": True, "error_message": None, "loaded_adapters": dict(self.adapters)})

        @app.post("/unload_lora_adapter")
        async def unload_lora(request: Request) -> JSONResponse:
            try:
                b = _fields(await request.json(), UNLOAD_LORA_FIELDS, ("lora_name",), "UnloadLoRAAdapterReqInput")
                self.calls.append(("/unload_lora_adapter", b))
                _check(b["lora_name"] in self.adapters, f"LoRA adapter {b['lora_name']} is not loaded")
            except Invalid as exc:
                return JSONResponse({"success": False, "error_message": str(exc)}, status_code=400)
            if self.lora_users[b["lora_name"]]:  # sglang waits for requests still using it
                self.unload_waits.append(b["lora_name"])
                while self.lora_users[b["lora_name"]]:
                    await asyncio.sleep(0.01)
            del self.adapters[b["lora_name"]]
            self.adapter_tags.pop(b["lora_name"], None)
            self.pinned.discard(b["lora_name"])
            self.slots.pop(b["lora_name"], None)
            return JSONResponse({"success": True, "error_message": None, "loaded_adapters": dict(self.adapters)})

        @app.post("/update_weights_from_disk")
        async def update_weights(request: Request) -> JSONResponse:
            try:
                b = _fields(await request.json(), UPDATE_DISK_FIELDS, ("model_path",), "UpdateWeightFromDiskReqInput")
                _check(isinstance(b["model_path"], str), "model_path must be a string")
                self.calls.append(("/update_weights_from_disk", b))
                folder = Path(b["model_path"])
                _check((folder / "config.json").is_file() and any(folder.glob("*.safetensors")),
                       f"{folder} has no config.json + *.safetensors")
                _check(not self.refuse_updates, self.refuse_updates)
            except Invalid as exc:
                return JSONResponse({"success": False, "message": str(exc), "num_paused_requests": 0}, status_code=400)
            self._updating = True  # writer lock: new requests wait, running ones finish first
            try:
                while self.running:
                    await asyncio.sleep(0.01)
                self.weights_tag = str(b.get("weight_version") or folder.name)
            finally:
                self._updating = False
            return JSONResponse({"success": True, "message": "Succeeded to update model weights.",
                                 "num_paused_requests": 0})

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate(request: Request) -> Response:
            try:
                b = self.check_generate(await request.json())
            except (Invalid, ValueError) as exc:
                return bad(exc)
            if self.overload == "status" or self.running >= self.max_running + self.max_queued:
                return JSONResponse({"error": {"message": "The request queue is full."}}, status_code=503)
            while self._updating:
                await asyncio.sleep(0.01)
            self.requests.append(b)
            rid = str(b.get("rid") or uuid.uuid4().hex)
            if b.get("stream"):
                return StreamingResponse(self._stream(b, rid), media_type="text/event-stream")
            events = [e async for e in self._events(b, rid)]
            return JSONResponse(events[-1])

        return app

    def _check_adapter(self, folder: Path) -> str:
        """Check a peft adapter folder; the digest of its files (`adapter_tags`)."""
        cfg_path = folder / "adapter_config.json"
        weights = folder / "adapter_model.safetensors"
        _check(cfg_path.is_file() and weights.is_file(), f"{folder} is not a peft adapter folder")
        cfg = json.loads(cfg_path.read_text())
        _check(int(cfg["r"]) <= self.max_lora_rank, f"LoRA rank {cfg['r']} > --max-lora-rank {self.max_lora_rank}")
        targets = cfg.get("target_modules") or []
        extra = sorted(set(targets) - set(self.lora_target_modules))
        _check(not extra, f"adapter targets {extra} not in --lora-target-modules")
        return hashlib.sha256(cfg_path.read_bytes() + weights.read_bytes()).hexdigest()[:16]

    async def _take_slot(self, lora: str) -> None:
        """A GPU slot for `lora` (its running requests counted in `lora_users` already): kept, free,
        or taken from the first adapter in eviction order that no running request uses and is not
        pinned; else wait, as SGLang's scheduler leaves the request in its queue."""
        while lora not in self.slots:
            if len(self.slots) < self.max_loras_per_batch:
                self.slots[lora] = None
                self.slot_loads += 1
                return
            victim = next((a for a in self.slots if not self.lora_users[a] and a not in self.pinned), None)
            if victim is not None:
                del self.slots[victim]
                continue
            await asyncio.sleep(0.01)
        if self.lora_eviction_policy == "lru":
            self.slots.move_to_end(lora)

    async def _events(self, b: dict[str, Any], rid: str) -> Any:
        sp = b.get("sampling_params") or {}
        prompt, lora = b["input_ids"], b.get("lora_path")
        tag = self.adapter_tags.get(lora, lora) if lora else self.weights_tag
        if lora:
            self.lora_users[lora] += 1
            try:
                await self._take_slot(lora)
            except BaseException:
                self.lora_users[lora] -= 1
                raise
        self.running += 1
        stops = set(sp.get("stop_token_ids") or [])
        max_new = sp.get("max_new_tokens", 128)
        lps: list[list[Any]] = []
        tops: list[list[list[Any]]] = []
        want_lp, n_top = b.get("return_logprob", False), b.get("top_logprobs_num", 0)
        try:
            if self.overload == "event":
                abort = {"type": "abort", "message": "The request queue is full.", "status_code": 503}
                yield {"text": "", "output_ids": [], "meta_info": {"id": rid, "finish_reason": abort,
                                                                   "completion_tokens": 0}}
                return
            finish: dict[str, Any] | None = None
            k = 0
            while finish is None:
                new: list[int] = []
                for _ in range(self.tokens_per_event):
                    if self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s)
                    tok, lp = self.token(prompt, k, tag, sp.get("sampling_seed"))
                    new.append(tok)
                    lps.append([lp, tok, None])
                    tops.append([[lp, tok, None]] + [[lp - 1.0 - j, (tok + 1 + j) % self.vocab_size, None]
                                                     for j in range(max(0, n_top - 1))])
                    k += 1
                    if tok in stops:
                        finish = {"type": "stop", "matched": tok}
                    elif k >= max_new:
                        finish = {"type": "length", "length": max_new}
                    if finish is not None:
                        break
                meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt),
                                        "weight_version": self.weights_tag, "completion_tokens": k, "cached_tokens": 0}
                if want_lp:
                    meta["input_token_logprobs"] = [[None, prompt[-1], None]]
                    meta["output_token_logprobs"] = list(lps)
                    if n_top:
                        meta["output_top_logprobs"] = list(tops)
                yield {"text": "", "output_ids": new if b.get("stream") else [e[1] for e in lps], "meta_info": meta}
        finally:
            self.running -= 1
            if lora:
                self.lora_users[lora] -= 1

    async def _stream(self, b: dict[str, Any], rid: str) -> Any:
        finished = False
        try:
            async for event in self._events(b, rid):
                finished = event["meta_info"]["finish_reason"] is not None
                yield b"data: " + json.dumps(event).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                self.aborted.append(rid)

    # ---- running in-process --------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeSGLang:
        cfg = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake sglang did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """launch_server's arguments that clawbridge passes; anything else is an error."""
    p = argparse.ArgumentParser(prog="sglang.launch_server (fake)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=0)
    p.add_argument("--lora-target-modules", nargs="+", default=[])
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-queued-requests", type=int, default=64)
    p.add_argument("--max-loaded-loras", type=int)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--lora-eviction-policy", choices=["lru", "fifo"], default="lru")
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--fake-startup-s", type=float, default=0.0)
    args = p.parse_args(argv)
    if args.host != "127.0.0.1":
        p.error("the fake binds 127.0.0.1 only")
    if args.max_loaded_loras is not None and args.max_loaded_loras < args.max_loras_per_batch:
        p.error("max_loaded_loras should be greater than or equal to max_loras_per_batch")
    return args


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    fake = FakeSGLang(Path(a.model_path), port=a.port, enable_lora=a.enable_lora, max_lora_rank=a.max_lora_rank,
                      lora_target_modules=tuple(a.lora_target_modules), max_running=a.max_running_requests,
                      max_queued=a.max_queued_requests, startup_s=a.fake_startup_s,
                      max_loaded_loras=a.max_loaded_loras, max_loras_per_batch=a.max_loras_per_batch,
                      lora_eviction_policy=a.lora_eviction_policy)
    print(f"fake sglang: {vars(a)}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(fake.app, host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
