"""Who may see or do what: one table (`TABLE`), and the one function that reads it (`check`).

Every route of the proxy and the dashboard, the store's session writes and the version router
ask `check`; nothing else decides. `tests/test_access.py` drives the real app over HTTP with a
real key of every kind against every route, and asserts the status this table implies.

Who calls (`Principal`, made from the key by `clawbridge.proxy.auth`):
- `admin`: the admin key (and the server's own tools: `OPERATOR`). No user.
- `user`: a user's key, or the shared client key naming a user with a trusted `X-User-Id`.
- `client`: the shared client key. No user.
- `session`: a session key (`/rl/start_session`): its session, and that session's user.
An unknown key and a revoked user's key never become a principal: 401 before the table is read.

What is asked about: a `Resource` and an `Action`, and for most of them one object (`Target`):
a session (its id and owner), or a policy version (its lane: '' the shared policy, else the user
whose adapter it is). The table gives each key kind a `Scope` of the objects it may act on.

Invariants:
- Lanes never cross. A version of a user's lane answers (`pin`) only that user's calls; the admin
  serves (`serve`: promote, rollback) a version only in the lane it names (`Principal.in_lane`),
  so an adapter trained on one person's data never serves anyone else by mistake.
- A key never learns that another user's session or version exists: where the key could not read
  the object anyway, a refusal is `Hidden` and the route answers exactly as for an object that
  does not exist. A session key naming another session is 403 `session_mismatch` (it knows only
  its own id, so the answer tells nothing); the admin, who sees everything, gets a 403 naming why.
- Data never changes owner: a turn is recorded only into a session of its caller's owner, and a
  response is continued (`previous_response_id`, whose text the new turn records again) only by
  its owner, the admin included: forgetting a user must find all of her text under her name.
- A user's namespace is hers: a session id `alice:...` (`namespace_of`) is created only for
  alice while alice is a user (the store keeps this inside its write transaction,
  `clawbridge.store.owners.check_session_write`), and recording into it with any other key is 403
  whether or not the session exists: a key can tell that a name is a user's, never which of her
  sessions exist.
- Everything here is pure: no I/O, no imports from the rest of clawbridge, so the store (below
  the proxy) and the router ask the same table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum
from typing import Literal

# --------------------------------------------------------------------------------------------
# Names and namespaces

USER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""1-64 characters: letters, digits, `.`, `_`, `-`; starting with a letter or digit."""
USER_NAME_RULE = "1-64 characters from letters, digits and ._- (starting with a letter or digit)"
SCOPE_SEP = ":"
"""Between a user and the session id the client named (`alice:agent:main:main`)."""


def scoped_session_id(user: str | None, session_id: str) -> str:
    """The stored id of a session a client named: `user:id` for a user (two users' agents may
    both call their session `main`), the id itself without a user."""
    return session_id if user is None else f"{user}{SCOPE_SEP}{session_id}"


def namespace_of(session_id: str) -> str | None:
    """The user name whose namespace `session_id` is in (`alice` for `alice:main`), or None when
    the part before the first `:` cannot be a user name (no `:`, or `-x:...`)."""
    head, sep, _ = session_id.partition(SCOPE_SEP)
    return head if sep and USER_NAME_RE.match(head) else None


# --------------------------------------------------------------------------------------------
# Who calls

KeyKind = Literal["admin", "user", "client", "session"]
KEY_KINDS: tuple[KeyKind, ...] = ("admin", "user", "client", "session")


@dataclass(frozen=True)
class Principal:
    """The authenticated caller."""

    kind: KeyKind
    user: str | None = None
    """Whose calls these are: the user of a `user` key (or of a trusted `X-User-Id`), a session
    key's session's user; None for the admin and the plain client key. For the admin acting in a
    user's lane (`in_lane`), that user."""
    session_id: str | None = None
    """For kind `session`: the session the key belongs to."""

    @property
    def owner(self) -> str | None:
        """The owner of the sessions this caller creates, and of the turns it records."""
        return self.user

    def in_lane(self, user: str | None) -> Principal:
        """The admin acting in `user`'s lane (None: the shared policy's): `clawbridge rollback N
        --user alice`. Only the admin names a lane."""
        if self.kind != "admin":
            raise ValueError("only the admin key names a lane")
        return replace(self, user=user)


OPERATOR = Principal("admin")
"""The admin key, and the server's own tools (the CLI on the state dir, the idle reaper, the judge)."""


# --------------------------------------------------------------------------------------------
# The table

