"""Users through `clawbridge up` (tiny model) with the real openai SDK, the `clawbridge users` CLI
against the running server, and forgetting checked on the raw bytes of the SQLite file and its WAL."""

from __future__ import annotations

import json
import time
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
    from clawbridge.chat.render import Renderer
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
            # A name never added is forgotten like any user (revoked first: a row that names it
            # revoked is written, then deleted with the rest).
            gone = httpx.post(proxy.base + "/rl/users/work/forget", headers=admin).json()
            assert gone["deleted"] == {"sessions": 1, "turns": 1, "users": 1} and proxy.state.store.list_sessions() == []
            assert UserStore(proxy.state.store).get("work") is None
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

    from clawbridge.serving.sampler import FakeSampler

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


def test_a_late_turn_of_a_forgotten_user_is_refused_but_a_new_user_of_her_name_records(tmp_path: Path) -> None:
    """The store's tombstones: a turn from a call that began before alice was forgotten (her key, or
    a session key of hers, whose turns name no user) is refused, alone in its group commit; while she
    is being forgotten no turn of hers is recorded at all; a new alice's calls record. A grave is
    swept once no older call runs."""
    import dataclasses

    from clawbridge.store.tombstones import UserForgotten

    store = Store.open(tmp_path)
    users = UserStore(store)
    users.add("alice")
    began = store.tombstones.epoch  # a call of hers begins (the proxy notes the epoch before the key check)
    store.record_turn(dataclasses.replace(_turn("alice:s", "alice", "early text"), caller="alice", epoch=began))
    users.forget("alice")
    late = dataclasses.replace(_turn("alice:s", "alice", "late text"), caller="alice", epoch=began)
    by_session_key = dataclasses.replace(_turn("sess_k", None, "keyed text"), caller="alice", epoch=began)
    with pytest.raises(UserForgotten):
        store.record_turn(late)
    errors = store.record_turns([(by_session_key, "session_key", None), (_turn("other", None, "other text"), "header", None)])
    assert isinstance(errors[0], UserForgotten) and errors[1] is None
    assert store.get_session("alice:s") is None and store.get_session("sess_k") is None

    users.add("alice")  # a new user of the same name
    fresh = dataclasses.replace(_turn("alice:s", "alice", "fresh text"), caller="alice", epoch=store.tombstones.epoch)
    store.record_turn(fresh)
    assert [s.session_id for s in store.list_sessions(user="alice")] == ["alice:s"]
    assert store.session_turns("alice:s")[0]["request"]["messages"][0]["content"] == "fresh text"

    users.begin_forget("alice")  # being forgotten: refused whatever the epoch, and her key is revoked
    assert users.is_revoked("alice")
    with pytest.raises(UserForgotten):
        store.record_turn(dataclasses.replace(fresh, turn_id="turn_x", epoch=store.tombstones.epoch))
    users.forget("alice")
    store.tombstones.sweep(oldest_running=None)
    assert len(store.tombstones) == 0
    store.close()
    blob = raw_bytes(tmp_path)
    assert b"other text" in blob and not any(t in blob for t in (b"early text", b"late text", b"keyed text", b"fresh text"))


def test_forget_takes_her_held_out_items_out_of_promotion_figures(tmp_path: Path) -> None:
    """A held-out item is a turn id, and a version's figures keep the greedy answers of the first
    items it failed: forgetting alice takes her items and the answers given to them out of the
    cached evaluations and the decisions; bob's stay."""
    from clawbridge.store.promotion import Decision, PromotionStore

    store = Store.open(tmp_path)
    users = UserStore(store)
    turns = {}
    for user in ("alice", "bob"):
        users.add(user)
        turns[user] = store.record_turn(_turn(f"{user}:s", user, f"{user} held out"))
    ta, tb = turns["alice"], turns["bob"]
    figure = {"items": 3, "passed": 1, "failed": [ta, tb], "failed_answers": ["answer to alice-9f2c", "answer to bob"]}
    promotion = PromotionStore(store)
    promotion.save_eval(3, "digest-a", figure)
    assert promotion.decide(Decision(3, "rejected", "eval", "worse", figures={
        "candidate": figure, "incumbent": {"failed": [tb, ta], "failed_answers": ["bob again", "alice-9f2c again"]}}),
        "eval")
    report = users.forget("alice")
    assert report.deleted["promotion_figures"] == 2
    (_, _, cached), = promotion.evals()
    assert cached["failed"] == [tb] and cached["failed_answers"] == ["answer to bob"] and cached["passed"] == 1
    (decision,) = promotion.decisions()
    assert decision.figures is not None
    assert decision.figures["candidate"]["failed"] == [tb] and decision.figures["candidate"]["failed_answers"] == ["answer to bob"]
    assert decision.figures["incumbent"] == {"failed": [tb], "failed_answers": ["bob again"]}
    store.close()
    blob = raw_bytes(tmp_path)
    assert b"alice-9f2c" not in blob and ta.encode() not in blob and b"answer to bob" in blob


