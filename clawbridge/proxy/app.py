"""The FastAPI app: OpenAI- and Anthropic-compatible model calls, the session API, health.

Invariants: see `chat` (token exactness, commit before last byte), `errors` (never a 500 for
bad input) and `guard` (Host check, draining). Idle sessions are ended by a background task every
`reaper_interval_s`. The OpenAPI schema is served only to a caller with a key (`/openapi.json`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from clawbridge.dashboard import install_dashboard
from clawbridge.proxy.anthropic import MessagesApi, build_anthropic_router
from clawbridge.proxy.chat import ChatApi
from clawbridge.proxy.errors import ApiError, install_error_handlers
from clawbridge.proxy.guard import GuardMiddleware, HostPolicy
from clawbridge.proxy.inflight import InFlightMiddleware
from clawbridge.proxy.model_routes import add_model_routes
from clawbridge.proxy.notes_routes import build_notes_router
from clawbridge.proxy.openapi import openapi_document
from clawbridge.proxy.ownership import caller
from clawbridge.proxy.promotion_routes import build_promotion_router
from clawbridge.proxy.responses import ResponsesApi, add_responses_retrieval
from clawbridge.proxy.rl_routes import build_rl_router
from clawbridge.proxy.state import ProxyState
from clawbridge.proxy.trajectory_routes import build_trajectory_router
from clawbridge.proxy.user_routes import build_user_router

log = logging.getLogger("clawbridge.proxy")


async def _reap_idle(state: ProxyState) -> None:
    idle = state.settings.session_idle_timeout_s
    interval = max(0.2, min(30.0, idle / 4))
    while True:
        await state.store.clock.sleep(interval)  # the store's clock: a test moves it instead of waiting
        try:
            ended = await state.end_idle(idle)
            if ended:
                log.info("ended %d idle session(s)", len(ended))
        except Exception:
            log.exception("idle-session reaper failed; will retry")


def build_app(state: ProxyState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        reaper = asyncio.create_task(_reap_idle(state))
        if state.trainer is not None:
            if state.promotion is not None and state.trainer.gate is state.promotion:
                state.promotion.start_baseline()  # "still good?" from the start, never under the trainer's lock
            await state.trainer.start()
        if state.lanes is not None:
            await state.lanes.start()
        if state.judge is not None:
            await state.judge.start()
        if state.reporter is not None:
            await state.reporter.start()
        if state.deletions is not None:
            state.deletions.start()
        try:
            yield
        finally:
            if state.deletions is not None:
                await state.deletions.stop()
            if state.reporter is not None:
                await state.reporter.stop()
            if state.judge is not None:
                await state.judge.stop()
            if state.lanes is not None:
                await state.lanes.stop()
            if state.trainer is not None:
                await state.trainer.stop()
            if state.promotion is not None:
                await state.promotion.stop()
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper

    app = FastAPI(title="clawbridge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = state
    install_error_handlers(app)
    app.add_middleware(InFlightMiddleware, inflight=state.inflight)  # inside the guard: every request it lets in
    app.add_middleware(GuardMiddleware, hosts=HostPolicy(state.settings.host, state.settings.allowed_hosts),
                       drain=state.drain)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        await caller(state, request, "models", "read")
        return JSONResponse(openapi_document(app))

    async def models_body() -> dict[str, Any]:
        info = state.model_info
        entry = {"object": "model", "owned_by": "clawbridge", "created": 0,
                 "context_window": info.context_window, "max_output_tokens": info.max_output_tokens}
        serving = {**entry, "policy_version": state.router.serving_version}
        # Every version `NAME@N` can name now (clawbridge.serving.versions), oldest first.
        kept = [{"id": f"{info.name}@{v}", **entry, "policy_version": v} for v in await state.router.kept_versions()]
        return {"object": "list", "data": [{"id": info.name, **serving}, {"id": "default", **serving}, *kept]}

    async def models(request: Request) -> dict[str, Any]:
        await caller(state, request, "models", "read")
        return await models_body()

    # The same list under every base URL a client may be given (see model_routes).
    for path in ("/v1/models", "/models", "/s/{session_id}/v1/models", "/{trajectory_uid}/{prompt_uid}/v1/models"):
        app.add_api_route(path, models, methods=["GET"])

    @app.get("/health")
    @app.get("/v1/health")
    @app.get("/healthz")
    async def health() -> Response:
        """200 `ok`, or 503 `failing` with `store` saying why turns cannot be recorded now."""
        problem = state.writer.problem(state.settings.min_free_disk_bytes)
        body = {"status": "failing" if problem else "ok", "model": state.model_info.name,
                "backend": state.backend.name, "policy_version": state.router.serving_version,
                "store": problem or "ok"}
        return JSONResponse(body, status_code=503 if problem else 200)

    app.include_router(build_user_router(state, [state.lanes] if state.lanes is not None else []))  # before /rl/*: its own prefix
    app.include_router(build_promotion_router(state))
    app.include_router(build_notes_router(state))
    app.include_router(build_rl_router(state))
    app.include_router(build_anthropic_router(state))
    add_model_routes(app, state, "chat/completions", ChatApi())
    add_model_routes(app, state, "messages", MessagesApi())
    add_model_routes(app, state, "responses", ResponsesApi())
    add_responses_retrieval(app, state)
    app.include_router(build_trajectory_router(state))
    install_dashboard(app, state)

    @app.post("/v1/completions")
    async def legacy_completions() -> Response:
        raise ApiError(404, "legacy /v1/completions is not served; use /v1/chat/completions")

    return app