Resource = Literal["sessions", "turns", "rewards", "versions", "models", "users", "status",
                   "trajectories", "dashboard", "metrics", "exports", "notes"]
Action = Literal["list", "read", "start", "record", "continue", "end", "write", "pin", "serve", "evaluate"]


class Scope(Enum):
    """Which objects of a resource a key kind may act on."""

    NONE = "none"
    """None: refused (403; 401 for the dashboard and metrics, which ask for a login)."""
    OWN = "own"
    """Its own: sessions of its user (a session key: its own session; no user: sessions without
    one); versions of its lane (no user: the shared policy's)."""
    SHARED_OR_OWN = "shared or own"
    """Its own, and the shared policy's versions (every caller is served by the shared policy)."""
    ANY = "any"
    """All of them."""


N, OWN, SHARED, ANY = Scope.NONE, Scope.OWN, Scope.SHARED_OR_OWN, Scope.ANY


def _row(admin: Scope, user: Scope, client: Scope, session: Scope) -> dict[KeyKind, Scope]:
    return {"admin": admin, "user": user, "client": client, "session": session}


TABLE: dict[tuple[Resource, Action], dict[KeyKind, Scope]] = {
    #                                  admin   user     client   session
    ("sessions", "record"):      _row(OWN,    OWN,     OWN,     OWN),      # a model call names (or creates) a session
    ("sessions", "start"):       _row(OWN,    OWN,     N,       N),        # POST /rl/start_session
    ("sessions", "list"):        _row(ANY,    OWN,     N,       N),        # GET /rl/sessions
    ("sessions", "read"):        _row(ANY,    OWN,     N,       OWN),      # GET /rl/sessions/{id}
    ("sessions", "end"):         _row(ANY,    OWN,     N,       OWN),      # POST /rl/end_session
    ("turns", "read"):           _row(ANY,    OWN,     OWN,     OWN),      # GET /v1/responses/{id}
    ("turns", "continue"):       _row(OWN,    OWN,     OWN,     OWN),      # previous_response_id: its text is recorded again
    ("rewards", "write"):        _row(ANY,    OWN,     N,       OWN),      # /rl/set_reward, /rl/set_session_reward
    ("versions", "pin"):         _row(SHARED, SHARED,  SHARED,  SHARED),   # model "NAME@N"
    ("versions", "serve"):       _row(OWN,    N,       N,       N),        # /rl/promote, /rl/rollback (+ "user")
    ("versions", "evaluate"):    _row(ANY,    N,       N,       N),        # /rl/eval
    ("models", "read"):          _row(ANY,    ANY,     ANY,     ANY),      # /v1/models, count_tokens, /openapi.json
    ("users", "read"):           _row(ANY,    N,       N,       N),        # GET /rl/users
    ("users", "write"):          _row(ANY,    N,       N,       N),        # add, revoke, forget
    ("status", "read"):          _row(ANY,    N,       N,       N),        # /rl/status, /rl/promotion
    ("trajectories", "write"):   _row(ANY,    N,       N,       N),        # Claw-R1 init/register/complete
    ("dashboard", "read"):       _row(ANY,    N,       N,       N),        # /dashboard/api/* (GET)
    ("dashboard", "write"):      _row(ANY,    N,       N,       N),        # dashboard reward, end, promote, rollback
    ("metrics", "read"):         _row(ANY,    N,       N,       N),        # /metrics (or the metrics key)
    ("exports", "read"):         _row(N,      N,       N,       N),        # no route: `clawbridge sessions export` reads the state dir
    ("notes", "read"):           _row(ANY,    OWN,     OWN,     N),        # GET /rl/notes (the client key: notes of calls without a user)
    ("notes", "write"):          _row(ANY,    OWN,     OWN,     N),        # POST /rl/notes, DELETE /rl/notes[/{id}]
}
"""(resource, action) -> key kind -> scope. A new route adds (or reuses) a row here and a case in
`tests/test_access.py`, which fails for a route it does not list."""

LOGIN_RESOURCES: frozenset[Resource] = frozenset({"dashboard", "metrics"})
"""Refused with 401 (log in), not 403: a browser is sent to the login form."""
SESSION_RESOURCES: frozenset[Resource] = frozenset({"sessions", "turns", "rewards"})
"""Resources whose objects are sessions (a session key's own is its session)."""


# --------------------------------------------------------------------------------------------
# Deciding


@dataclass(frozen=True)
class Target:
    """The object asked about: a session (`session_id`, `owner`) or a version (`owner` = its lane's
    user, None for the shared policy; `version`)."""

    owner: str | None
    session_id: str | None = None
    version: int | None = None


