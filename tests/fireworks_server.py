"""A local stand-in for Fireworks: control plane, trainer gateway, hot load and inference.

It speaks the wire protocol of the `fireworks-ai==1.2.30` training SDK (learned from the SDK's
source, written here from scratch) so tests run the real, unmodified SDK against 127.0.0.1:

- Control plane (`X-Api-Key`): `GET /v1/accounts`; base models `GET /v1/accounts/{a}/models/{m}`
  (404 unless offered, see `offered_models`); training shapes
  `GET /v1/accounts/{a}/trainingShapes/{s}/versions?filter=latest_validated=true` and
  `.../versions/{v}`; trainer jobs `POST /v1/accounts/{a}/rlorTrainerJobs?trainingShape=..&rlorTrainerJobId=..`,
  `GET|DELETE .../rlorTrainerJobs/{id}`, `POST .../rlorTrainerJobs/{id}:resume`; deployments
  `POST /v1/accounts/{a}/deployments?deploymentId=..`, `GET|PATCH|DELETE .../deployments/{id}`.
- Trainer gateway, `/training/v1/rlorTrainerJobs/{a}/{job}` + `/api/v1/healthz` and the
  Tinker-style JSON API: `client/config`, `create_session`, `session_heartbeat`, `create_model`,
  `forward_backward`, `optim_step`, `save_weights_for_sampler`, `save_weights`, `load_weights`,
  `telemetry`; each mutating call returns `{request_id}` and `retrieve_future` answers
  `{"type": "try_again", ...}`, `{"error", "category"}` or the result.
- Models: `create_model` registers a policy model (with `lora_config`) or, with `base_only`, a
  frozen base-only model; `optim_step` moves its model's weights (`FakeModel.steps`). `forward`
  with `cross_entropy` validates the datum shape (as the trainer would) and answers per-target
  `logprobs` from `teacher_logprob(context, target, steps)`: a base-only model always scores with
  steps 0, so a test can tell base from trained weights. `forward_backward` on a base-only model
  is refused; `unload_model` retires a model (later requests naming it are refused).
- Hot load: `POST|GET /hot_load/v1/models/hot_load` with `fireworks-model`,
  `fireworks-deployment` and `Authorization: Bearer` headers; status is `{"replicas": [...]}`.
- Inference: `POST /inference/v1/completions` with token-id prompts, answering `raw_output`
  token ids and `logprobs.content[]`, or a scripted 425/429/5xx/slow response.

Everything received is appended to `FakeFireworks.log` as `(op, body, headers)` for assertions.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response


@dataclass
class Logged:
    op: str
    body: Any
    headers: dict[str, str]
    path: str = ""


def teacher_logprob(context: list[int], target: int, steps: int = 0) -> float:
    """The fake trainer's logprob of `target` after `context` on a model trained `steps` times."""
    return -(((sum(context) * 31 + target * 7) % 50) + 1) / 20.0 - 0.5 * steps


@dataclass
class FakeModel:
    """A model created on the fake trainer session."""

    base_model: str
    base_only: bool
    steps: int = 0
    unloaded: bool = False
    trained: list[tuple[int, ...]] = field(default_factory=list)
    """Every datum's tokens an applied optim_step trained into these weights (with what a loaded
    checkpoint held): the service's own record of what the weights saw."""
    pending: list[tuple[int, ...]] = field(default_factory=list)
    """forward_backward datums not yet applied by an optim_step."""


