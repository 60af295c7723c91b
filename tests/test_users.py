"""Users through `clawbridge up` (tiny model) with the real openai SDK, the `clawbridge users` CLI
against the running server, and forgetting checked on the raw bytes of the SQLite file and its WAL."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clawbridge.store import DB_FILENAME, Store, TurnRecord
from clawbridge.store.training import TrainingStore
from clawbridge.store.users import UserError, UserStore
from tests.support import ProxyProcess
from tests.test_cli import cli


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    p = ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("users-state"), extra_args=("--no-train",)).start()
    yield p
    p.stop()


def call(proxy: ProxyProcess, method: str, path: str, key: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(method, proxy.base + path, json=body, headers={"Authorization": f"Bearer {key}"},
                         timeout=60.0)


def chat(key: str, proxy: ProxyProcess, text: str, session: str) -> Any:
    client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=key, max_retries=0)
    return client.chat.completions.create(model="default", max_tokens=4, messages=[{"role": "user", "content": text}],
                                          extra_headers={"X-Session-Id": session})


def raw_bytes(state_dir: Path) -> bytes:
    return b"".join(p.read_bytes() for p in state_dir.glob(DB_FILENAME + "*"))


def test_user_admin_api_validates(proxy: ProxyProcess) -> None:
    admin = proxy.admin_key
    for bad in ("", "a b", "../x", "x" * 65, "-lead", "al:ice"):
        r = call(proxy, "POST", "/rl/users", admin, {"user": bad})
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_user", (bad, r.text)
    assert call(proxy, "POST", "/rl/users", admin, {"name": "x"}).status_code == 422
    assert call(proxy, "POST", "/rl/users", admin, {"user": 5}).status_code == 422
    carol = call(proxy, "POST", "/rl/users", admin, {"user": "carol"})
    assert carol.status_code == 200 and carol.json()["api_key"].startswith("cbu-")
    # A session key may not be a user's key (it would record into the wrong place).
    clash = call(proxy, "POST", "/rl/start_session", admin, {"api_key": carol.json()["api_key"]})
    assert clash.status_code == 400 and clash.json()["error"]["code"] == "invalid_session_key"
    # A user's key starts sessions that are that user's.
    started = call(proxy, "POST", "/rl/start_session", carol.json()["api_key"], {})
    assert started.status_code == 200
    listed_by_carol = call(proxy, "GET", "/rl/sessions", carol.json()["api_key"]).json()["sessions"]
    assert [(s["session_id"], s["user_id"]) for s in listed_by_carol] == [(started.json()["session_id"], "carol")]
    dup = call(proxy, "POST", "/rl/users", admin, {"user": "carol"})
    assert dup.status_code == 409 and dup.json()["error"]["code"] == "user_exists"
    assert call(proxy, "POST", "/rl/users", proxy.key(), {"user": "dave"}).status_code == 403
    assert call(proxy, "DELETE", "/rl/users/nobody", admin).status_code == 404
    assert call(proxy, "POST", "/rl/users/nobody/forget", admin).status_code == 404
    listed = call(proxy, "GET", "/rl/users", admin).json()["users"]
    assert [u["user"] for u in listed] == ["carol"] and "api_key" not in json.dumps(listed)


def test_two_users_isolated_then_forgotten(proxy: ProxyProcess, tmp_path: Path) -> None:
    state = ["--state-dir", str(proxy.state_dir)]
    alice_key = json.loads(cli("users", "add", "alice", "--json", *state).stdout)["api_key"]
    bob_key = call(proxy, "POST", "/rl/users", proxy.admin_key, {"user": "bob"}).json()["api_key"]
    assert alice_key != bob_key and alice_key not in raw_bytes(proxy.state_dir).decode("latin-1")
    secret_a, secret_b = f"alice-{uuid.uuid4().hex}", f"bob-{uuid.uuid4().hex}"

    # Both agents call their session "main": each is recorded as its own user's.
    answer_a = chat(alice_key, proxy, f"remember {secret_a}", "main")
    chat(bob_key, proxy, f"remember {secret_b}", "main")
    mine = call(proxy, "GET", "/rl/sessions", alice_key).json()["sessions"]
    assert [(s["session_id"], s["user_id"], s["turn_count"]) for s in mine] == [("alice:main", "alice", 1)]
    view = call(proxy, "GET", "/rl/sessions/main", alice_key).json()
    assert view["user"] == "alice" and secret_a in json.dumps(view) and secret_b not in json.dumps(view)

    # Bob cannot see, reward or end Alice's session: 404, the same as a session that does not exist.
    missing = call(proxy, "GET", "/rl/sessions/no-such-session", bob_key)
    for method, path, body in (
        ("GET", "/rl/sessions/alice:main", None),
        ("POST", "/rl/set_reward", {"reward": 1, "session_id": "alice:main"}),
        ("POST", "/rl/set_reward", {"reward": 1, "interaction_id": answer_a.id}),
        ("POST", "/rl/set_session_reward", {"reward": 1, "session_id": "alice:main"}),
        ("POST", "/rl/end_session", {"session_id": "alice:main"}),
    ):
        r = call(proxy, method, path, bob_key, body)
        assert r.status_code == 404 and r.json()["error"]["type"] == missing.json()["error"]["type"], (path, r.text)
        assert "alice" not in r.json()["error"]["message"] or "alice:main" in json.dumps(body or path)
    # The shared client key cannot record into a user's session either (clawbridge.access: 403,
    # the same for any id in alice's namespace, whether or not she has that session).
    with pytest.raises(openai.PermissionDeniedError):
        chat(proxy.key(), proxy, "hi", "alice:main")

    # Alice rewards and ends her own session by the name her agent used.
    assert call(proxy, "POST", "/rl/set_reward", alice_key, {"reward": 1.0, "session_id": "main"}).status_code == 200
    assert call(proxy, "POST", "/rl/end_session", alice_key, {"session_id": "main"}).json()["ended"] is True
    everything = call(proxy, "GET", "/rl/sessions", proxy.admin_key).json()["sessions"]
    assert {"alice:main", "bob:main"} <= {s["session_id"] for s in everything}

    # Per-user counts: /rl/status, `clawbridge status`, the dashboard.
    users = {u["user"]: u for u in call(proxy, "GET", "/rl/status", proxy.admin_key).json()["users"]}
    assert (users["alice"]["sessions"], users["alice"]["turns"], users["alice"]["mean_reward"]) == (1, 1, 1.0)
    assert users["bob"]["pending_turns"] == 1 and users["bob"]["mean_reward"] is None
    status = json.loads(cli("status", "--json", *state).stdout)
    assert {u["user"] for u in status["users"]} >= {"alice", "bob"}
    assert "alice: 1 session(s), 1 turn(s)" in cli("status", *state).stdout

    # Exports filter by user.
    out = tmp_path / "alice.jsonl"
    cli("sessions", "export", str(out), "--format", "chat", "--user", "alice", *state)
    exported = out.read_text()
    assert secret_a in exported and secret_b not in exported

    # Revoked and unknown keys: 401 with an OpenAI-style body.
    assert call(proxy, "DELETE", "/rl/users/bob", proxy.admin_key).json()["status"] == "revoked"
    for key in (bob_key, "cbu-not-a-key"):
        with pytest.raises(openai.AuthenticationError) as info:
            chat(key, proxy, "hi", "main")
        assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"  # type: ignore[index]

    # Forget Alice: everything of hers is gone from the file, the WAL, the API, the dashboard and exports.
    assert secret_a.encode() in raw_bytes(proxy.state_dir)
    report = json.loads(cli("users", "forget", "alice", "--yes", "--json", *state).stdout)
    assert report["deleted"] == {"users": 1, "sessions": 1, "turns": 1, "rewards": 1} and report["wal_truncated"]
    blob = raw_bytes(proxy.state_dir)
    assert secret_a.encode() not in blob and b"alice:main" not in blob
    assert secret_b.encode() in blob  # the same search finds what was not forgotten
    with pytest.raises(openai.AuthenticationError):
        chat(alice_key, proxy, "hi", "main")
    admin = proxy.admin_key
    assert "alice" not in json.dumps(call(proxy, "GET", "/rl/sessions", admin).json())
    assert "alice" not in json.dumps(call(proxy, "GET", "/dashboard/api/overview", admin).json()["users"])
    assert secret_a not in call(proxy, "GET", "/dashboard/api/sessions", admin).text
    cli("sessions", "export", str(out), "--format", "sessions", *state)
    assert secret_a not in out.read_text() and secret_b in out.read_text()
    assert "alice" not in cli("users", "list", *state).stdout
    assert call(proxy, "POST", "/rl/users/alice/forget", admin).status_code == 404


def _turn(session_id: str, user: str | None, text: str) -> TurnRecord:
    return TurnRecord(session_id=session_id, turn_type="main", status="ok", model="m", prompt_token_ids=[1, 2],
                      completion_token_ids=[3], completion_logprobs=[-0.5], policy_version=0, finish_reason="stop",
                      request_json=json.dumps({"messages": [{"role": "user", "content": text}]}),
                      response_json=None, created_at=1.0, completed_at=2.0, user_id=user)


def test_forget_during_a_step_fails_that_step_only(tmp_path: Path) -> None:
    """A step that was training on samples that get forgotten cannot commit (its update holds the
    forgotten data; the trainer undoes a failed step); the other user's samples stay pending and
    train in the next step."""
    store = Store.open(tmp_path)
    users, ts = UserStore(store), TrainingStore(store)
    for user in ("alice", "bob"):
        users.add(user)
        store.record_turn(_turn(f"{user}:s", user, f"{user} text"), end_reason="end_session")
        store.add_reward(f"{user}:s", 1.0, "api", store.last_turn_id(f"{user}:s"))
    ts.ingest_ended()
    batch = ts.ready_samples()
    assert sorted(s.user_id or "" for s in batch) == ["alice", "bob"]
    step = ts.begin_step()
    report = users.forget("alice")
    assert report.deleted["samples"] == 1 and report.deleted["turns"] == 1
    with pytest.raises(Exception, match="no longer pending"):
        ts.commit_step(step, 1, {}, [s.turn_id for s in batch])
    ts.fail_step(step, "forgotten")
    assert [s.user_id for s in ts.ready_samples()] == ["bob"]
    with pytest.raises(UserError):
        users.forget("alice")
    store.close()
    assert b"alice text" not in raw_bytes(tmp_path) and b"bob text" in raw_bytes(tmp_path)


def test_trusted_user_header_names_the_user(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`trust_user_header`: the shared client key names its user with X-User-Id; off by default."""
    from clawbridge.render import Renderer
    from tests.fake_proxy import SwitchableSampler, script_for, start_fake_proxy

    sampler = SwitchableSampler(script=script_for(Renderer.from_pretrained(str(tiny_model_dir)), "ok"))
    for trusted in (False, True):
        proxy = start_fake_proxy(tiny_model_dir, tmp_path / str(trusted), sampler, trust_user_header=trusted)
        try:
            keys = proxy.state.keys
            client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=keys.client, max_retries=0)
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           extra_headers={"X-Session-Id": "main", "X-User-Id": "work"})
            users = {s.session_id: s.user_id for s in proxy.state.store.list_sessions()}
            assert users == ({"work:main": "work"} if trusted else {"main": None})
            if not trusted:
                continue
            h = {"Authorization": f"Bearer {keys.client}"}
            mine = httpx.get(proxy.base + "/rl/sessions/main", headers={**h, "X-User-Id": "work"})
            assert mine.status_code == 200 and mine.json()["user"] == "work"
            assert httpx.get(proxy.base + "/rl/sessions/main", headers={**h, "X-User-Id": "home"}).status_code == 404
            assert httpx.get(proxy.base + "/rl/sessions/main", headers=h).status_code == 403  # plain client key
            bad = httpx.get(proxy.base + "/rl/sessions/main", headers={**h, "X-User-Id": "no/such"})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_user"
            admin = {"Authorization": f"Bearer {keys.admin}"}
            assert httpx.post(proxy.base + "/rl/users", json={"user": "home"}, headers=admin).status_code == 200
            assert httpx.delete(proxy.base + "/rl/users/home", headers=admin).status_code == 200
            with pytest.raises(openai.AuthenticationError):
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               extra_headers={"X-User-Id": "home"})
            # A name never added is forgotten like any user.
            gone = httpx.post(proxy.base + "/rl/users/work/forget", headers=admin).json()
            assert gone["deleted"] == {"sessions": 1, "turns": 1} and proxy.state.store.list_sessions() == []
        finally:
            proxy.stop()


