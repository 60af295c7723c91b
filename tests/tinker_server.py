"""A local server on 127.0.0.1 that speaks Tinker's wire protocol (as tinker==0.38.0 sends it).

The real, unmodified SDK is pointed at it (`base_url`), so tests see exactly what the backend
sent and can script the service's answers: `try_again` polls, HTTP 429s, server-reported
failures, futures that never finish.

Protocol implemented (all under /api/v1, every call must carry `X-API-Key: tml-...`):
- Control, JSON in and out: `client/config`, `client/dynamic_config`, `create_session`,
  `session_heartbeat`, `sessions/{id}/finish`, `telemetry`, `healthz` (GET),
  `get_server_capabilities` (GET), `get_info`, `create_sampling_session`, `samplers/{id}` (GET),
  `cancel_future`, `training_runs/{run}/checkpoints/{kind}/{name}` (DELETE).
- `unload_model` (a future answering `{"type": "unload_model", "model_id"}`) releases a training
  client; `loaded()` counts the training clients (LoRA slots) still held. Finishing a session
  does not release them (as on SkyRL's server).
- Futures: `create_model`, `forward_backward` (protobuf `ForwardBackwardRequest`, optionally
  zstd), `optim_step`, `save_weights`, `load_weights`, `save_weights_for_sampler` (named: a
  `tinker://.../sampler_weights/NAME` path that `create_sampling_session` takes as `model_path`
  and samples from at the weights it saved; unnamed: a sampling session), `asample`
  answer `{"request_id": ...}` (asample adds `sample_sequence_ids`).
- `retrieve_future`: `{"type": "try_again", "queue_state": "active"}` while pending,
  `{"error", "category"}` for a failed request, the result as JSON, or for `ForwardBackward`
  and `Sample` futures a protobuf `ForwardBackwardOutput` / `SampleResponse` when the client's
  `Accept` asks for `application/x-protobuf`.

Knobs beside `Faults`: `script` (what asample answers for a prompt instead), `api_keys` (None: any `tml-` key; else only these, others get 401),
`refuse_last_n` (asample with `prompt_logprobs_last_n` answers 422, as a server without that
option does), `unload_supported` (False: `unload_model` answers 404).

Knobs that play SkyRL's Tinker server (skyrl 0.4.0, an independent implementation of the protocol):
- `tied_samplers`: sampler weights (named or not) sample only while the training client that saved
  them is loaded; once it is released (`unload_model`), asample fails with `Model ... not loaded`.
  Training states (`weights/`) stay loadable after a release.
- `short_sampler_paths`: named `save_weights_for_sampler` answers `tinker://MODEL/NAME`, a path the
  SDK's `delete_checkpoint_from_tinker_path` refuses ("Invalid tinker path") before sending
  anything; `create_sampling_session` takes it, and the REST delete of
  `training_runs/MODEL/checkpoints/sampler_weights/NAME` deletes it.
- `report_loss` (False): `forward_backward` reports no `loss:sum` metric.
- `refuse_deletes`: the REST checkpoint delete answers 403 while set (a failure the SDK does not retry).

Model of the service: a model's `step` counts applied optim steps; a sampler created from a
model snapshot samples deterministically from (prompt, weights step) (see `sample_output`), so a
test can tell which weights answered. A model also lists the datums its applied optim steps
trained (`ModelState.trained`, carried by its checkpoints), so a test can tell what the weights
saw. Only the protobuf message classes come from the SDK (`tinker.proto.tinker_public_pb2`, the
wire schema); the server logic is this file's own.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import uvicorn
import zstandard
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tinker.proto import tinker_public_pb2 as pb

PROTO = "application/x-protobuf"
POLICY_LOSSES = {"importance_sampling", "ppo", "cispo"}
LOSS_INPUTS = {"target_tokens", "logprobs", "advantages"}
CLIP_KEYS = {"clip_low_threshold", "clip_high_threshold"}


@dataclass
class Call:
    """One request the server received."""

    route: str
    body: Any
    t: float


@dataclass
class PendingFuture:
    request_id: str
    kind: str
    outcome: tuple[str, Any]
    """("json", dict) | ("proto", bytes) | ("error", (message, category))."""
    try_again_left: int = 0
    hang: bool = False


@dataclass
class Faults:
    """What to do wrong next. Tests fill these in; the server consumes them."""

    status: dict[str, list[int]] = field(default_factory=dict)
    """route -> HTTP statuses to answer the next calls with (e.g. [429, 429])."""
    try_again: dict[str, int] = field(default_factory=dict)
    """future kind -> try_again answers before the next such future completes."""
    fail: dict[str, tuple[str, str]] = field(default_factory=dict)
    """future kind -> (error, category) the next such future fails with."""
    hang: set[str] = field(default_factory=set)
    """future kinds that never complete (always try_again)."""


@dataclass
class ModelState:
    model_id: str
    base_model: str
    lora_rank: int
    step: int = 0
    """Optim steps applied."""
    seq_ids: list[int] = field(default_factory=list)
    unloaded: bool = False
    trained: list[tuple[int, ...]] = field(default_factory=list)
    """Every datum's model_input that an applied optim step trained into these weights (with
    what a loaded checkpoint held): the service's own record of what the weights saw."""
    pending: list[tuple[int, ...]] = field(default_factory=list)
    """forward_backward datums not yet applied by an optim_step."""


