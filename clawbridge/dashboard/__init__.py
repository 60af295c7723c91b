"""The web dashboard (`/dashboard`) and Prometheus metrics (`/metrics`) of a running proxy.

Server-rendered Jinja2 page shells plus one small script of our own (`static/dashboard.js`,
`static/chart.js`: SVG charts) that polls JSON every few seconds. Nothing is fetched from
elsewhere, so the page works offline. See `auth` for who may look, `data` for what is shown.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import RedirectResponse

from clawbridge.dashboard.auth import DashboardAuth
from clawbridge.dashboard.routes import build_dashboard_router
from clawbridge.proxy.state import ProxyState
from clawbridge.telemetry.metrics import HttpMetrics, Metrics


def install_dashboard(app: FastAPI, state: ProxyState) -> DashboardAuth:
    """Add `/dashboard`, `/metrics` and the request metrics middleware to `app`; the login
    manager is returned and kept as `app.state.dashboard` (for the one-time link `up` prints)."""
    auth = DashboardAuth(state.keys.admin)
    metrics = Metrics(state.store, lambda: state.sampler.policy_version,
                      state.privacy.status if state.privacy is not None else None)
    app.add_middleware(HttpMetrics, metrics=metrics)
    app.include_router(build_dashboard_router(state, auth, metrics))

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard", status_code=307)

    app.state.dashboard = auth
    app.state.metrics = metrics
    return auth
