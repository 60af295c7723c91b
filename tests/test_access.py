"""Who may see or do what, as a table: a real key of every kind against every route of the real app.

The server is the real app (uvicorn, SQLite, the tiny model's tokenizer) with per-user adapters on
a fake per-user backend that also serves committed versions by name (version N answers "vN"), so
alice's and bob's lanes train real versions. The keys: the admin key, alice's key (`user`), bob's
(`other`), the shared client key (`client`), a session key of alice's from /rl/start_session
(`session`), carol's revoked key (`revoked`), and a key nobody has (`unknown`).

`CASES` is the expected table, written here by hand (not read from `clawbridge.access`): for each
route and what it is asked about, the status every key kind gets. `test_every_route_is_in_the_table`
fails for any route of the app that no case covers, so a new route must be added here, and
`test_every_row_of_the_access_table_is_exercised` fails for a row of `clawbridge.access.TABLE`
that no case drives.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from clawbridge.access import TABLE, Action, Resource
from clawbridge.backend import ModelInfo
from clawbridge.chat.render import Renderer
from clawbridge.config import Settings
from clawbridge.serving.sampler import FakeSampler, Sampler
from clawbridge.store.training import TrainingStore
from clawbridge.store.versions import VersionStore
from clawbridge.trainer.fake import FakePerUserBackend
from tests.fake_proxy import script_for
from tests.support import InProcessProxy, free_port, wait_for

KINDS = ("admin", "user", "other", "client", "session", "revoked", "unknown")


class ServedLanes(FakePerUserBackend):
    """`FakePerUserBackend` that also serves any committed version by name (`VersionedServing`):
    version N answers "vN", so a test sees which version answered."""

    def __init__(self, renderer: Renderer, info: ModelInfo) -> None:
        super().__init__(FakeSampler(script_for(renderer, "v0"), version=0), info)
        self.renderer = renderer

    async def load_version(self, version: int, checkpoint: str) -> Sampler:
        return FakeSampler(script_for(self.renderer, f"v{version}"), version=version)


@dataclass
class World:
    """The running server and what the module set up in it."""

    proxy: InProcessProxy
    keys: dict[str, str]
    resp_alice: str
    """A stored response in alice:main."""
    resp_shared: str
    """A stored response in the shared key's session shared-1."""
    alice_v: int
    """A committed version of alice's lane."""
    bob_v: int

    @property
    def base(self) -> str:
        return self.proxy.base


@dataclass
class Ctx:
    """One test's view: the world, plus a fresh session key of alice's (made on first use, with one
    recorded call), so a case that ends that session does not spoil the next."""

    world: World
    kind: str
    _keyed: tuple[str, str] | None = field(default=None)

    @property
    def keyed(self) -> tuple[str, str]:
        """(session id, session key) of a session alice started, holding one answered call."""
        if self._keyed is None:
            r = post(self.world, "user", "/rl/start_session", {})
            sid, key = r.json()["session_id"], r.json()["api_key"]
            answered = httpx.post(self.world.base + "/v1/chat/completions", json=chat(), timeout=30,
                                  headers={"Authorization": f"Bearer {key}"})
            assert answered.status_code == 200, answered.text
            self._keyed = (sid, key)
        return self._keyed

    @property
    def key(self) -> str:
        return self.keyed[1] if self.kind == "session" else self.world.keys[self.kind]


def chat(model: str = "tiny", **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}