class Denied(Exception):
    """A refusal the caller is told about: `status` (401/403), `code`, `message`. The proxy
    answers it as an OpenAI-style error (`clawbridge.proxy.errors`)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


class Hidden(Exception):
    """A refusal the caller must not be told about: the route answers exactly as for an object
    that does not exist (its own 404 or 400)."""


def scope_of(principal: Principal, resource: Resource, action: Action) -> Scope:
    return TABLE[(resource, action)][principal.kind]


def allowed_kinds(resource: Resource, action: Action) -> list[KeyKind]:
    return [k for k in KEY_KINDS if TABLE[(resource, action)][k] is not Scope.NONE]


def check(principal: Principal, resource: Resource, action: Action, target: Target | None = None) -> None:
    """Return when `principal` may do `action` on `resource` (on `target`, where the action has an
    object); raise `Denied` (say why) or `Hidden` (answer as if `target` did not exist)."""
    scope = scope_of(principal, resource, action)
    if scope is Scope.NONE:
        raise _refused(resource, action)
    if scope is Scope.ANY or target is None:
        return
    if _owns(principal, resource, target) or (scope is Scope.SHARED_OR_OWN and target.owner is None):
        return
    if principal.kind == "session" and resource in SESSION_RESOURCES:
        raise Denied(403, "a session key reaches only its own session", "session_mismatch")
    if resource == "versions":
        if principal.kind != "admin":
            raise Hidden()
        raise _other_lane(principal, action, target)
    if action == "record":
        raise not_recordable(target.session_id or "", target.owner)
    seen: tuple[Resource, Action] = (resource, "read") if (resource, "read") in TABLE else ("sessions", "read")
    if TABLE[seen][principal.kind] is Scope.ANY:  # it sees the object: say why not
        whose = f"user {target.owner!r}'s" if target.owner else "recorded without a user"
        raise Denied(403, f"session {target.session_id!r} is {whose}: this key may not {action} it "
                     "(it would record that data under another owner)", "not_yours")
    raise Hidden()


def not_recordable(session_id: str, owner: str | None) -> Denied:
    """The refusal of a turn recorded into session `session_id` of `owner` by another owner (or a
    new session in user `owner`'s namespace): one answer whether or not the session exists. The
    route's check and the store's (`clawbridge.store.owners.check_session_write`) both give it."""
    ns = namespace_of(session_id)
    where = (f"is in user {ns!r}'s namespace ('{ns}:...')" if ns is not None and owner == ns
             else "is not one of this key's sessions")
    return Denied(403, f"session {session_id!r} cannot be recorded with this key: it {where}", "session_not_yours",
                  "session_id")


def _other_lane(principal: Principal, action: Action, target: Target) -> Denied:
    """The admin naming a version outside the lane it acts in."""
    lane = f"user {target.owner}'s adapter" if target.owner else "the shared policy"
    if action != "serve":
        return Denied(403, f"policy version {target.version} is {lane}: it answers only its user's calls",
                      "version_of_another_lane", "model")
    asked = f"user {principal.user}'s lane" if principal.user else "the shared policy's lane"
    how = (f"name its lane: --user {target.owner} (\"user\": \"{target.owner}\")" if target.owner
           else "leave out --user (\"user\")")
    return Denied(403, f"policy version {target.version} is {lane}, not in {asked}; {how}",
                  "version_of_another_lane", "version")


def _owns(principal: Principal, resource: Resource, target: Target) -> bool:
    if principal.kind == "session" and resource in SESSION_RESOURCES:
        return target.session_id is not None and target.session_id == principal.session_id
    return target.owner == principal.user


def _refused(resource: Resource, action: Action) -> Denied:
    kinds = allowed_kinds(resource, action)
    status = 401 if resource in LOGIN_RESOURCES else 403
    if resource in LOGIN_RESOURCES:
        return Denied(status, "log in at /dashboard with the admin key, or send it as 'Authorization: Bearer'",
                      "dashboard_login_required")
    if kinds == ["admin"]:
        return Denied(status, "this endpoint needs the admin key (CLAWBRIDGE_ADMIN_KEY)", "admin_key_required")
    names = {"admin": "the admin key", "user": "a user's key", "client": "the client key", "session": "a session key"}
    return Denied(status, f"this endpoint needs {' or '.join(names[k] for k in kinds)}"
                  if kinds else "no key reaches this over HTTP", "key_not_allowed")
