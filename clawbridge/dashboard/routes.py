"""HTTP routes of the dashboard and `/metrics`.

- GET  /dashboard, /dashboard/sessions/{id}    pages (the login form until logged in)
- POST /dashboard/login (form: key), POST /dashboard/logout, GET /dashboard/link/{one-time token}
- GET  /dashboard/static/{file}                the page's own JS/CSS, shipped in the package
- GET  /dashboard/api/overview, /dashboard/api/sessions, /dashboard/api/sessions/{id}
- POST /dashboard/api/sessions/{id}/reward {reward, turn_id?}, /dashboard/api/sessions/{id}/end
- POST /dashboard/api/promotion/promote {version, user?}, /dashboard/api/promotion/rollback {version, user?}
  (`clawbridge.proxy.promotion_routes.set_serving`: a user's version only in the lane named),
  /dashboard/api/promotion/resume {} (ends a rollback's hold)
- POST /dashboard/api/notes/{note_id}/delete   (a note from talk, any user's: gone from the store and the next call)
- GET  /metrics                                 Prometheus text (admin key, metrics key, or login)

Invariants: no data leaves without a login or the admin key (`DashboardAuth`); pages and API
answers are `Cache-Control: no-store`; every page carries a Content-Security-Policy that allows
only this server's own scripts and styles (no CDN, works offline); a reward set here is answered
only after it is committed. The HTML routes (pages, login, link, static files) are left out of the
OpenAPI document: they answer browsers (a refused login is the login page again, status 401);
the JSON routes answer OpenAI-style errors like every other route.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape
from pydantic import BaseModel, ConfigDict

from clawbridge.access import OPERATOR
from clawbridge.dashboard import data
from clawbridge.dashboard.auth import COOKIE, LOGIN_TTL_S, DashboardAuth
from clawbridge.promotion import admin
from clawbridge.proxy.auth import presented_key
from clawbridge.proxy.errors import ApiError
from clawbridge.proxy.promotion_routes import promoter_of, set_serving, version_body
from clawbridge.proxy.request import parse_json_object, read_body
from clawbridge.proxy.state import ProxyState
from clawbridge.runtime.keys import keys_equal
from clawbridge.store import StoreError
from clawbridge.telemetry.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger("clawbridge.dashboard")

STATIC_FILES = {"dashboard.js": "text/javascript", "chart.js": "text/javascript", "dashboard.css": "text/css"}
HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
MAX_FORM_BYTES = 4096

_env = Environment(loader=PackageLoader("clawbridge.dashboard", "templates"), autoescape=select_autoescape(["html"]))


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float
    turn_id: str | None = None


def _page(name: str, status: int = 200, **ctx: Any) -> HTMLResponse:
    return HTMLResponse(_env.get_template(name).render(**ctx), status_code=status, headers=HEADERS)


def _json(body: dict[str, Any]) -> JSONResponse:
    return JSONResponse(body, headers={"Cache-Control": "no-store"})


def _logged_in(target: str, token: str) -> RedirectResponse:
    resp = RedirectResponse(target, status_code=303, headers={"Cache-Control": "no-store"})
    resp.set_cookie(COOKIE, token, max_age=int(LOGIN_TTL_S), path="/", httponly=True, samesite="strict")
    return resp


async def _read_form(request: Request) -> bytes:
    """The login form's body: urlencoded or no type (else 415), at most `MAX_FORM_BYTES` (else 413)."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media not in ("", "application/x-www-form-urlencoded"):
        raise ApiError(415, "send the login as a form (application/x-www-form-urlencoded) with field 'key'",
                       code="unsupported_media_type")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise ApiError(413, f"login form over {MAX_FORM_BYTES} bytes")
    return body