def test_forget_while_the_trainer_loop_steps(tmp_path: Path) -> None:
    """The trainer loop with alice forgotten in the middle of its train_step: the step fails (its
    samples are gone), its update is undone, the loop goes on, and the next step trains bob only."""
    from clawbridge.backend import LossConfig, StepResult
    from clawbridge.trainer import FakeTrainingBackend
    from tests.test_trainer_loop import INFO, loop_for, run

    store = Store.open(tmp_path)
    users = UserStore(store)
    turns: dict[str, list[str]] = {}
    for user, n in (("alice", 1), ("bob", 2)):
        users.add(user)
        turns[user] = [store.record_turn(_turn(f"{user}:s", user, f"{user} {i}")) for i in range(n)]
        store.add_reward(f"{user}:s", 1.0, "api", turns[user][-1])
        store.end_session(f"{user}:s", "end_session")

    class ForgetMidStep(FakeTrainingBackend):
        async def train_step(self, batch: Any, loss: LossConfig) -> StepResult:
            if not self.batches:
                users.forget("alice")  # as `clawbridge users forget alice` would, while the step runs
            return await super().train_step(batch, loss)

    from clawbridge.sampler import FakeSampler

    b = ForgetMidStep(FakeSampler(script=[7, 8]), INFO)
    loop = loop_for(store, b, batch_size=2)
    failed = run(loop.run_once())
    assert failed is not None and not failed.ok and "no longer pending" in (failed.error or "")
    assert sorted(failed.turn_ids) == sorted(turns["alice"] + turns["bob"])
    assert b.applied == []  # the failed step's update was undone
    ok = run(loop.run_once())
    assert ok is not None and ok.ok and sorted(ok.turn_ids) == sorted(turns["bob"])
    assert b.applied == turns["bob"]
    store.close()
    assert b"alice 0" not in raw_bytes(tmp_path)