@dataclass
class FakeFireworks:
    """Server state and knobs. Mutate knobs from tests; read `log`."""

    api_key: str = "fw-test-key"
    account: str = "acct-test"
    trainer_mode: str = "LORA_TRAINER"
    pending_polls: int = 0
    """A created trainer job reports JOB_STATE_PENDING for this many GETs."""
    try_again: dict[str, int] = field(default_factory=dict)
    """op -> how many `try_again` answers each of its futures gives before the result."""
    fail_future: dict[str, str] = field(default_factory=dict)
    """op -> error message its next future fails with (consumed)."""
    http_fail: dict[str, list[int]] = field(default_factory=dict)
    """op -> HTTP statuses answered (one consumed per request) before serving normally."""
    forward_short_by: int = 0
    offered_models: set[str] | None = None
    """Base models `GET .../models/{m}` knows (full names); None: every model is offered."""
    """Drop this many logprobs from the end of every `forward` output (a misbehaving server)."""
    models: dict[str, FakeModel] = field(default_factory=dict)
    completion_ids: list[int] = field(default_factory=lambda: [11, 12, 13, 2])
    completion_delay_s: float = 0.0
    hotload_loading_polls: int = 0
    log: list[Logged] = field(default_factory=list)
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    futures: dict[str, dict[str, Any]] = field(default_factory=dict)
    current_identity: str | None = None
    loading_identity: str | None = None
    served: list[tuple[list[int], str | None]] = field(default_factory=list)
    saved_states: dict[str, tuple[int, list[tuple[int, ...]]]] = field(default_factory=dict)
    """save_weights path -> (the model's steps, its trained datums) at the save."""
    """(prompt, snapshot identity that served it) for each completion answered."""
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def ops(self, prefix: str = "") -> list[str]:
        return [e.op for e in self.log if e.op.startswith(prefix)]

    def bodies(self, op: str) -> list[Any]:
        return [e.body for e in self.log if e.op == op]

    def shape_version(self, shape: str) -> dict[str, Any]:
        return {
            "name": f"{shape}/versions/v1",
            "snapshot": {
                "trainerImageTag": "img",
                "maxSupportedContextLength": 8192,
                "nodeCount": 1,
                "deploymentShapeVersion": f"accounts/{self.account}/deploymentShapes/ds-test/versions/1",
                "acceleratorType": "NVIDIA_H100_80GB",
                "acceleratorCount": 8,
                "trainerMode": self.trainer_mode,
            },
        }


def _status_error(code: int) -> JSONResponse:
    headers = {"Retry-After": "1"} if code == 429 else {}
    return JSONResponse({"error": {"message": f"scripted HTTP {code}"}}, status_code=code, headers=headers)