def messages() -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def responses(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_output_tokens": 4, "input": "hi", **extra}


def post(world: World, kind: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(world.base + path, json=body, timeout=30,
                      headers={"Authorization": f"Bearer {world.keys[kind]}", **headers})


@pytest.fixture(scope="module")
def world(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    info = ModelInfo(name="tiny", tokenizer_path=str(tiny_model_dir), context_window=4096, max_output_tokens=64)
    settings = Settings(port=free_port(), state_dir=tmp_path_factory.mktemp("access") / "state",
                        model=str(tiny_model_dir), served_model_name="tiny", per_user_adapters=True, batch_size=1,
                        baseline="none", max_batch_tokens=0, trainer_poll_interval_s=0.05, promotion_mode="off",
                        keep_checkpoints=1000)
    proxy = InProcessProxy(settings, ServedLanes(renderer, info)).start()
    try:
        keys = {"admin": proxy.state.keys.admin, "client": proxy.state.keys.client, "unknown": "cbu-" + "x" * 43}
        w = World(proxy, keys, "", "", 0, 0)
        for name, kind in (("alice", "user"), ("bob", "other"), ("carol", "revoked")):
            r = post(w, "admin", "/rl/users", {"user": name})
            assert r.status_code == 200, r.text
            keys[kind] = r.json()["api_key"]
        assert httpx.delete(w.base + "/rl/users/carol", headers={"Authorization": f"Bearer {keys['admin']}"},
                            timeout=30).status_code == 200

        def answered(kind: str, session: str, **extra: Any) -> str:
            r = post(w, kind, "/v1/responses", responses(**extra), **{"X-Session-Id": session})
            assert r.status_code == 200, r.text
            return str(r.json()["id"])

        w.resp_alice = answered("user", "main")
        answered("user", "kept")  # alice:kept: the session API's cases name it (no case records into it)
        w.resp_shared = answered("client", "shared-1")
        answered("other", "main")
        # Each user's lane trains a version, and the shared policy its own (rewarded, ended sessions).
        for kind, session, stored in (("user", "train", "alice:train"), ("other", "train", "bob:train"),
                                      ("client", "train-shared", "train-shared")):
            answered(kind, session)
            assert post(w, "admin", "/rl/set_reward", {"session_id": stored, "reward": 1.0}).status_code == 200
            assert post(w, "admin", "/rl/end_session", {"session_id": stored}).status_code == 200
        lanes = proxy.state.lanes
        w.alice_v = wait_for(lambda: lanes.version_for("alice"), what="alice's lane to train")
        w.bob_v = wait_for(lambda: lanes.version_for("bob"), what="bob's lane to train")
        wait_for(lambda: VersionStore(proxy.state.store).last_committed() is not None, what="the shared base")
        assert post(w, "admin", "/traj-x/1/v1/register_trajectory", {}).status_code == 200
        yield w
    finally:
        proxy.stop()


# --------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class Case:
    """One route and what it is asked about, with the status each key kind gets."""

    name: str
    method: str
    route: str
    """The path as the app registers it (checked against `app.routes`)."""
    row: tuple[Resource, Action]
    """The row of `clawbridge.access.TABLE` it exercises."""
    path: Callable[[Ctx], str]
    expect: dict[str, int]
    body: Callable[[Ctx], dict[str, Any] | None] = lambda _: None
    headers: Callable[[Ctx], dict[str, str]] = lambda _: {}
    check: Callable[[Ctx, httpx.Response], None] | None = None
    """More to assert about a 200 answer (what it shows)."""


def E(admin: int, user: int, other: int, client: int, session: int, *, anonymous: int = 401) -> dict[str, int]:
    """Expected statuses; a revoked and an unknown key are `anonymous` (401 everywhere)."""
    return {"admin": admin, "user": user, "other": other, "client": client, "session": session,
            "revoked": anonymous, "unknown": anonymous}


ALL_200 = E(200, 200, 200, 200, 200)
ADMIN_ONLY = E(200, 403, 403, 403, 403)
LOGIN = E(200, 401, 401, 401, 401)


def fixed(path: str) -> Callable[[Ctx], str]:
    return lambda _: path


def sid_header(session: str) -> Callable[[Ctx], dict[str, str]]:
    return lambda _: {"X-Session-Id": session}


def fresh(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def only_own_sessions(ctx: Ctx, r: httpx.Response) -> None:
    owners = {s["user_id"] for s in r.json()["sessions"]}
    if ctx.kind == "admin":
        assert len(owners) > 1, owners  # everyone's
    else:
        assert owners == {"alice" if ctx.kind == "user" else "bob"}, owners


def no_users_versions(ctx: Ctx, r: httpx.Response) -> None:
    ids = {m["id"] for m in r.json()["data"]}
    assert "tiny@0" in ids and not ids & {f"tiny@{ctx.world.alice_v}", f"tiny@{ctx.world.bob_v}"}, ids


def answered_by(version: Callable[[Ctx], int]) -> Callable[[Ctx, httpx.Response], None]:
    def check(ctx: Ctx, r: httpx.Response) -> None:
        assert r.json()["choices"][0]["message"]["content"] == f"v{version(ctx)}"
    return check


def only_own_notes(ctx: Ctx, r: httpx.Response) -> None:
    users = {n["user"] for n in r.json()["notes"]}
    if ctx.kind == "admin":  # everyone's: one of alice's and one of the shared key's are listed
        alice_note(ctx)
        post(ctx.world, "client", "/rl/notes", {"text": "Keep it short."})
        again = httpx.get(ctx.world.base + "/rl/notes", timeout=30,
                          headers={"Authorization": f"Bearer {ctx.world.keys['admin']}"}).json()["notes"]
        assert {n["user"] for n in again} >= {"alice", None}
    else:
        assert users <= {{"user": "alice", "other": "bob", "client": None}[ctx.kind]}, users


def alice_note(ctx: Ctx) -> int:
    r = post(ctx.world, "admin", "/rl/notes", {"text": "Call me Alice.", "user": "alice"})
    assert r.status_code == 200, r.text
    return int(r.json()["note_id"])


def make_user(ctx: Ctx) -> str:
    name = fresh("tmp-")
    assert post(ctx.world, "admin", "/rl/users", {"user": name}).status_code == 200
    return name


CHAT, MSG, RESP = "/v1/chat/completions", "/v1/messages", "/v1/responses"
RECORD: tuple[Resource, Action] = ("sessions", "record")

CASES: list[Case] = [
    # ---- model calls: recording into a session (each key's own: `main` is alice:main, bob:main, or no user's)
    Case("chat in own main", "POST", CHAT, RECORD, fixed(CHAT), E(200, 200, 200, 200, 403),
         lambda _: chat(), sid_header("main")),
    Case("chat, implicit session (no /v1)", "POST", "/chat/completions", RECORD, fixed("/chat/completions"),
         ALL_200, lambda _: chat()),
    Case("chat in alice:main by URL", "POST", "/s/{session_id}/v1/chat/completions", RECORD,
         fixed("/s/alice:main/v1/chat/completions"), E(403, 200, 200, 403, 403), lambda _: chat()),
    Case("chat in a Claw-R1 trajectory", "POST", "/{trajectory_uid}/{prompt_uid}/v1/chat/completions", RECORD,
         fixed("/traj-x/1/v1/chat/completions"), E(200, 200, 200, 200, 403), lambda _: chat()),
    Case("messages in a fresh alice:* id", "POST", MSG, RECORD, fixed(MSG), E(403, 200, 200, 403, 403),
         lambda _: messages(), lambda _: {"X-Session-Id": fresh("alice:new-")}),
    Case("messages, implicit (no /v1)", "POST", "/messages", RECORD, fixed("/messages"), ALL_200,
         lambda _: messages()),
    Case("messages in the session key's session by URL", "POST", "/s/{session_id}/v1/messages", RECORD,
         lambda c: f"/s/{c.keyed[0]}/v1/messages", E(403, 200, 200, 403, 200), lambda _: messages()),
    Case("messages in trajectory alice:main", "POST", "/{trajectory_uid}/{prompt_uid}/v1/messages", RECORD,
         fixed("/alice:main/1/v1/messages"), E(403, 200, 200, 403, 403), lambda _: messages()),
    Case("responses in own main", "POST", RESP, RECORD, fixed(RESP), E(200, 200, 200, 200, 403),
         lambda _: responses(), sid_header("main")),
    Case("responses, implicit (no /v1)", "POST", "/responses", RECORD, fixed("/responses"), ALL_200,
         lambda _: responses()),
    Case("responses in the shared key's session by URL", "POST", "/s/{session_id}/v1/responses", RECORD,
         fixed("/s/shared-1/v1/responses"), E(200, 200, 200, 200, 403), lambda _: responses()),
    Case("responses in trajectory bob:main", "POST", "/{trajectory_uid}/{prompt_uid}/v1/responses", RECORD,
         fixed("/bob:main/1/v1/responses"), E(403, 200, 200, 403, 403), lambda _: responses()),
    # ---- versions by name (model "tiny@N")
    Case("pin the shared base", "POST", CHAT, ("versions", "pin"), fixed(CHAT), ALL_200,
         lambda _: chat("tiny@0"), check=answered_by(lambda _: 0)),
    Case("pin alice's version", "POST", CHAT, ("versions", "pin"), fixed(CHAT), E(403, 200, 404, 404, 200),
         lambda c: chat(f"tiny@{c.world.alice_v}"), check=answered_by(lambda c: c.world.alice_v)),
    # ---- turns: stored responses
    Case("retrieve alice's response", "GET", "/v1/responses/{response_id}", ("turns", "read"),
         lambda c: f"/v1/responses/{c.world.resp_alice}", E(200, 200, 404, 404, 403)),
    Case("retrieve the shared key's response (no /v1)", "GET", "/responses/{response_id}", ("turns", "read"),
         lambda c: f"/responses/{c.world.resp_shared}", E(200, 404, 404, 200, 403)),
    Case("continue alice's response", "POST", RESP, ("turns", "continue"), fixed(RESP), E(403, 200, 400, 400, 403),
         lambda c: responses(previous_response_id=c.world.resp_alice)),
    Case("continue the shared key's response", "POST", RESP, ("turns", "continue"), fixed(RESP),
         E(200, 400, 400, 200, 403), lambda c: responses(previous_response_id=c.world.resp_shared)),
    # ---- what any key may read
    Case("count tokens", "POST", "/v1/messages/count_tokens", ("models", "read"),
         fixed("/v1/messages/count_tokens"), ALL_200, lambda _: messages()),
    Case("count tokens in alice:main", "POST", "/s/{session_id}/v1/messages/count_tokens", ("models", "read"),
         fixed("/s/alice:main/v1/messages/count_tokens"), ALL_200, lambda _: messages()),
    *(Case(f"models at {route}", "GET", route, ("models", "read"), fixed(path), ALL_200, check=no_users_versions)
      for route, path in (("/v1/models", "/v1/models"), ("/models", "/models"),
                          ("/s/{session_id}/v1/models", "/s/alice:main/v1/models"),
                          ("/{trajectory_uid}/{prompt_uid}/v1/models", "/t/p/v1/models"))),
    Case("openapi", "GET", "/openapi.json", ("models", "read"), fixed("/openapi.json"), ALL_200),
    # ---- the session API
    Case("start a session", "POST", "/rl/start_session", ("sessions", "start"), fixed("/rl/start_session"),
         E(200, 200, 200, 403, 403), lambda _: {}),
    Case("end alice:kept", "POST", "/rl/end_session", ("sessions", "end"), fixed("/rl/end_session"),
         E(200, 200, 404, 403, 403), lambda _: {"session_id": "alice:kept"}),
    Case("end without naming a session", "POST", "/rl/end_session", ("sessions", "end"), fixed("/rl/end_session"),
         E(400, 400, 400, 403, 200), lambda _: {}),
    Case("reward alice:kept", "POST", "/rl/set_reward", ("rewards", "write"), fixed("/rl/set_reward"),
         E(200, 200, 404, 403, 403), lambda _: {"session_id": "alice:kept", "reward": 1.0}),
    Case("reward alice's response by id", "POST", "/rl/set_reward", ("rewards", "write"), fixed("/rl/set_reward"),
         E(200, 200, 404, 403, 403), lambda c: {"interaction_id": c.world.resp_alice, "reward": 1.0}),
    Case("reward without naming a session", "POST", "/rl/set_reward", ("rewards", "write"), fixed("/rl/set_reward"),
         E(400, 400, 400, 403, 200), lambda _: {"reward": 1.0}),
    Case("session reward on alice:kept", "POST", "/rl/set_session_reward", ("rewards", "write"),
         fixed("/rl/set_session_reward"), E(200, 200, 404, 403, 403),
         lambda _: {"session_id": "alice:kept", "reward": 0.5}),
    Case("list sessions", "GET", "/rl/sessions", ("sessions", "list"), fixed("/rl/sessions"),
         E(200, 200, 200, 403, 403), check=only_own_sessions),
    Case("read alice:kept", "GET", "/rl/sessions/{session_id}", ("sessions", "read"), fixed("/rl/sessions/alice:kept"),
         E(200, 200, 404, 403, 403)),
    Case("read the session key's session", "GET", "/rl/sessions/{session_id}", ("sessions", "read"),
         lambda c: f"/rl/sessions/{c.keyed[0]}", E(200, 200, 404, 403, 200)),
    Case("read a session that does not exist", "GET", "/rl/sessions/{session_id}", ("sessions", "read"),
         fixed("/rl/sessions/no-such-session"), E(404, 404, 404, 403, 403)),
    Case("status", "GET", "/rl/status", ("status", "read"), fixed("/rl/status"), ADMIN_ONLY),
    # ---- users
    Case("add a user", "POST", "/rl/users", ("users", "write"), fixed("/rl/users"), ADMIN_ONLY,
         lambda _: {"user": fresh("new-")}),
    Case("list users", "GET", "/rl/users", ("users", "read"), fixed("/rl/users"), ADMIN_ONLY),
    Case("revoke a user", "DELETE", "/rl/users/{user}", ("users", "write"), lambda c: f"/rl/users/{make_user(c)}",
         ADMIN_ONLY),
    Case("forget a user", "POST", "/rl/users/{user}/forget", ("users", "write"),
         lambda c: f"/rl/users/{make_user(c)}/forget", ADMIN_ONLY),
    # ---- promotion and lanes
    Case("promotion status", "GET", "/rl/promotion", ("status", "read"), fixed("/rl/promotion"), ADMIN_ONLY),
    Case("promote the shared base", "POST", "/rl/promote", ("versions", "serve"), fixed("/rl/promote"), ADMIN_ONLY,
         lambda _: {"version": 0}),
    Case("roll back to alice's version without naming her lane", "POST", "/rl/rollback", ("versions", "serve"),
         fixed("/rl/rollback"), E(403, 403, 403, 403, 403), lambda c: {"version": c.world.alice_v}),
    Case("roll alice's lane back to her version", "POST", "/rl/rollback", ("versions", "serve"),
         fixed("/rl/rollback"), ADMIN_ONLY, lambda c: {"version": c.world.alice_v, "user": "alice"}),
    Case("promote bob's version in alice's lane", "POST", "/rl/promote", ("versions", "serve"), fixed("/rl/promote"),
         E(403, 403, 403, 403, 403), lambda c: {"version": c.world.bob_v, "user": "alice"}),
    Case("promote the shared base in alice's lane", "POST", "/rl/promote", ("versions", "serve"),
         fixed("/rl/promote"), E(403, 403, 403, 403, 403), lambda _: {"version": 0, "user": "alice"}),
    Case("evaluate alice's version", "POST", "/rl/eval", ("versions", "evaluate"), fixed("/rl/eval"), ADMIN_ONLY,
         lambda c: {"versions": [c.world.alice_v], "eval_set": '{"messages": [{"role": "user", "content": "hi"}], '
                                                                '"expect": "v"}\n'}),
    # ---- Claw-R1 trajectories
    Case("init a trajectory", "POST", "/init_trajectory", ("trajectories", "write"), fixed("/init_trajectory"),
         ADMIN_ONLY, lambda _: {}),
    Case("register a trajectory", "POST", "/{trajectory_uid}/{prompt_uid}/v1/register_trajectory",
         ("trajectories", "write"), lambda _: f"/{fresh('traj-')}/1/v1/register_trajectory", ADMIN_ONLY, lambda _: {}),
    Case("register alice:main as a trajectory", "POST", "/{trajectory_uid}/{prompt_uid}/v1/register_trajectory",
         ("trajectories", "write"), fixed("/alice:main/1/v1/register_trajectory"), E(403, 403, 403, 403, 403),
         lambda _: {}),
    Case("complete a trajectory", "POST", "/{trajectory_uid}/{prompt_uid}/v1/complete_trajectory",
         ("trajectories", "write"), fixed("/traj-x/1/v1/complete_trajectory"), ADMIN_ONLY, lambda _: {}),
    # ---- the dashboard's JSON API and metrics (a login is the admin's; the admin key works as a header)
    Case("dashboard overview", "GET", "/dashboard/api/overview", ("dashboard", "read"),
         fixed("/dashboard/api/overview"), LOGIN),
    Case("dashboard sessions", "GET", "/dashboard/api/sessions", ("dashboard", "read"),
         fixed("/dashboard/api/sessions"), LOGIN),
    Case("dashboard session alice:main", "GET", "/dashboard/api/sessions/{session_id}", ("dashboard", "read"),
         fixed("/dashboard/api/sessions/alice:main"), LOGIN),
    Case("dashboard reward", "POST", "/dashboard/api/sessions/{session_id}/reward", ("dashboard", "write"),
         fixed("/dashboard/api/sessions/alice:main/reward"), LOGIN, lambda _: {"reward": 1.0}),
    Case("dashboard end", "POST", "/dashboard/api/sessions/{session_id}/end", ("dashboard", "write"),
         fixed("/dashboard/api/sessions/alice:main/end"), LOGIN),
    Case("dashboard rollback to alice's version", "POST", "/dashboard/api/promotion/{action}", ("versions", "serve"),
         fixed("/dashboard/api/promotion/rollback"), E(403, 401, 401, 401, 401),
         lambda c: {"version": c.world.alice_v}),
    Case("dashboard rollback of alice's lane", "POST", "/dashboard/api/promotion/{action}", ("dashboard", "write"),
         fixed("/dashboard/api/promotion/rollback"), LOGIN, lambda c: {"version": c.world.alice_v, "user": "alice"}),
    Case("dashboard delete of alice's note", "POST", "/dashboard/api/notes/{note_id}/delete", ("dashboard", "write"),
         lambda c: f"/dashboard/api/notes/{alice_note(c)}/delete", LOGIN),
    Case("metrics", "GET", "/metrics", ("metrics", "read"), fixed("/metrics"), LOGIN),
    Case("resume training after a rollback", "POST", "/rl/resume", ("versions", "serve"), fixed("/rl/resume"),
         ADMIN_ONLY, lambda _: {}),
    # ---- notes (clawbridge.rewards.notes): each key's own (the client key's: calls without a user)
    Case("add a note", "POST", "/rl/notes", ("notes", "write"), fixed("/rl/notes"), E(200, 200, 200, 200, 403),
         lambda _: {"text": "Keep it short."}),
    Case("list notes", "GET", "/rl/notes", ("notes", "read"), fixed("/rl/notes"), E(200, 200, 200, 200, 403),
         check=only_own_notes),
    Case("list alice's notes by name", "GET", "/rl/notes", ("notes", "read"), fixed("/rl/notes?user=alice"),
         E(200, 200, 404, 404, 403)),
    Case("delete alice's note", "DELETE", "/rl/notes/{note_id}", ("notes", "write"),
         lambda c: f"/rl/notes/{alice_note(c)}", E(200, 200, 404, 404, 403)),
    Case("delete the shared key's notes", "DELETE", "/rl/notes", ("notes", "write"), fixed("/rl/notes?user="),
         E(200, 404, 404, 200, 403)),
]

EXEMPT = {
    # No key needed: health checks, and the browser's pages (the login form until logged in).
    ("GET", "/health"), ("GET", "/v1/health"), ("GET", "/healthz"), ("GET", "/"),
    ("GET", "/dashboard"), ("GET", "/dashboard/sessions/{session_id}"), ("POST", "/dashboard/login"),
    ("GET", "/dashboard/link/{token}"), ("POST", "/dashboard/logout"), ("GET", "/dashboard/static/{name}"),
    # Always 404 naming what to use instead.
    ("POST", "/v1/completions"), ("POST", "/generate"), ("POST", "/submit_steps"), ("POST", "/compute_reward"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_access_table(world: World, case: Case, kind: str) -> None:
    ctx = Ctx(world, kind)
    body = case.body(ctx)
    r = httpx.request(case.method, world.base + case.path(ctx), json=body, timeout=60,
                      headers={"Authorization": f"Bearer {ctx.key}", **case.headers(ctx)})
    assert r.status_code == case.expect[kind], f"{case.name} with the {kind} key: {r.status_code} {r.text[:300]}"
    if r.status_code != 200 and not case.route.startswith("/metrics"):
        error = r.json()["error"]
        assert error["message"] and error["type"], r.text  # an OpenAI- (or Anthropic-) style error body
    if r.status_code == 200 and case.check is not None:
        case.check(ctx, r)


def app_routes(app: Any) -> set[tuple[str, str]]:
    """(method, path) of every route of `app`, those of included routers too (FastAPI >= 0.16x
    keeps an included router as one entry whose routes it resolves when asked)."""
    out: set[tuple[str, str]] = set()
    for r in app.routes:
        if isinstance(r, APIRoute):
            out |= {(m, r.path) for m in r.methods}
        elif hasattr(r, "effective_route_contexts"):
            out |= {(m, e.path) for e in r.effective_route_contexts() for m in (e.methods or ())}
    return out


def test_every_route_is_in_the_table(world: World) -> None:
    routes = app_routes(world.proxy.app)
    covered = {(c.method, c.route) for c in CASES}
    assert covered <= routes, f"cases name routes the app does not have: {covered - routes}"
    missing = routes - covered - EXEMPT
    assert not missing, f"routes no case of tests/test_access.py covers (add them to CASES): {sorted(missing)}"
    assert not [p for _, p in routes if "export" in p], "exports are not served over HTTP (access row exports)"


def test_every_row_of_the_access_table_is_exercised() -> None:
    driven = {c.row for c in CASES}
    assert set(TABLE) - driven == {("exports", "read")}  # no route: `clawbridge sessions export` reads the state dir
    assert driven <= set(TABLE)


def test_a_hidden_object_is_answered_exactly_as_a_missing_one(world: World) -> None:
    """Bob asking for alice's session, response or version gets the bytes an id that does not
    exist gets (ids aside)."""
    def body(path: str, method: str = "GET", json: dict[str, Any] | None = None) -> dict[str, Any]:
        r = httpx.request(method, world.base + path, json=json, timeout=30,
                          headers={"Authorization": f"Bearer {world.keys['other']}"})
        return dict(r.json()["error"]) | {"status": r.status_code}

    hidden = body("/rl/sessions/alice:kept")
    missing = body("/rl/sessions/alice:nothing")
    assert hidden == missing | {"message": missing["message"].replace("alice:nothing", "alice:kept")}
    hidden = body(f"/v1/responses/{world.resp_alice}")
    missing = body("/v1/responses/resp_" + "0" * 24)
    assert hidden == missing | {"message": missing["message"].replace("resp_" + "0" * 24, world.resp_alice)}
    never = 10**9
    hidden = body(CHAT, "POST", chat(f"tiny@{world.alice_v}"))
    missing = body(CHAT, "POST", chat(f"tiny@{never}"))
    assert hidden == missing | {"message": missing["message"].replace(str(never), str(world.alice_v))}


def test_a_hidden_response_says_nothing_about_itself(world: World) -> None:
    """Alice's response made with `store: false` (kept only as training data): bob retrieving or
    continuing it is told exactly what an id never recorded gets, not that it was not stored."""
    r = post(world, "user", RESP, responses(store=False), **{"X-Session-Id": "unstored"})
    assert r.status_code == 200, r.text
    hers, never = r.json()["id"], "resp_" + "0" * 24

    def error(method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        got = httpx.request(method, world.base + path, json=body, timeout=30,
                            headers={"Authorization": f"Bearer {world.keys['other']}"})
        e = got.json()["error"]
        return got.status_code, {**e, "message": e["message"].replace(hers, "ID").replace(never, "ID")}

    assert error("GET", f"/v1/responses/{hers}") == error("GET", f"/v1/responses/{never}")
    assert error("POST", RESP, responses(previous_response_id=hers)) == \
        error("POST", RESP, responses(previous_response_id=never))
    assert error("GET", f"/v1/responses/{never}")[1]["code"] == "response_not_found"
    own = post(world, "user", RESP, responses(previous_response_id=hers))  # alice is told why
    assert own.status_code == 400 and own.json()["error"]["code"] == "response_not_stored"


def test_the_shared_key_cannot_tell_or_take_a_users_session(world: World) -> None:
    """The shared client key naming `alice:...` ids: the same 403 whether or not alice's session
    exists, nothing created; alice's own call with that name later is recorded as hers."""
    name = fresh("later-")
    existing = post(world, "client", CHAT, chat(), **{"X-Session-Id": "alice:main"})
    absent = post(world, "client", CHAT, chat(), **{"X-Session-Id": f"alice:{name}"})
    assert existing.status_code == absent.status_code == 403
    assert existing.json()["error"] == absent.json()["error"] | {
        "message": absent.json()["error"]["message"].replace(name, "main")}
    body = post(world, "client", CHAT, chat(session_id=f"alice:{name}"))  # OpenClaw-RL's body field
    runtime = post(world, "client", CHAT, {**chat(), "messages": [  # OpenClaw's runtime line
        {"role": "user", "content": f"Runtime: agent=main | session=alice:{name}\nhi"}]})
    assert body.json()["error"] == runtime.json()["error"] == absent.json()["error"]
    store = world.proxy.state.store
    assert store.get_session(f"alice:{name}") is None
    assert post(world, "user", CHAT, chat(), **{"X-Session-Id": name}).status_code == 200
    session = store.get_session(f"alice:{name}")
    assert session is not None and session.user_id == "alice" and session.turn_count == 1


def test_a_name_whose_namespace_the_shared_key_used_is_not_a_new_user(world: World) -> None:
    """The race: the shared key records `dora:x` while there is no dora; adding dora afterwards is
    refused (her agent's session `x` would be someone else's), and the session stays the shared key's."""
    assert post(world, "client", CHAT, chat(), **{"X-Session-Id": "dora:x"}).status_code == 200
    r = post(world, "admin", "/rl/users", {"user": "dora"})
    assert r.status_code == 409 and "dora:..." in r.json()["error"]["message"], r.text
    assert world.proxy.state.store.get_session("dora:x").user_id is None  # type: ignore[union-attr]
    assert post(world, "client", CHAT, chat(), **{"X-Session-Id": "dora:x"}).status_code == 200


def settled(world: World) -> None:
    """Wait until no lane has anything left to train (the table's rewards and ends trained)."""
    state = world.proxy.state
    loops = [state.trainer, *state.lanes.lanes.values()]

    def idle() -> bool:
        with state.store.read() as c:
            not_ingested = c.execute(
                "SELECT COUNT(*) FROM sessions s JOIN turns t ON t.session_id = s.session_id WHERE s.status='ended' "
                "AND t.turn_type='main' AND t.status='ok' AND NOT EXISTS (SELECT 1 FROM samples sa "
                "WHERE sa.turn_id = t.turn_id)").fetchone()[0]
        ready = TrainingStore(state.store).ready_samples(every_lane=True)
        return not_ingested == 0 and not ready and not any(loop.in_step for loop in loops)

    wait_for(idle, what="every lane to have trained what it had")


def test_the_admin_rolls_back_a_users_lane_only_by_naming_it(world: World) -> None:
    """`rollback N` with N of alice's lane is refused and nothing changes; with `"user": "alice"`
    her calls get N's adapter under a new version of her lane, and nobody else's do."""
    lanes = world.proxy.state.lanes
    settled(world)
    before = lanes.version_for("alice")
    refused = post(world, "admin", "/rl/rollback", {"version": world.alice_v})
    assert refused.status_code == 403 and "--user alice" in refused.json()["error"]["message"]
    assert lanes.version_for("alice") == before
    plain = post(world, "client", CHAT, chat())
    assert plain.json()["choices"][0]["message"]["content"] != f"v{world.alice_v}"
    done = post(world, "admin", "/rl/rollback", {"version": world.alice_v, "user": "alice"})
    assert done.status_code == 200, done.text
    new = done.json()["serving_version"]
    assert done.json()["user"] == "alice" and new > world.alice_v and lanes.version_for("alice") == new
    row = VersionStore(world.proxy.state.store, "alice").get(new)
    assert row is not None and row.kind == "rollback" and row.source_version == world.alice_v
    mine = post(world, "user", CHAT, chat())
    assert mine.json()["choices"][0]["message"]["content"] == f"v{new}"
    theirs = post(world, "other", CHAT, chat())
    assert theirs.json()["choices"][0]["message"]["content"] != f"v{new}"
    assert post(world, "client", CHAT, chat(f"tiny@{new}")).status_code == 404
    # Bad input: a name that cannot be a user's, a version that does not exist, no version.
    for body, status, code in (({"version": new, "user": "../x"}, 422, "invalid_user"),
                               ({"version": 10**9, "user": "alice"}, 404, "model_not_found"),
                               ({"version": new, "user": "nobody"}, 403, "version_of_another_lane"),
                               ({"user": "alice"}, 422, None), ({"version": "x"}, 422, None)):
        r = post(world, "admin", "/rl/rollback", body)
        assert r.status_code == status and r.json()["error"]["code"] == code, (body, r.text)
    assert lanes.version_for("alice") == new
