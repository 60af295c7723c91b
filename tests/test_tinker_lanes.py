"""Per-user adapters on the Tinker backend: the proxy (in process) with the real tinker SDK against
the local protocol server, users' keys through the real `openai` SDK.

Each user's rewarded turns train their own training client on the service (nothing of one user
reaches the other's weights), each user's next call is answered by a sampling client of their own
trained weights under their own version, the shared key's by the base; forgetting a user deletes
their checkpoints on the service and their lane's folder here."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

pytest.importorskip("tinker")

from clawbridge.config import Settings
from clawbridge.proxy.app import build_app
from clawbridge.server import build_state
from tests.tinker_server import TinkerProtocolServer, sample_output

MODEL = "test/tiny-qwen3"
ADMIN = "cbadmin-key"


def test_each_user_trains_their_own_tinker_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = TinkerProtocolServer(models=(MODEL,))
    server.vocab = 4000  # below the tiny tokenizer's vocabulary
    server.start()
    settings = Settings.model_validate({
        "backend": "tinker", "model": MODEL, "tokenizer": str(tiny_model_dir), "state_dir": tmp_path,
        "backends": {"tinker": {"base_url": server.base_url, "api_key": "tml-test-key"}},
        "api_key": "cb-client-key", "admin_key": ADMIN, "per_user_adapters": True, "batch_size": 1,
        "baseline": "none", "trainer_poll_interval_s": 0.05, "privacy": "off",
    })

    async def main() -> dict[str, Any]:
        state = await build_state(settings)
        # users' adapters are not gated, but their steps rehearse the shared gate's set
        assert state.lanes is not None and state.lanes.rehearsals is state.promotion is not None
        app = build_app(state)
        out: dict[str, Any] = {"turns": {}, "second": {}}
        async with app.router.lifespan_context(app):
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
            admin = {"Authorization": f"Bearer {ADMIN}"}
            keys = {u: (await http.post("/rl/users", json={"user": u}, headers=admin)).json()["api_key"]
                    for u in ("alice", "bob")}

            def client(key: str) -> openai.AsyncOpenAI:
                return openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key=key,
                                          http_client=http)  # type: ignore[arg-type]

            for user, text in (("alice", "Hello from alice"), ("bob", "Bob says hi")):
                await client(keys[user]).chat.completions.create(
                    model="default", messages=[{"role": "user", "content": text}], max_tokens=6,
                    extra_headers={"X-Session-Id": "main"})
                auth = {"Authorization": f"Bearer {keys[user]}"}
                r = await http.post("/rl/set_session_reward", json={"session_id": "main", "reward": 1.0}, headers=auth)
                assert r.status_code == 200, r.text
                assert (await http.post("/rl/end_session", json={"session_id": "main"}, headers=auth)).status_code == 200
                out["turns"][user] = state.store.session_turns(f"{user}:main")[0]
            for _ in range(400):  # until both lanes have committed a trained version
                lanes = (await http.get("/rl/status", headers=admin)).json()["lanes"] or {}
                if all((lanes.get(u) or {}).get("serving_version") for u in ("alice", "bob")):
                    break
                await asyncio.sleep(0.05)
            out["lanes"] = lanes
            for user in ("alice", "bob", None):
                key = keys[user] if user else "cb-client-key"
                r = await client(key).chat.completions.create(
                    model="default", messages=[{"role": "user", "content": "Once more"}], max_tokens=6,
                    extra_headers={"X-Session-Id": "second"})
                out["second"][user] = (r.system_fingerprint, state.store.session_turns(
                    f"{user}:second" if user else "second")[0])
            bob_version = lanes["bob"]["serving_version"]
            with pytest.raises(openai.NotFoundError):
                await client(keys["alice"]).chat.completions.create(
                    model=f"default@{bob_version}", messages=[{"role": "user", "content": "x"}], max_tokens=2)
            forgot = await http.post("/rl/users/bob/forget", headers=admin)
            assert forgot.status_code == 200, forgot.text
            out["forgot"] = forgot.json()["deleted"]
            out["lanes_after"] = (await http.get("/rl/status", headers=admin)).json()["lanes"]
            await http.aclose()
        state.writer.close()
        state.store.close()
        await state.backend.close()
        return out

    try:
        out = asyncio.run(main())
    finally:
        server.stop()
    lanes = out["lanes"]
    # Two training clients besides none for the shared policy (every call had a user), each
    # trained on its own user's turn only.
    trained = {m.model_id: m.trained for m in server.models.values() if m.trained}
    assert len(trained) == 2, trained
    inputs = {u: tuple((t["prompt_token_ids"] + t["completion_token_ids"])[:-1]) for u, t in out["turns"].items()}
    assert sorted(trained.values()) == sorted([[inputs["alice"]], [inputs["bob"]]])
    # Each user's next call: their own version, sampled from weights trained one step; the shared key: the base.
    for user in ("alice", "bob"):
        fingerprint, turn = out["second"][user]
        assert fingerprint == f"policy-v{lanes[user]['serving_version']}"
        expected = sample_output(turn["prompt_token_ids"], 1, len(turn["completion_token_ids"]), None, 4000)[0]
        assert turn["completion_token_ids"] == expected
    fingerprint, turn = out["second"][None]
    assert fingerprint == "policy-v0"
    assert turn["completion_token_ids"] == sample_output(turn["prompt_token_ids"], 0, len(turn["completion_token_ids"]),
                                                         None, 4000)[0]
    # Forgetting bob deleted his checkpoints on the service and his folder here; alice's lane stays.
    assert out["forgot"]["adapter_checkpoints"] >= 2 and out["forgot"]["adapter_versions"] >= 2, out["forgot"]
    bob_model = next(m.model_id for m in server.models.values() if m.trained == [inputs["bob"]])
    assert server.deleted and all(bob_model in path for path in server.deleted), (bob_model, server.deleted)
    assert not (tmp_path / "users" / "bob").exists() and (tmp_path / "users" / "alice" / "tinker").is_dir()
    assert set(out["lanes_after"]) == {"alice"}


def _settings(server: TinkerProtocolServer, tiny_model_dir: Path, tmp_path: Path) -> Settings:
    return Settings.model_validate({
        "backend": "tinker", "model": MODEL, "tokenizer": str(tiny_model_dir), "state_dir": tmp_path,
        "backends": {"tinker": {"base_url": server.base_url, "api_key": "tml-test-key", "retry_backoff_s": 0.05}},
        "api_key": "cb-client-key", "admin_key": ADMIN, "per_user_adapters": True, "batch_size": 1,
        "baseline": "none", "trainer_poll_interval_s": 0.05, "privacy": "off",
    })


def _client(http: httpx.AsyncClient, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key=key, http_client=http)  # type: ignore[arg-type]


async def _train_one_turn_each(http: httpx.AsyncClient, keys: dict[str, str]) -> dict[str, Any]:
    """One rewarded, ended turn per user; returns `/rl/status`'s lanes once every lane has a version."""
    for user, key in keys.items():
        await _client(http, key).chat.completions.create(
            model="default", messages=[{"role": "user", "content": f"Hello from {user}"}], max_tokens=6,
            extra_headers={"X-Session-Id": "main"})
        auth = {"Authorization": f"Bearer {key}"}
        assert (await http.post("/rl/set_session_reward", json={"session_id": "main", "reward": 1.0},
                                headers=auth)).status_code == 200
        assert (await http.post("/rl/end_session", json={"session_id": "main"}, headers=auth)).status_code == 200
    lanes: dict[str, Any] = {}
    for _ in range(400):
        lanes = (await http.get("/rl/status", headers={"Authorization": f"Bearer {ADMIN}"})).json()["lanes"] or {}
        if all((lanes.get(u) or {}).get("serving_version") for u in keys):
            break
        await asyncio.sleep(0.05)
    return lanes