def build_app(fw: FakeFireworks) -> FastAPI:
    app = FastAPI()

    def authed(request: Request) -> bool:
        h = request.headers
        return fw.api_key in (h.get("x-api-key"), h.get("authorization", "").removeprefix("Bearer "))

    async def record(op: str, request: Request) -> Any:
        raw = await request.body()
        body: Any = None
        if raw:
            try:
                body = await request.json()
            except ValueError:
                body = raw
        fw.log.append(Logged(op, body, dict(request.headers), str(request.url)))
        return body

    def scripted(op: str) -> JSONResponse | None:
        codes = fw.http_fail.get(op)
        if codes:
            return _status_error(codes.pop(0))
        return None

    # -- control plane ------------------------------------------------------------------------

    @app.get("/v1/accounts")
    async def accounts(request: Request) -> Response:
        await record("accounts", request)
        if not authed(request):
            return JSONResponse({"error": "bad key"}, status_code=401)
        return JSONResponse({"accounts": [{"name": f"accounts/{fw.account}"}]})

    @app.get("/v1/accounts/{a}/models/{m}")
    async def get_model(a: str, m: str, request: Request) -> Response:
        await record("model.get", request)
        if not authed(request):
            return JSONResponse({"error": "bad key"}, status_code=401)
        name = f"accounts/{a}/models/{m}"
        if fw.offered_models is not None and name not in fw.offered_models:
            return JSONResponse({"error": {"code": 5, "message": f"model {name} not found"}}, status_code=404)
        return JSONResponse({"name": name, "state": "READY"})

    @app.get("/v1/accounts/{a}/trainingShapes/{s}/versions")
    async def shape_versions(a: str, s: str, request: Request) -> Response:
        await record("shape.list", request)
        return JSONResponse({"trainingShapeVersions": [fw.shape_version(f"accounts/{a}/trainingShapes/{s}")]})

    @app.post("/v1/accounts/{a}/rlorTrainerJobs")
    async def create_job(a: str, request: Request) -> Response:
        body = await record("job.create", request)
        if (r := scripted("job.create")) is not None:
            return r
        job_id = request.query_params["rlorTrainerJobId"]
        job = {
            "name": f"accounts/{a}/rlorTrainerJobs/{job_id}",
            "state": "JOB_STATE_PENDING" if fw.pending_polls else "JOB_STATE_RUNNING",
            "trainingConfig": {**body["trainingConfig"], "maxContextLength": 8192},
            "_pending": fw.pending_polls,
        }
        fw.jobs[job_id] = job
        return JSONResponse({k: v for k, v in job.items() if not k.startswith("_")})

    @app.get("/v1/accounts/{a}/rlorTrainerJobs/{job_id}")
    async def get_job(a: str, job_id: str, request: Request) -> Response:
        await record("job.get", request)
        job = fw.jobs.get(job_id)
        if job is None:
            return JSONResponse({"error": "not found"}, status_code=404)
        if job["_pending"] > 0:
            job["_pending"] -= 1
            if job["_pending"] == 0:
                job["state"] = "JOB_STATE_RUNNING"
        return JSONResponse({k: v for k, v in job.items() if not k.startswith("_")})

    @app.post("/v1/accounts/{a}/rlorTrainerJobs/{job_action}")
    async def resume_job(a: str, job_action: str, request: Request) -> Response:
        await record("job.resume", request)
        job = fw.jobs.get(job_action.removesuffix(":resume"))
        if job is None:
            return JSONResponse({"error": "not found"}, status_code=404)
        job["state"] = "JOB_STATE_RUNNING"
        return JSONResponse({k: v for k, v in job.items() if not k.startswith("_")})

    @app.delete("/v1/accounts/{a}/rlorTrainerJobs/{job_id}")
    async def delete_job(a: str, job_id: str, request: Request) -> Response:
        await record("job.delete", request)
        fw.jobs.pop(job_id, None)
        return JSONResponse({})

    @app.post("/v1/accounts/{a}/deployments")
    async def create_dep(a: str, request: Request) -> Response:
        body = await record("deployment.create", request)
        dep_id = request.query_params["deploymentId"]
        dep = {**body, "name": f"accounts/{a}/deployments/{dep_id}", "state": "READY"}
        fw.deployments[dep_id] = dep
        return JSONResponse(dep)

    @app.get("/v1/accounts/{a}/deployments/{dep_id}")
    async def get_dep(a: str, dep_id: str, request: Request) -> Response:
        await record("deployment.get", request)
        dep = fw.deployments.get(dep_id)
        return JSONResponse(dep) if dep else JSONResponse({"error": "not found"}, status_code=404)

    @app.delete("/v1/accounts/{a}/deployments/{dep_id}")
    async def delete_dep(a: str, dep_id: str, request: Request) -> Response:
        await record("deployment.delete", request)
        fw.deployments.pop(dep_id, None)
        return JSONResponse({})

    # -- trainer gateway ----------------------------------------------------------------------

    prefix = "/training/v1/rlorTrainerJobs/{a}/{job_id}/api/v1"

    @app.get(prefix + "/healthz")
    async def healthz(a: str, job_id: str, request: Request) -> Response:
        await record("trainer.healthz", request)
        job = fw.jobs.get(job_id)
        ok = job is not None and job["state"] == "JOB_STATE_RUNNING"
        return JSONResponse({"status": "ok"}, status_code=200 if ok else 503)

    @app.post(prefix + "/{op:path}")
    async def trainer_op(a: str, job_id: str, op: str, request: Request) -> Response:
        body = await record(f"trainer.{op}", request)
        if not authed(request):
            return JSONResponse({"error": "bad key"}, status_code=401)
        if job_id not in fw.jobs or fw.jobs[job_id]["state"] != "JOB_STATE_RUNNING":
            return JSONResponse({"error": "trainer not running"}, status_code=404)
        if (r := scripted(f"trainer.{op}")) is not None:
            return r
        if op == "client/config":
            return JSONResponse({"parallel_fwdbwd_chunks": True})
        if op == "create_session":
            return JSONResponse({"type": "create_session", "session_id": f"sess-{next(fw._ids)}"})
        if op == "session_heartbeat":
            return JSONResponse({"type": "session_heartbeat"})
        if op == "telemetry":
            return JSONResponse({"status": "accepted"})
        if op == "retrieve_future":
            return retrieve(body)
        try:
            result = _result_for(fw, op, body)
        except BadRequest as e:
            return JSONResponse({"error": {"message": str(e), "code": "INVALID_ARGUMENT"}}, status_code=400)
        if result is None:
            return JSONResponse({"error": f"unknown op {op}"}, status_code=404)
        req_id = f"req-{next(fw._ids)}"
        fw.futures[req_id] = {
            "op": op,
            "result": result,
            "try_again": fw.try_again.get(op, 0),
            "error": fw.fail_future.pop(op, None),
        }
        return JSONResponse({"request_id": req_id, "model_id": body.get("model_id") if body else None})

    def retrieve(body: dict[str, Any]) -> Response:
        fut = fw.futures.get(body["request_id"])
        if fut is None:
            return JSONResponse({"error": "unknown future"}, status_code=404)
        if fut["try_again"] > 0:
            fut["try_again"] -= 1
            return JSONResponse(
                {"type": "try_again", "request_id": body["request_id"], "queue_state": "active"}
            )
        if fut["error"]:
            return JSONResponse({"error": fut["error"], "category": "user"})
        return JSONResponse(fut["result"])

    # -- hot load -----------------------------------------------------------------------------

    @app.post("/hot_load/v1/models/hot_load")
    async def hotload(request: Request) -> Response:
        body = await record("hotload", request)
        if not authed(request):
            return JSONResponse({"error": "bad key"}, status_code=401)
        fw.loading_identity = body["identity"]
        fw._loading_polls_left = fw.hotload_loading_polls  # type: ignore[attr-defined]
        if not fw.hotload_loading_polls:
            fw.current_identity = body["identity"]
        return JSONResponse({})

    @app.get("/hot_load/v1/models/hot_load")
    async def hotload_status(request: Request) -> Response:
        await record("hotload.status", request)
        left = getattr(fw, "_loading_polls_left", 0)
        if left > 0:
            fw._loading_polls_left = left - 1  # type: ignore[attr-defined]
            stage, ready = "loading", False
        else:
            if fw.loading_identity:
                fw.current_identity = fw.loading_identity
            stage, ready = "done", True
        return JSONResponse(
            {
                "replicas": [
                    {
                        "current_snapshot_identity": fw.current_identity,
                        "readiness": ready,
                        "loading_state": {"stage": stage},
                    }
                ]
            }
        )

    # -- inference ----------------------------------------------------------------------------

    @app.post("/inference/v1/completions")
    async def completions(request: Request) -> Response:
        body = await record("completions", request)
        if not authed(request):
            return JSONResponse({"error": "bad key"}, status_code=401)
        if (r := scripted("completions")) is not None:
            return r
        if fw.completion_delay_s:
            await asyncio.sleep(fw.completion_delay_s)
        prompt = list(body["prompt"]) if isinstance(body["prompt"], list) else []
        ids = fw.completion_ids[: body.get("max_tokens", 16)]
        fw.served.append((prompt, fw.current_identity))
        k = int(body.get("top_logprobs") or 0)
        content = [
            {
                "token": f"t{t}",
                "token_id": t,
                "logprob": -0.1 * (i + 1),
                "sampling_logprob": -0.2 * (i + 1),
                "top_logprobs": [{"token_id": t + j, "logprob": -0.2 * (i + 1) - j} for j in range(k)],
            }
            for i, t in enumerate(ids)
        ]
        return JSONResponse(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "finish_reason": "stop" if len(ids) < body.get("max_tokens", 16) else "length",
                        "logprobs": {"content": content},
                        "raw_output": {"prompt_token_ids": prompt, "completion_token_ids": ids},
                    }
                ],
            }
        )

    return app