def test_session_owners_are_remembered_only_once_committed_and_forgotten_with_the_user(tmp_path: Path) -> None:
    """`Store.owners` (the model call's ownership check without a store read): a session is
    remembered with its owner once the transaction creating it committed, a turn rolled back adds
    nothing, and forgetting the owner clears it, so a reused id is answered from the store again."""
    store = Store.open(tmp_path)
    users = UserStore(store)
    users.add("alice")
    assert store.owners.get("alice:s") == (False, None)
    store.record_turn(_turn("alice:s", "alice", "a"))
    assert store.owners.get("alice:s") == (True, "alice")
    assert users.session_owner("alice:s") == (True, "alice")
    # A group where one turn is refused (a duplicate turn id): only the committed session is remembered.
    dup = _turn("other", None, "x")
    dup = TurnRecord(**{**dup.__dict__, "turn_id": store.last_turn_id("alice:s")})
    errors = store.record_turns([(_turn("fresh", None, "f"), "header", None), (dup, "header", None)])
    assert errors[0] is None and errors[1] is not None
    assert store.owners.get("fresh") == (True, None) and store.owners.get("other") == (False, None)
    assert users.session_owner("other") == (False, None)  # never created: read, and not remembered
    assert store.owners.get("other") == (False, None)
    users.forget("alice")
    assert store.owners.get("alice:s") == (False, None) and users.session_owner("alice:s") == (False, None)
    store.record_turn(_turn("alice:s", "bob", "b"))  # the id reused by someone else after the forget
    assert users.session_owner("alice:s") == (True, "bob")
    # Read from the store (not remembered yet) after a restart: same answer, then remembered.
    store.close()
    store = Store.open(tmp_path)
    assert store.owners.get("alice:s") == (False, None)
    assert UserStore(store).session_owner("alice:s") == (True, "bob") and store.owners.get("alice:s") == (True, "bob")
    store.close()


