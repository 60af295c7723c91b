"""Who may see the dashboard: the admin, logged in once with the admin key.

The admin key is typed into the login form (a POST body, never a URL) or presented as
`Authorization: Bearer <admin key>`; a login gives a random token kept in a cookie that is
HttpOnly (no script reads it), SameSite=Strict (no other site sends it) and Path=/. `clawbridge up`
can also print a one-time link: its token works once, for `LINK_TTL_S`, and the cookie it gives is
a fresh login token, so the link is worthless once used or after it expires.

Invariants:
- Tokens are kept only as their sha256; the admin key is never stored, logged or put in a URL.
- Every state-changing request made with the cookie must carry that login's CSRF token in
  `X-CSRF-Token` (compared in constant time); a request with the admin key in a header needs
  none (a header is no ambient credential a foreign page could make the browser send).
- At most `MAX_LOGINS` logins live at once (the oldest is forgotten first); each expires.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from fastapi import Request

from clawbridge.proxy.auth import presented_key
from clawbridge.proxy.errors import ApiError
from clawbridge.runtime.keys import keys_equal

COOKIE = "clawbridge_dashboard"
CSRF_HEADER = "x-csrf-token"
LOGIN_TTL_S = 12 * 3600.0
LINK_TTL_S = 600.0
MAX_LOGINS = 64


def _h(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Login:
    """One logged-in browser."""

    csrf: str
    expires_at: float


@dataclass(frozen=True)
class Viewer:
    """An authenticated dashboard request: by cookie (with its login) or by the admin key header."""

    kind: Literal["cookie", "admin_key"]
    login: Login | None = None


class DashboardAuth:
    """Logins, one-time links and CSRF checks for one running server (in memory: a restart logs
    everyone out)."""

    def __init__(self, admin_key: str, clock: Callable[[], float] = time.time) -> None:
        self._admin_key = admin_key
        self._clock = clock
        self._logins: OrderedDict[str, Login] = OrderedDict()
        self._links: dict[str, float] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ issuing
    def _new_login(self) -> str:
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._logins[_h(token)] = Login(secrets.token_urlsafe(24), self._clock() + LOGIN_TTL_S)
            while len(self._logins) > MAX_LOGINS:
                self._logins.popitem(last=False)
        return token

    def login(self, key: str) -> str | None:
        """A cookie token when `key` is the admin key, else None."""
        return self._new_login() if key and keys_equal(key, self._admin_key) else None

    def issue_link(self) -> str:
        """A one-time login token for a link (`/dashboard/link/<token>`)."""
        token = secrets.token_urlsafe(32)
        with self._lock:
            now = self._clock()
            self._links = {h: t for h, t in self._links.items() if t > now}
            self._links[_h(token)] = now + LINK_TTL_S
        return token

    def redeem_link(self, token: str) -> str | None:
        """A cookie token for a valid, unused, unexpired link token (which is used up)."""
        with self._lock:
            expires = self._links.pop(_h(token), None)
        if expires is None or expires <= self._clock():
            return None
        return self._new_login()

    def logout(self, token: str) -> None:
        with self._lock:
            self._logins.pop(_h(token), None)

    # ------------------------------------------------------------------ checking
    def check(self, token: str | None) -> Login | None:
        if not token:
            return None
        with self._lock:
            login = self._logins.get(_h(token))
            if login is not None and login.expires_at <= self._clock():
                del self._logins[_h(token)]
                return None
        return login

    def viewer(self, request: Request) -> Viewer | None:
        """The cookie's login, else the admin key in a header, else None."""
        login = self.check(request.cookies.get(COOKIE))
        if login is not None:
            return Viewer("cookie", login)
        key = presented_key(request)
        if key is not None and keys_equal(key, self._admin_key):
            return Viewer("admin_key")
        return None

    def require(self, request: Request) -> Viewer:
        viewer = self.viewer(request)
        if viewer is None:
            raise ApiError(401, "log in at /dashboard with the admin key, or send it as 'Authorization: Bearer'",
                           code="dashboard_login_required")
        return viewer

    def require_write(self, request: Request) -> Viewer:
        """`require`, plus the CSRF token for a cookie login."""
        viewer = self.require(request)
        if viewer.kind == "cookie":
            assert viewer.login is not None
            sent = request.headers.get(CSRF_HEADER, "")
            if not sent or not keys_equal(sent, viewer.login.csrf):
                raise ApiError(403, "missing or wrong CSRF token (reload the dashboard page)", code="csrf_failed")
        return viewer