class BadRequest(ValueError):
    """A request the real trainer would refuse (answered as HTTP 400)."""


def _tokens_of(model_input: dict[str, Any]) -> list[int]:
    tokens: list[int] = []
    for chunk in model_input["chunks"]:
        if chunk.get("type") != "encoded_text":
            raise BadRequest(f"unsupported chunk type {chunk.get('type')!r}")
        tokens.extend(int(t) for t in chunk["tokens"])
    return tokens


def _tensor(d: dict[str, Any], key: str, dtype: str, n: int) -> list[Any]:
    t = d["loss_fn_inputs"].get(key)
    if t is None:
        raise BadRequest(f"loss_fn_inputs.{key} is required")
    if t.get("dtype") != dtype or t.get("shape") != [n] or len(t.get("data", [])) != n:
        raise BadRequest(
            f"loss_fn_inputs.{key} must be {dtype} of shape [{n}], got {t.get('dtype')} {t.get('shape')}"
        )
    return list(t["data"])


def _cross_entropy_forward(fw: FakeFireworks, model: FakeModel, data: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-target logprobs the way the trainer computes them: position j scores target j after
    model_input[: j + 1]."""
    outputs, loss = [], 0.0
    steps = 0 if model.base_only else model.steps
    for d in data:
        tokens = _tokens_of(d["model_input"])
        n = len(tokens)
        if n == 0:
            raise BadRequest("empty model_input")
        if set(d["loss_fn_inputs"]) - {"target_tokens", "weights"}:
            raise BadRequest(
                f"cross_entropy takes target_tokens and weights, got {sorted(d['loss_fn_inputs'])}"
            )
        targets = [int(t) for t in _tensor(d, "target_tokens", "int64", n)]
        weights = [float(w) for w in _tensor(d, "weights", "float32", n)]
        lps = [teacher_logprob(tokens[: j + 1], targets[j], steps) for j in range(n)]
        loss += -sum(lp * w for lp, w in zip(lps, weights, strict=True))
        lps = lps[: max(0, n - fw.forward_short_by)]
        outputs.append({"logprobs": {"data": lps, "dtype": "float32", "shape": [len(lps)]}})
    return {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs, "metrics": {"loss:sum": loss}}


def _result_for(fw: FakeFireworks, op: str, body: dict[str, Any]) -> dict[str, Any] | None:
    if op == "create_model":
        model_id = f"model-{next(fw._ids)}"
        base_only = bool(body.get("base_only"))
        if base_only and body.get("lora_config"):
            raise BadRequest("a base_only model takes no lora_config")
        fw.models[model_id] = FakeModel(body["base_model"], base_only)
        return {"type": "create_model", "model_id": model_id}
    model = fw.models.get(body.get("model_id") or "") if body else None
    if op in ("forward_backward", "forward", "optim_step", "unload_model") and (
        model is None or model.unloaded
    ):
        raise BadRequest(f"unknown or unloaded model_id {body.get('model_id') if body else None!r}")
    if op == "unload_model":
        assert model is not None
        model.unloaded = True
        return {"type": "unload_model", "model_id": body["model_id"]}
    if op == "forward" and body["forward_input"]["loss_fn"] == "cross_entropy":
        assert model is not None
        return _cross_entropy_forward(fw, model, body["forward_input"]["data"])
    if model is not None and model.base_only and op in ("forward_backward", "optim_step"):
        raise BadRequest(f"{op} on a base-only (frozen) model")
    if op in ("forward_backward", "forward"):
        data = body[f"{op}_input" if op == "forward" else "forward_backward_input"]["data"]
        if op == "forward_backward" and model is not None:
            model.pending.extend(tuple(_tokens_of(d["model_input"])) for d in data)
        outputs, loss = [], 0.0
        for d in data:
            adv = d["loss_fn_inputs"]["advantages"]["data"]
            n = len(adv)
            loss += -sum(adv)
            outputs.append({"logprobs": {"data": [-1.0] * n, "dtype": "float32", "shape": [n]}})
        return {
            "loss_fn_output_type": "ArrayRecord",
            "loss_fn_outputs": outputs,
            "metrics": {"loss:sum": loss},
        }
    if op == "optim_step":
        assert model is not None
        model.steps += 1
        model.trained, model.pending = model.trained + model.pending, []
        return {"type": "optim_step", "metrics": {"grad_norm:mean": 0.5}}
    if op == "save_weights_for_sampler":
        return {"type": "save_weights_for_sampler", "path": body["path"]}
    if op == "save_weights":
        if model is not None:
            fw.saved_states[body["path"]] = (model.steps, list(model.trained))
        return {"type": "save_weights", "path": body["path"]}
    if op == "load_weights":
        if model is not None and body["path"] in fw.saved_states:
            model.steps, trained = fw.saved_states[body["path"]]
            model.trained, model.pending = list(trained), []
        return {"type": "load_weights", "path": body["path"]}
    return None


class ServerThread:
    """Runs the app with uvicorn on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, fw: FakeFireworks) -> None:
        self.fw = fw
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        config = uvicorn.Config(build_app(fw), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake fireworks server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
