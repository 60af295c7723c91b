"""A local stand-in for Fireworks: control plane, trainer gateway, hot load and inference.

It speaks the wire protocol of the `fireworks-ai==1.2.28` training SDK (learned from the SDK's
source, written here from scratch) so tests run the real, unmodified SDK against 127.0.0.1:

- Control plane (`X-Api-Key`): `GET /v1/accounts`; training shapes
  `GET /v1/accounts/{a}/trainingShapes/{s}/versions?filter=latest_validated=true` and
  `.../versions/{v}`; trainer jobs `POST /v1/accounts/{a}/rlorTrainerJobs?trainingShape=..&rlorTrainerJobId=..`,
  `GET|DELETE .../rlorTrainerJobs/{id}`, `POST .../rlorTrainerJobs/{id}:resume`; deployments
  `POST /v1/accounts/{a}/deployments?deploymentId=..`, `GET|PATCH|DELETE .../deployments/{id}`.
- Trainer gateway, `/training/v1/rlorTrainerJobs/{a}/{job}` + `/api/v1/healthz` and the
  Tinker-style JSON API: `client/config`, `create_session`, `session_heartbeat`, `create_model`,
  `forward_backward`, `optim_step`, `save_weights_for_sampler`, `save_weights`, `load_weights`,
  `telemetry`; each mutating call returns `{request_id}` and `retrieve_future` answers
  `{"type": "try_again", ...}`, `{"error", "category"}` or the result.
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
        result = _result_for(fw, op, body)
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


def _result_for(fw: FakeFireworks, op: str, body: dict[str, Any]) -> dict[str, Any] | None:
    if op == "create_model":
        return {"type": "create_model", "model_id": f"model-{next(fw._ids)}"}
    if op in ("forward_backward", "forward"):
        data = body[f"{op}_input" if op == "forward" else "forward_backward_input"]["data"]
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
        return {"type": "optim_step", "metrics": {"grad_norm:mean": 0.5}}
    if op == "save_weights_for_sampler":
        return {"type": "save_weights_for_sampler", "path": body["path"]}
    if op == "save_weights":
        return {"type": "save_weights", "path": body["path"]}
    if op == "load_weights":
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