def test_the_store_takes_a_write_into_a_session_only_for_its_owner(tmp_path: Path) -> None:
    """The owner is part of every write that adds to or creates a session, checked inside the write:
    a turn of another owner (no user, another user), `ensure_session`, a new id in a user's
    namespace, a session key moved to another owner; each refused the same way whether or not the
    session exists, and nothing written. A name whose namespace already holds others' sessions is
    not added as a user (the shared key named `dora:x` before dora existed)."""
    from clawbridge.access import Denied
    from clawbridge.store.owners import SessionOwnerError

    store = Store.open(tmp_path)
    users = UserStore(store)
    users.add("alice")
    users.add("bob")
    store.record_turn(_turn("alice:main", "alice", "hers"))
    refusals = []
    for sid, owner in (("alice:main", None), ("alice:main", "bob"), ("alice:new", None), ("alice:new", "bob")):
        with pytest.raises(SessionOwnerError) as info:
            store.record_turn(_turn(sid, owner, "not hers"))
        refusals.append((info.value.status, info.value.code, info.value.message.replace(sid, "ID")))
        with pytest.raises(SessionOwnerError):
            store.ensure_session(sid, "trajectory", None, owner)
    assert len(set(refusals)) == 1 and refusals[0][:2] == (403, "session_not_yours")  # one answer, exists or not
    assert isinstance(info.value, Denied)  # answered by the proxy like its own check
    assert store.get_session("alice:new") is None and store.get_session("alice:main").turn_count == 1  # type: ignore[union-attr]
    errors = store.record_turns([(_turn("alice:main", None, "x"), "header", None),
                                 (_turn("alice:main", "alice", "ok"), "header", None)])
    assert isinstance(errors[0], SessionOwnerError) and errors[1] is None  # refused alone, the group commits
    store.record_turn(_turn("zed:x", None, "no user zed"))  # not a user's namespace: anyone's id
    store.record_turn(_turn("alice:other", "alice", "hers again"))
    # A revoked user keeps her namespace (her data stays); a forgotten one frees it.
    users.revoke("bob")
    with pytest.raises(SessionOwnerError):
        store.record_turn(_turn("bob:x", None, "x"))
    # A session key never moves to another owner.
    started = store.start_keyed_session("k" * 20, None, "alice")
    with pytest.raises(SessionOwnerError):
        store.start_keyed_session("k" * 20, None, None)
    assert store.session_for_key("k" * 20) == started
    # The race: the shared key recorded `dora:x` before there was a dora.
    store.record_turn(_turn("dora:x", None, "the shared key's"))
    with pytest.raises(UserError, match="dora:"):
        users.add("dora")
    assert users.get("dora") is None and store.get_session("dora:x").user_id is None  # type: ignore[union-attr]
    users.add("Dora")  # names are case-sensitive: dora's sessions are not Dora's
    store.close()