def test_forget_cuts_her_running_calls_and_refuses_her_keys(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The real app over a slow fake model: alice has a whole-response call (her key), a stream (a
    session key of hers) and a stream of the shared key naming her (`X-User-Id`, trusted) running,
    bob a stream. Forgetting alice cuts her three at once (the call gets 401 `user_forgotten`, the
    streams that error as an event), records nothing of them, and lets bob's finish and be
    recorded; her session key is refused from then on, and none of her text is in the store file
    or its WAL."""
    import threading

    from clawbridge.chat.render import Renderer
    from tests.fake_proxy import SwitchableSampler, start_fake_proxy

    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    word = renderer.tokenizer.encode(" story", add_special_tokens=False)
    sampler = SwitchableSampler(script=word * 400, delay_s=0.01)  # 4 s per call unless cut
    proxy = start_fake_proxy(tiny_model_dir, tmp_path / "state", sampler, trust_user_header=True)
    try:
        base, admin = proxy.base, proxy.state.keys.admin
        keys = {u: httpx.post(base + "/rl/users", json={"user": u}, headers={"Authorization": f"Bearer {admin}"})
                .json()["api_key"] for u in ("alice", "bob")}
        session_key = httpx.post(base + "/rl/start_session", json={},
                                 headers={"Authorization": f"Bearer {keys['alice']}"}).json()["api_key"]
        text = {name: f"{name}-{uuid.uuid4().hex}" for name in ("whole", "keyed", "header", "bob")}
        outcome: dict[str, Any] = {}

        def run(name: str, key: str, stream: bool) -> None:
            client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)
            headers = {} if key == session_key else {"X-Session-Id": name}
            if name == "header":
                headers["X-User-Id"] = "alice"
            try:
                made = client.chat.completions.create(model="tiny", max_tokens=400, stream=stream, extra_headers=headers,
                                                      messages=[{"role": "user", "content": text[name]}])
                outcome[name] = [c for c in made] if stream else made  # type: ignore[union-attr]
            except openai.APIError as exc:
                outcome[name] = exc

        threads = [threading.Thread(target=run, args=args) for args in
                   (("whole", keys["alice"], False), ("keyed", session_key, True),
                    ("header", proxy.state.keys.client, True), ("bob", keys["bob"], True))]
        for t in threads:
            t.start()
        inflight = proxy.state.inflight
        deadline = time.monotonic() + 30
        while (inflight.calls_of("alice"), inflight.calls_of("bob")) != (3, 1):
            assert time.monotonic() < deadline, "the four calls never ran at once"
            time.sleep(0.02)
        forgot = httpx.post(base + "/rl/users/alice/forget", headers={"Authorization": f"Bearer {admin}"}, timeout=60)
        for t in threads:
            t.join(60)
        assert forgot.status_code == 200 and forgot.json()["cut"] == 3, forgot.text
        whole = outcome["whole"]
        assert isinstance(whole, openai.AuthenticationError) and whole.code == "user_forgotten", whole
        for name in ("keyed", "header"):
            assert isinstance(outcome[name], openai.APIError) and "forgotten" in str(outcome[name]), outcome[name]
        assert isinstance(outcome["bob"], list) and outcome["bob"][-1].choices[0].finish_reason == "length"
        assert [s.session_id for s in proxy.state.store.list_sessions()] == ["bob:bob"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key=session_key, max_retries=0).chat.completions.create(
                model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        blob = raw_bytes(tmp_path / "state")
        assert text["bob"].encode() in blob
        assert not any(text[name].encode() in blob for name in ("whole", "keyed", "header"))
    finally:
        proxy.stop()


def test_two_forgets_at_once_do_not_wait_for_each_other(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A forget waits for the requests that began before it and may act for its user; another
    forget (an admin request) is not one of them, so two at once both end promptly, far inside
    `drain_grace_s`."""
    import concurrent.futures

    from clawbridge.serving.sampler import FakeSampler
    from tests.fake_proxy import start_fake_proxy

    proxy = start_fake_proxy(tiny_model_dir, tmp_path / "state", FakeSampler(script=[5]), drain_grace_s=60.0)
    try:
        admin = {"Authorization": f"Bearer {proxy.state.keys.admin}"}
        for user in ("alice", "bob"):
            assert httpx.post(proxy.base + "/rl/users", json={"user": user}, headers=admin).status_code == 200
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda u: httpx.post(f"{proxy.base}/rl/users/{u}/forget", headers=admin,
                                                         timeout=120), ("alice", "bob")))
        assert [a.status_code for a in answers] == [200, 200] and time.monotonic() - t0 < 30
        assert UserStore(proxy.state.store).all() == []
    finally:
        proxy.stop()


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