def build_dashboard_router(state: ProxyState, auth: DashboardAuth, metrics: Metrics) -> APIRouter:
    router = APIRouter()
    started_at = time.time()

    # ------------------------------------------------------------------ login
    def login_page(status: int = 200, error: str | None = None) -> HTMLResponse:
        return _page("login.html", status, error=error, model=state.model_info.name)

    @router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def index(request: Request) -> HTMLResponse:
        viewer = auth.viewer(request)
        if viewer is None or viewer.login is None:
            return login_page()
        return _page("index.html", csrf=viewer.login.csrf, model=state.model_info.name)

    @router.get("/dashboard/sessions/{session_id}", response_class=HTMLResponse, include_in_schema=False)
    async def session_page(request: Request, session_id: str) -> HTMLResponse:
        viewer = auth.viewer(request)
        if viewer is None or viewer.login is None:
            return login_page()
        return _page("session.html", csrf=viewer.login.csrf, model=state.model_info.name, session_id=session_id)

    @router.post("/dashboard/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        form = parse_qs((await _read_form(request)).decode("utf-8", errors="replace"), max_num_fields=4)
        token = auth.login((form.get("key") or [""])[0].strip())
        if token is None:
            log.warning("dashboard login refused (wrong or missing admin key) from %s",
                        request.client.host if request.client else "?")
            return login_page(401, "That is not the admin key.")
        log.info("dashboard login from %s", request.client.host if request.client else "?")
        return _logged_in("/dashboard", token)

    @router.get("/dashboard/link/{token}", include_in_schema=False)
    async def link(token: str) -> Response:
        cookie = auth.redeem_link(token)
        if cookie is None:
            return login_page(401, "That login link was used already or has expired; log in with the admin key.")
        log.info("dashboard login by one-time link")
        return _logged_in("/dashboard", cookie)

    @router.post("/dashboard/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        auth.require_write(request)
        token = request.cookies.get(COOKIE)
        if token:
            auth.logout(token)
        resp = RedirectResponse("/dashboard", status_code=303)
        resp.delete_cookie(COOKIE, path="/")
        return resp

    @router.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in STATIC_FILES:
            raise ApiError(404, f"no static file {name!r}")
        body = resources.files("clawbridge.dashboard").joinpath("static", name).read_bytes()
        return Response(body, media_type=STATIC_FILES[name], headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------------ data
    config: list[dict[str, Any]] = []  # the resolved configuration, read once: it does not change while serving

    def overview_data() -> dict[str, Any]:
        if not config:
            config.append(data.masked_config(state.settings))  # entry points and sections: ~40 ms
        return data.overview(state, started_at, config[0])

    @router.get("/dashboard/api/overview")
    async def overview(request: Request) -> JSONResponse:
        auth.require(request)
        return _json(await asyncio.to_thread(overview_data))

    @router.get("/dashboard/api/sessions")
    async def sessions(request: Request, limit: int = 50, offset: int = 0, status: str | None = None) -> JSONResponse:
        auth.require(request)
        if not 1 <= limit <= 500 or offset < 0:
            raise ApiError(422, "limit must be 1..500 and offset >= 0", param="limit")
        if status not in (None, "", "active", "ended"):
            raise ApiError(422, "status must be active or ended", param="status")
        return _json(await asyncio.to_thread(data.session_list, state, limit, offset, status or None))

    @router.get("/dashboard/api/sessions/{session_id}")
    async def session(request: Request, session_id: str) -> JSONResponse:
        auth.require(request)
        doc = await asyncio.to_thread(data.session_detail, state, session_id)
        if doc is None:
            raise ApiError(404, f"unknown session {session_id!r}", code="session_not_found")
        return _json(doc)

    @router.post("/dashboard/api/sessions/{session_id}/reward")
    async def set_reward(request: Request, session_id: str) -> JSONResponse:
        auth.require_write(request)
        body = parse_json_object(await read_body(request, MAX_FORM_BYTES))
        try:
            req = RewardBody.model_validate(body)
        except ValueError:
            raise ApiError(422, "send {\"reward\": <number>, \"turn_id\": <turn id or null>}", param="reward") from None
        if not math.isfinite(req.reward):
            raise ApiError(422, "reward must be a finite number", param="reward")
        if await state.read(state.store.get_session, session_id) is None:
            raise ApiError(404, f"unknown session {session_id!r}", code="session_not_found")
        try:
            reward_id = await state.writer.call(state.store.add_reward, session_id, req.reward, "dashboard",
                                                req.turn_id)
        except StoreError as exc:
            raise ApiError(404, str(exc), code="turn_not_found") from None
        log.info("reward %g set from the dashboard on %s", req.reward, req.turn_id or session_id)
        return _json({"reward_id": reward_id, "session_id": session_id, "turn_id": req.turn_id, "reward": req.reward})

    @router.post("/dashboard/api/sessions/{session_id}/end")
    async def end(request: Request, session_id: str) -> JSONResponse:
        auth.require_write(request)
        if await state.read(state.store.get_session, session_id) is None:
            raise ApiError(404, f"unknown session {session_id!r}", code="session_not_found")
        ended = await state.end_session(session_id)
        log.info("session %s ended from the dashboard", session_id)
        return _json({"session_id": session_id, "ended": ended})

    @router.post("/dashboard/api/promotion/{action}")
    async def serve_version(request: Request, action: str) -> JSONResponse:
        auth.require_write(request)
        if action not in ("promote", "rollback", "resume"):
            raise ApiError(404, f"no promotion action {action!r} (promote, rollback or resume)")
        body = parse_json_object(await read_body(request, MAX_FORM_BYTES))
        if action == "resume":
            resumed = await admin.resume(promoter_of(state))
            log.info("training resumed from the dashboard")
            return _json(resumed)
        req = version_body(body)
        out = await set_serving(state, OPERATOR, req, action)  # a login is the admin's (DashboardAuth)
        log.info("v%d served from the dashboard (%s%s)", req.version, action, f", user {req.user}" if req.user else "")
        return _json(out)

    @router.post("/dashboard/api/notes/{note_id}/delete")
    async def delete_note(request: Request, note_id: int) -> JSONResponse:
        auth.require_write(request)
        book = state.notes
        if book is None:
            raise ApiError(404, "notes are off on this server (notes = false)",
                           code="notes_off")
        if not await state.writer.call(book.delete, note_id, None):
            raise ApiError(404, f"no note {note_id}", code="note_not_found", param="note_id")
        log.info("note %d deleted from the dashboard", note_id)
        return _json({"note_id": note_id, "deleted": True})

    # ------------------------------------------------------------------ metrics
    metrics_key = state.settings.metrics_key.get_secret_value() if state.settings.metrics_key else None

    @router.get("/metrics")
    async def prometheus(request: Request) -> Response:
        key = presented_key(request)
        if auth.viewer(request) is None and not (metrics_key and key and keys_equal(key, metrics_key)):
            raise ApiError(401, "send the admin key or CLAWBRIDGE_METRICS_KEY as 'Authorization: Bearer'",
                           code="metrics_key_required")
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    return router
