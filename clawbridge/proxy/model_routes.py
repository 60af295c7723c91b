"""The model-call routes of every API shape, and the one handler they share.

Each API (chat completions, Anthropic messages, responses) is an `ApiAdapter`: it validates its
body into the normalised request (`ChatRequest` + the OpenAI-shaped data the renderer takes) and
names its `ApiShape`. `serve_model_call` does the rest the same way for all of them: key, body,
OpenClaw-RL body fields, session, model, then `SampledCall.respond`.

Routes, for API path `P` in `chat/completions`, `messages`, `responses`:
- `/v1/P` and `/P` (AReaL's gateway base URL has no `/v1`);
- `/s/{session_id}/v1/P` (the session in the URL);
- `/{trajectory_uid}/{prompt_uid}/v1/P` (Claw-R1's black-box base URL: the trajectory is the
  session, the prompt uid its task id, so a prompt's samples form one group for the baseline).

Invariants:
- A request without `model` is served by the served model; any other name than the served one,
  `default`, or either with `@N` (committed policy version N, `clawbridge.serving.versions`) is a 404.
- Every failure is answered in the adapter's error shape with the `ApiError`'s status; never a
  traceback, never a 500 for bad input.
- Whether the caller may record into the session, build on a previous response, or name a
  version is `clawbridge.access`'s table (`sessions` x `record`, `turns` x `continue`, `versions` x
  `pin`); the store checks the turn's owner again when it records it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from clawbridge.access import Denied, Principal
from clawbridge.proxy.call import ApiShape, SampledCall
from clawbridge.proxy.errors import ApiError, denied
from clawbridge.proxy.inflight import Ticket, ticket_of
from clawbridge.proxy.ownership import caller, check_recordable
from clawbridge.proxy.request import ChatRequest, parse_json_object, read_body, stored_request
from clawbridge.proxy.sessions import check_session_id, pop_session_fields, resolve_call_session
from clawbridge.proxy.state import ProxyState
from clawbridge.serving.versions import parse_versioned

log = logging.getLogger("clawbridge.proxy")

TRAJECTORY_SOURCE = "trajectory"


@dataclass(frozen=True)
class Prepared:
    """A validated request: what is rendered and sampled, and the shape it is answered in."""

    req: ChatRequest
    data: dict[str, Any]
    """OpenAI chat-shaped request data (`messages`, `tools`, `tool_choice`) given to the renderer."""
    shape: Callable[[SampledCall], ApiShape]
    meta: dict[str, Any] = field(default_factory=dict)
    """Recorded in the turn's meta (e.g. the Responses `store` flag)."""
    reads: tuple[str, ...] = ()
    """Sessions whose recorded calls the request builds on (previous_response_id), each checked in
    `prepare` (`turns` x `continue`)."""


class ApiAdapter(Protocol):
    """One API's request validation and error shape (docs/architecture.md: a new API shape).

    No fake of its own: its tests run the real app over a fake sampler
    (`tests/fake_proxy.start_fake_proxy`) with the API's real SDK: tests/test_chat_scripted.py,
    tests/test_anthropic_api.py, tests/test_responses_api.py."""

    name: str
    """Recorded as the turn's `meta.api`."""
    prepare_reads_store: bool
    """Whether `prepare` may read the store (previous_response_id): it then never runs on the loop."""

    def prepare(self, state: ProxyState, body: dict[str, Any], by: Principal) -> Prepared:
        """Validate `body` (raising `ApiError` 4xx) into what the shared path runs; what it reads
        of recorded turns (previous_response_id) is what `by` may continue (`clawbridge.access`)."""
        ...

    def error_response(self, err: ApiError) -> Response: ...


def check_model(state: ProxyState, model: str) -> None:
    """404 unless `model` names the served model: its id, `default`, or either `@N` (a committed
    version; whether N is kept is checked when the call is routed, `clawbridge.serving.versions`)."""
    name = state.model_info.name
    if model not in (name, "default") and parse_versioned(model, (name, "default")) is None:
        raise ApiError(404, f"model {model!r} is not served here; use {name!r} or 'default' "
                       f"(or {name + '@N'!r} for committed policy version N)", code="model_not_found", param="model")