async def _with_server(settings: Settings, body: Any) -> Any:
    """Run `body(state, http)` inside a started app, then shut it down as `clawbridge up` does."""
    state = await build_state(settings)
    app = build_app(state)
    try:
        async with app.router.lifespan_context(app):
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
            try:
                return await body(state, http)
            finally:
                await http.aclose()
    finally:
        state.writer.close()
        state.store.close()
        await state.backend.close()


def test_after_a_restart_each_user_is_served_by_their_own_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Against a service whose sampler weights die with the training client that saved them (as
    SkyRL's does): after a restart, a user's calls and `default@N` of her version are answered by
    her restored adapter, not 502 from sampler weights of a released client."""
    server = TinkerProtocolServer(models=(MODEL,))
    server.vocab = 4000
    server.tied_samplers = server.short_sampler_paths = True
    server.start()
    settings = _settings(server, tiny_model_dir, tmp_path)
    admin = {"Authorization": f"Bearer {ADMIN}"}

    async def first(state: Any, http: httpx.AsyncClient) -> tuple[str, int]:
        key = (await http.post("/rl/users", json={"user": "alice"}, headers=admin)).json()["api_key"]
        lanes = await _train_one_turn_each(http, {"alice": key})
        return key, int(lanes["alice"]["serving_version"])

    async def second(state: Any, http: httpx.AsyncClient) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, model in (("plain", "default"), ("pinned", f"default@{version}")):
            r = await _client(http, key).chat.completions.create(
                model=model, messages=[{"role": "user", "content": "After the restart"}], max_tokens=5,
                extra_headers={"X-Session-Id": name})
            out[name] = (r.system_fingerprint, state.store.session_turns(f"alice:{name}")[0])
        out["lanes"] = (await http.get("/rl/status", headers=admin)).json()["lanes"]
        return out

    try:
        key, version = asyncio.run(_with_server(settings, first))
        assert server.loaded() == []  # every training client was released at shutdown
        out = asyncio.run(_with_server(settings, second))
    finally:
        server.stop()
    for name in ("plain", "pinned"):
        fingerprint, turn = out[name]
        assert fingerprint == f"policy-v{version}", name
        expected = sample_output(turn["prompt_token_ids"], 1, len(turn["completion_token_ids"]), None, 4000)[0]
        assert turn["completion_token_ids"] == expected, name  # her one trained step's weights
    assert out["lanes"]["alice"]["serving_version"] == version and out["lanes"]["alice"]["last_error"] is None


def test_forgetting_a_user_owes_what_the_service_refused_to_delete_until_it_is_gone(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remote deletion that fails is not just logged: it is owed in the store, shown by
    `/rl/status` and the forget answer, and retried in the background until the service has
    nothing of hers."""
    from clawbridge.trainer import deletions

    monkeypatch.setattr(deletions, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(deletions, "POLL_MAX_S", 0.05)
    server = TinkerProtocolServer(models=(MODEL,))
    server.vocab = 4000
    server.short_sampler_paths = True
    server.start()
    settings = _settings(server, tiny_model_dir, tmp_path)
    admin = {"Authorization": f"Bearer {ADMIN}"}

    async def body(state: Any, http: httpx.AsyncClient) -> dict[str, Any]:
        key = (await http.post("/rl/users", json={"user": "bob"}, headers=admin)).json()["api_key"]
        await _train_one_turn_each(http, {"bob": key})
        out: dict[str, Any] = {"bobs": {p for p in server.checkpoints}}
        server.refuse_deletes = True
        forgot = await http.post("/rl/users/bob/forget", headers=admin)
        assert forgot.status_code == 200, forgot.text
        out["forgot"] = forgot.json()
        out["owed"] = (await http.get("/rl/status", headers=admin)).json()["remote_deletions"]
        server.refuse_deletes = False
        for _ in range(400):
            owed = (await http.get("/rl/status", headers=admin)).json()["remote_deletions"]
            if owed["owed"] == 0:
                break
            await asyncio.sleep(0.05)
        out["after"] = owed
        return out

    try:
        out = asyncio.run(_with_server(settings, body))
    finally:
        server.stop()
    assert out["forgot"]["forgotten"] is True and out["forgot"]["remote_deletions_owed"] == len(out["bobs"]) == 4
    owed = out["owed"]
    assert owed["owed"] == 4 and owed["by_reason"] == {"forget": 4}
    assert {i["kind"] for i in owed["items"]} == {"state", "sampler"}
    assert all("refused" in i["last_error"] and "bob" not in i["object"] for i in owed["items"])
    assert out["after"]["owed"] == 0 and out["after"]["items"] == []
    assert not set(server.checkpoints) & out["bobs"]  # nothing of bob's is left on the service
    assert not (tmp_path / "users" / "bob").exists()