def sample_output(
    prompt: list[int], weights_step: int, max_tokens: int, stop: list[int] | None, vocab: int = 50_000
) -> tuple[list[int], list[float], str]:
    """Deterministic tokens/logprobs for a prompt under weights trained `weights_step` steps."""
    tokens: list[int] = []
    logprobs: list[float] = []
    base = sum(prompt) + 1000 * weights_step
    for i in range(max_tokens):
        tok = (base + 31 * i) % (vocab - 10) + 10
        tokens.append(tok)
        logprobs.append(expected_logprob(i, weights_step))
        if stop and tok in stop:
            return tokens, logprobs, "stop"
    return tokens, logprobs, "length"


def expected_logprob(i: int, weights_step: int) -> float:
    """Logprob of sampled position i (exact in float32)."""
    return -0.125 * (i + 1) - 0.5 * weights_step


def prompt_logprob(token: int, weights_step: int) -> float:
    """The fake model's logprob of a prompt token (exact in float32); trained steps shift it."""
    return -0.0625 * (token % 16 + 1) - 0.5 * weights_step


class TinkerProtocolServer:
    """Run with `start()` (returns the base URL) and `stop()`; inspect `calls`, set `faults`."""

    def __init__(self, models: tuple[str, ...] = ("test/tiny-qwen3",), context_length: int = 4096) -> None:
        self.supported_models = models
        self.context_length = context_length
        self.faults = Faults()
        self.calls: list[Call] = []
        self.models: dict[str, ModelState] = {}
        self.checkpoints: dict[str, dict[str, Any]] = {}
        self.deleted: list[str] = []
        """Checkpoint paths deleted through the REST API, in order."""
        self.samplers: dict[str, dict[str, Any]] = {}
        self.futures: dict[str, PendingFuture] = {}
        self.telemetry_posts = 0
        self.logprob_shift = 0.0
        """Learner logprob minus sampler logprob the fake model reports (ratio = exp(shift))."""
        self.poll_delay_s = 0.01
        self.vocab = 50_000
        """Sampled ids stay below this (set it to a real tokenizer's size for end-to-end tests)."""
        self.client_config: dict[str, Any] = {"pjwt_auth_enabled": False}
        self.api_keys: set[str] | None = None
        self.refuse_last_n = False
        self.unload_supported = True
        self.tied_samplers = False
        self.short_sampler_paths = False
        self.report_loss = True
        self.refuse_deletes = False
        self.script: Any = None
        """`prompt ids -> completion ids | None`: what asample samples instead of `sample_output`
        (None: the usual output); logprobs stay `expected_logprob`, stop ids and max_tokens apply."""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.base_url = ""

    # ---- lifecycle

    def start(self) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.time() + 10
        while not self._server.started:
            if time.time() > deadline:
                raise RuntimeError("tinker protocol server did not start")
            time.sleep(0.01)
        self.base_url = f"http://127.0.0.1:{port}"
        return self.base_url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- inspection helpers

    def routes(self) -> list[str]:
        with self._lock:
            return [c.route for c in self.calls]

    def bodies(self, route: str) -> list[Any]:
        with self._lock:
            return [c.body for c in self.calls if c.route == route]

    def loaded(self) -> list[str]:
        """Training clients created and not unloaded (the LoRA slots in use)."""
        return [m.model_id for m in self.models.values() if not m.unloaded]

    # ---- plumbing

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def _record(self, route: str, body: Any) -> None:
        with self._lock:
            self.calls.append(Call(route, body, time.monotonic()))

    def _future(self, kind: str, outcome: tuple[str, Any], **extra: Any) -> JSONResponse:
        rid = self._new_id("req")
        fut = PendingFuture(rid, kind, outcome)
        if kind in self.faults.fail:
            fut.outcome = ("error", self.faults.fail.pop(kind))
        fut.try_again_left = self.faults.try_again.pop(kind, 0)
        fut.hang = kind in self.faults.hang
        self.futures[rid] = fut
        return JSONResponse({"request_id": rid, **extra})

    def app(self) -> Starlette:
        s = self

        async def dispatch(request: Request) -> Response:
            route = request.path_params["route"]
            key = request.headers.get("x-api-key", "")
            if not key.startswith("tml-") or (s.api_keys is not None and key not in s.api_keys):
                return JSONResponse({"detail": "missing, malformed or unknown X-API-Key"}, status_code=401)
            raw = await request.body()
            if request.headers.get("content-encoding") == "zstd":
                raw = zstandard.ZstdDecompressor().decompress(raw)
            if route == "forward_backward":
                body: Any = _decode_fwdbwd(raw)
            else:
                body = await asyncio.to_thread(_json, raw) if raw else {}
            if route != "telemetry":
                s._record(route, body)
            queued = s.faults.status.get(route)
            if queued:
                code = queued.pop(0)
                return JSONResponse(
                    {"detail": f"injected {code}"}, status_code=code, headers={"retry-after-ms": "50"}
                )
            handler = HANDLERS.get(route.split("/")[0])
            if handler is None:
                return JSONResponse({"detail": f"no route {route}"}, status_code=404)
            return await handler(s, route, body, request)

        return Starlette(routes=[Route("/api/v1/{route:path}", dispatch, methods=["GET", "POST", "DELETE"])])