def parse_and_prepare(state: ProxyState, api: ApiAdapter, raw: bytes,
                      by: Principal) -> tuple[Prepared, dict[str, Any], str]:
    """The body parsed and validated: what is sampled, OpenClaw-RL's session fields (removed from
    the body), and the request as it is recorded (`stored_request`)."""
    body = parse_json_object(raw, state.settings.max_messages)
    stored = stored_request(raw, body)
    fields = pop_session_fields(body)
    if body.get("model") is None:
        body["model"] = state.model_info.name
    return api.prepare(state, body, by), fields, stored


async def serve_model_call(state: ProxyState, api: ApiAdapter, request: Request, url_session: str | None,
                           task_id: str | None = None) -> Response:
    """Serve one model call of any API; every failure is answered in `api`'s error shape."""
    try:
        ticket = ticket_of(request.scope) or Ticket(state.store.tombstones.epoch)  # taken before the key check
        principal = await caller(state, request, "sessions", "record")
        state.inflight.identify(ticket, principal.user)  # 401 for a user being forgotten
        settings = state.settings
        raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        # Parsing and validation grow with the body (up to max_body_bytes): off the loop when large.
        prepared, fields, stored = await state.compute(len(raw), parse_and_prepare, state, api, raw, principal,
                                                       reads_store=api.prepare_reads_store)
        source = TRAJECTORY_SOURCE if task_id is not None else "url"
        call = resolve_call_session(request, principal, url_session, prepared.data["messages"], fields, source)
        if call.source != "implicit":
            await check_recordable(state, principal, call.session_id)
        call = dataclasses.replace(call, meta={**call.meta, **prepared.meta, "api": api.name})
        check_model(state, prepared.req.model)
        if task_id is not None and call.source == TRAJECTORY_SOURCE:
            await state.writer.call(state.store.ensure_session, call.session_id, TRAJECTORY_SOURCE, task_id,
                                    call.user)
        sampled = SampledCall(state, prepared.req, prepared.data, stored, call, with_history=bool(prepared.reads),
                              ticket=ticket)
        return await sampled.respond(request, prepared.shape(sampled))
    except ApiError as exc:
        return api.error_response(exc)
    except Denied as exc:  # `clawbridge.access`, raised below the proxy (the store, the router)
        return api.error_response(denied(exc))
    except Exception:
        log.exception("unexpected error while handling %s", request.url.path)
        return api.error_response(ApiError(500, "internal error; see the clawbridge log"))


def openai_error(err: ApiError) -> Response:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def add_model_routes(app: FastAPI, state: ProxyState, path: str, api: ApiAdapter) -> None:
    """Register `api` at `/v1/{path}`, `/{path}`, `/s/{sid}/v1/{path}` and the Claw-R1 form."""

    async def plain(request: Request) -> Response:
        return await serve_model_call(state, api, request, None)

    async def in_session(request: Request, session_id: str) -> Response:
        return await serve_model_call(state, api, request, session_id)

    async def in_trajectory(request: Request, trajectory_uid: str, prompt_uid: str) -> Response:
        try:
            check_session_id(prompt_uid, "prompt uid in the URL")
        except ApiError as exc:
            return api.error_response(exc)
        return await serve_model_call(state, api, request, trajectory_uid, task_id=prompt_uid)

    app.add_api_route(f"/v1/{path}", plain, methods=["POST"])
    app.add_api_route(f"/{path}", plain, methods=["POST"])
    # /s/... before the two-segment Claw-R1 form, which would match it too.
    app.add_api_route(f"/s/{{session_id}}/v1/{path}", in_session, methods=["POST"])
    app.add_api_route(f"/{{trajectory_uid}}/{{prompt_uid}}/v1/{path}", in_trajectory, methods=["POST"])