def _json(raw: bytes) -> Any:
    import json

    return json.loads(raw)


def _decode_fwdbwd(raw: bytes) -> dict[str, Any]:
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(raw)
    data = []
    for d in msg.data:
        tokens: list[int] = []
        for chunk in d.model_input:
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {}
        for name, t in d.loss_fn_inputs.items():
            dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}[t.dtype]
            if t.WhichOneof("encoding") != "dense":
                raise ValueError(f"{name}: only dense tensors are expected here")
            inputs[name] = {
                "dtype": np.dtype(dtype).name,
                "shape": list(t.shape),
                "values": np.frombuffer(t.dense, dtype=dtype).tolist(),
            }
        data.append({"model_input": tokens, "loss_fn_inputs": inputs})
    config = {
        k: v.number if v.WhichOneof("value") == "number" else v.text for k, v in msg.loss_fn_config_v2.items()
    }
    return {
        "model_id": msg.model_id,
        "seq_id": msg.seq_id,
        "loss_fn": msg.loss_fn,
        "loss_fn_config": config,
        "forward_only": msg.forward_only,
        "data": data,
    }


# ---- handlers: (server, route, body, request) -> Response


async def h_client_config(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    if route == "client/dynamic_config":
        return JSONResponse({"refresh_interval_sec": 300})
    return JSONResponse(s.client_config)


async def h_simple(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    if route == "create_session":
        return JSONResponse({"type": "create_session", "session_id": s._new_id("session")})
    if route == "session_heartbeat":
        return JSONResponse({"type": "session_heartbeat"})
    if route == "healthz":
        return JSONResponse({"status": "ok"})
    if route == "telemetry":
        s.telemetry_posts += 1
        return JSONResponse({"status": "accepted"})
    if route == "cancel_future" or route.startswith("sessions/"):
        return JSONResponse({})
    if route == "get_server_capabilities":
        return JSONResponse(
            {
                "supported_models": [
                    {
                        "model_name": m,
                        "max_context_length": s.context_length,
                        "trainable": True,
                        "sampleable": True,
                    }
                    for m in s.supported_models
                ]
            }
        )
    raise AssertionError(route)


async def h_create_model(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    if body["base_model"] not in s.supported_models:
        return s._future("CreateModel", ("error", (f"unknown base model {body['base_model']}", "user")))
    model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
    s.models[model_id] = ModelState(model_id, body["base_model"], body["lora_config"]["rank"])
    return s._future(
        "CreateModel", ("json", {"model_id": model_id, "type": "create_model"}), model_id=model_id
    )


async def h_get_info(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    m = s.models[body["model_id"]]
    return JSONResponse(
        {
            "type": "get_info",
            "model_id": m.model_id,
            "model_data": {"arch": "qwen3", "model_name": m.base_model, "tokenizer_id": m.base_model},
            "is_lora": True,
            "lora_rank": m.lora_rank,
        }
    )


def _fwdbwd_outcome(s: TinkerProtocolServer, body: dict[str, Any]) -> tuple[str, Any]:
    loss_fn = body["loss_fn"]
    if loss_fn not in POLICY_LOSSES:
        return "error", (f"loss_fn {loss_fn!r} is not supported here", "user")
    allowed_cfg = CLIP_KEYS if loss_fn in ("ppo", "cispo") else set()
    extra = set(body["loss_fn_config"]) - allowed_cfg
    if extra:
        return "error", (f"unexpected loss_fn_config keys {sorted(extra)} for {loss_fn}", "user")
    lo = body["loss_fn_config"].get("clip_low_threshold", 0.8)
    hi = body["loss_fn_config"].get("clip_high_threshold", 1.2)
    total = 0.0
    outputs: list[np.ndarray] = []
    for d in body["data"]:
        inputs = d["loss_fn_inputs"]
        if set(inputs) != LOSS_INPUTS:
            return "error", (
                f"loss_fn_inputs must be exactly {sorted(LOSS_INPUTS)}, got {sorted(inputs)}",
                "user",
            )
        n = len(d["model_input"])
        for name, t in inputs.items():
            if t["shape"] != [n]:
                return "error", (f"{name} has shape {t['shape']}, model_input has {n} tokens", "user")
        q = np.asarray(inputs["logprobs"]["values"], dtype=np.float64)
        adv = np.asarray(inputs["advantages"]["values"], dtype=np.float64)
        p = q + s.logprob_shift
        ratio = np.exp(p - q)
        if loss_fn == "importance_sampling":
            total += float(-(ratio * adv).sum())
        elif loss_fn == "ppo":
            total += float(-np.minimum(ratio * adv, np.clip(ratio, lo, hi) * adv).sum())
        else:
            total += float(-(np.clip(ratio, lo, hi) * p * adv).sum())
        outputs.append(p.astype(np.float32))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    if s.report_loss:
        out.metrics["loss:sum"] = total
    rec = out.loss_fn_outputs.add()
    rec.num_datums = len(outputs)
    bt = rec.fields["logprobs"]
    bt.dtype = pb.DTYPE_FLOAT32
    bt.data = b"".join(a.tobytes() for a in outputs)
    bt.offsets = np.cumsum([0] + [a.nbytes for a in outputs]).astype(np.int64).tobytes()
    return "proto", out.SerializeToString()


async def h_forward_backward(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    m = s.models[body["model_id"]]
    m.seq_ids.append(body["seq_id"])
    if not body["forward_only"]:
        m.pending.extend(tuple(d["model_input"]) for d in body["data"])
    return s._future("ForwardBackward", _fwdbwd_outcome(s, body))


async def h_optim_step(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    m = s.models[body["model_id"]]
    m.seq_ids.append(body["seq_id"])
    if "adam_params" not in body:
        return s._future("OptimStep", ("error", ("optim_step needs adam_params", "user")))
    m.step += 1
    m.trained, m.pending = m.trained + m.pending, []
    return s._future("OptimStep", ("json", {"metrics": {"step": float(m.step)}}))


async def h_save_weights(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    m = s.models[body["model_id"]]
    m.seq_ids.append(body["seq_id"])
    path = f"tinker://{m.model_id}/weights/{body['path']}"
    s.checkpoints[path] = {
        "step": m.step, "base_model": m.base_model, "lora_rank": m.lora_rank, "trained": list(m.trained),
        "model_id": m.model_id,
    }
    return s._future("SaveWeights", ("json", {"path": path, "type": "save_weights"}))


async def h_load_weights(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    ckpt = s.checkpoints.get(body["path"])
    if ckpt is None:
        return s._future("LoadWeights", ("error", (f"no checkpoint at {body['path']}", "user")))
    model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
    s.models[model_id] = ModelState(
        model_id, ckpt["base_model"], ckpt["lora_rank"], step=ckpt["step"], trained=list(ckpt["trained"])
    )
    return s._future(
        "LoadWeights", ("json", {"path": body["path"], "model_id": model_id, "type": "load_weights"})
    )


async def h_save_for_sampler(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    m = s.models[body["model_id"]]
    m.seq_ids.append(body["seq_id"])
    if body.get("path"):  # named: persistent sampler weights, sampled later through their path
        path = f"tinker://{m.model_id}/sampler_weights/{body['path']}"
        s.checkpoints[path] = {
            "step": m.step, "base_model": m.base_model, "lora_rank": m.lora_rank, "trained": list(m.trained),
            "model_id": m.model_id,
        }
        answered = f"tinker://{m.model_id}/{body['path']}" if s.short_sampler_paths else path
        return s._future("SaveWeightsForSampler", ("json", {"path": answered, "type": "save_weights_for_sampler"}))
    sid = s._new_id("sampler")
    s.samplers[sid] = {"base_model": m.base_model, "weights_step": m.step, "model_path": None, "model_id": m.model_id}
    return s._future(
        "SaveWeightsForSampler", ("json", {"sampling_session_id": sid, "type": "save_weights_for_sampler"})
    )


def sampler_key(path: str) -> str:
    """The stored key of sampler weights: `tinker://MODEL/NAME` (SkyRL's form) is
    `tinker://MODEL/sampler_weights/NAME`."""
    parts = path.removeprefix("tinker://").split("/")
    return f"tinker://{parts[0]}/sampler_weights/{parts[1]}" if len(parts) == 2 else path


async def h_create_sampling_session(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    sid = s._new_id("sampler")
    path = body.get("model_path")
    if path is not None and sampler_key(path) not in s.checkpoints:
        return JSONResponse({"detail": f"no sampler weights at {path}"}, status_code=404)
    saved = s.checkpoints[sampler_key(path)] if path is not None else {"step": 0, "base_model": body.get("base_model")}
    s.samplers[sid] = {
        "base_model": saved["base_model"],
        "weights_step": saved["step"],
        "model_path": path,
        "model_id": saved.get("model_id"),
    }
    return JSONResponse({"type": "create_sampling_session", "sampling_session_id": sid})


async def h_samplers(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    sid = route.split("/", 1)[1]
    info = s.samplers[sid]
    return JSONResponse(
        {"sampler_id": sid, "base_model": info["base_model"], "model_path": info["model_path"]}
    )


async def h_unload_model(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    if not s.unload_supported:
        return JSONResponse({"detail": "Not Found"}, status_code=404)
    m = s.models.get(body.get("model_id", ""))
    if m is None or m.unloaded:
        return s._future("UnloadModel", ("error", (f"model {body.get('model_id')} not found", "user")))
    m.unloaded = True
    return s._future("UnloadModel", ("json", {"type": "unload_model", "model_id": m.model_id}))


async def h_asample(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    if s.refuse_last_n and body.get("prompt_logprobs_last_n") is not None:
        return JSONResponse(
            {"detail": [{"loc": ["body", "prompt_logprobs_last_n"], "msg": "Extra inputs are not permitted"}]},
            status_code=422,
        )
    info = s.samplers[body["sampling_session_id"]]
    owner = s.models.get(info.get("model_id") or "")
    if s.tied_samplers and info.get("model_id") and (owner is None or owner.unloaded):
        return s._future("Sample", ("error", (f"Model {info['model_id']} not loaded", "user")))
    prompt = [t for c in body["prompt"]["chunks"] for t in c["tokens"]]
    sp = body["sampling_params"]
    stop = sp.get("stop")
    tokens, logprobs, reason = sample_output(prompt, info["weights_step"], sp["max_tokens"], stop, s.vocab)
    scripted = s.script(prompt) if s.script is not None else None
    if scripted is not None:
        cut = next((i + 1 for i, t in enumerate(scripted) if stop and t in stop), len(scripted))
        tokens = list(scripted[: min(cut, sp["max_tokens"])])
        logprobs = [expected_logprob(i, info["weights_step"]) for i in range(len(tokens))]
        reason = "stop" if stop and tokens and tokens[-1] in stop else "length"
    msg = pb.SampleResponse()
    seq = msg.sequences.add()
    seq.stop_reason = pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH
    seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
    seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if body.get("prompt_logprobs"):  # compute_logprobs: NaN where not scored (first token, before last_n)
        last_n = body.get("prompt_logprobs_last_n") or len(prompt) - 1
        scored = [prompt_logprob(t, info["weights_step"]) if i >= len(prompt) - last_n and i > 0 else float("nan")
                  for i, t in enumerate(prompt)]
        msg.prompt_logprobs = np.asarray(scored, dtype=np.float32).tobytes()
    k = body.get("topk_sample_logprobs", 0)
    if k:
        ids = np.asarray([[t + j for j in range(k)] for t in tokens], dtype=np.int32)
        lps = np.asarray([[lp - j for j in range(k)] for lp in logprobs], dtype=np.float32)
        seq.topk_sampled_logprobs.CopyFrom(
            pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(tokens))
        )
    return s._future("Sample", ("proto", msg.SerializeToString()), sample_sequence_ids=[s._new_id("seq")])


async def h_training_runs(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    """DELETE training_runs/{run}/checkpoints/{kind}/{name}: the RestClient's checkpoint delete."""
    run, _, rest = route.removeprefix("training_runs/").partition("/checkpoints/")
    if req.method != "DELETE" or not rest:
        return JSONResponse({"detail": f"no route {route}"}, status_code=404)
    path = f"tinker://{run}/{rest}"
    if s.refuse_deletes:
        return JSONResponse({"detail": f"deleting {path} is refused now"}, status_code=403)
    if path not in s.checkpoints:
        return JSONResponse({"detail": f"no checkpoint {path}"}, status_code=404)
    del s.checkpoints[path]
    s.deleted.append(path)
    return Response(status_code=204)


async def h_retrieve(s: TinkerProtocolServer, route: str, body: Any, req: Request) -> Response:
    fut = s.futures.get(body["request_id"])
    if fut is None:
        return JSONResponse({"detail": "unknown request"}, status_code=404)
    if fut.hang or fut.try_again_left > 0:
        fut.try_again_left -= 1
        await asyncio.sleep(0.2 if fut.hang else s.poll_delay_s)
        return JSONResponse({"type": "try_again", "request_id": fut.request_id, "queue_state": "active"})
    kind, payload = fut.outcome
    s._record(f"result:{fut.kind}", {"request_id": fut.request_id, "outcome": kind})
    if kind == "error":
        message, category = payload
        return JSONResponse({"error": message, "category": category})
    if kind == "proto":
        if PROTO not in req.headers.get("accept", ""):
            return JSONResponse({"detail": "this result is only served as protobuf"}, status_code=406)
        return Response(payload, media_type=PROTO)
    return JSONResponse(payload)


HANDLERS = {
    "client": h_client_config,
    "create_session": h_simple,
    "session_heartbeat": h_simple,
    "healthz": h_simple,
    "telemetry": h_simple,
    "cancel_future": h_simple,
    "sessions": h_simple,
    "get_server_capabilities": h_simple,
    "create_model": h_create_model,
    "get_info": h_get_info,
    "forward_backward": h_forward_backward,
    "optim_step": h_optim_step,
    "save_weights": h_save_weights,
    "load_weights": h_load_weights,
    "save_weights_for_sampler": h_save_for_sampler,
    "create_sampling_session": h_create_sampling_session,
    "samplers": h_samplers,
    "asample": h_asample,
    "unload_model": h_unload_model,
    "retrieve_future": h_retrieve,
    "training_runs": h_training_runs,
}
