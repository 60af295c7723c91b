"""The admin's promote / rollback / resume and what a restart serves, over the fake training backend
(which, like Fireworks or SGLang with full weights, serves only the version it published): a
rollback holds until `clawbridge resume`, a rollback that fails is not recorded and is a clear 409,
and a server that does not train serves the last promoted version, not a newer candidate.

Real app, uvicorn, SQLite and trainer loop (`tests/support.InProcessProxy`), the real `openai` SDK,
the CLI as a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clawbridge.backend import ModelInfo
from clawbridge.chat.render import Renderer
from clawbridge.config import Settings
from clawbridge.promotion.describe import promotion_lines
from clawbridge.serving.sampler import FakeSampler
from clawbridge.store import Store
from clawbridge.store.promotion import Decision, PromotionStore
from clawbridge.store.versions import VersionStore
from clawbridge.trainer.fake import FakeTrainingBackend
from tests.fake_proxy import script_for
from tests.support import InProcessProxy, free_port, wait_for


def info(model: Path) -> ModelInfo:
    return ModelInfo(name="tiny", tokenizer_path=str(model), context_window=4096, max_output_tokens=256)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clawbridge.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


def test_a_rollback_holds_until_resumed_and_a_failed_one_is_not_recorded(tiny_model_dir: Path,
                                                                        tmp_path: Path) -> None:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    backend = FakeTrainingBackend(FakeSampler(script=script_for(renderer, "ok")), info(tiny_model_dir))
    settings = Settings(port=free_port(), state_dir=tmp_path / "state", model=str(tiny_model_dir),
                        served_model_name="tiny", batch_size=1, baseline="none", trainer_poll_interval_s=0.05,
                        batch_wait_s=0, promotion_mode="off")  # the hold without a gate (no later candidate to beat)
    proxy = InProcessProxy(settings, backend).start()
    admin = httpx.Client(base_url=proxy.base, headers={"Authorization": f"Bearer {proxy.state.keys.admin}"},
                         timeout=60)
    client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=proxy.state.keys.client, max_retries=0)

    def session(sid: str) -> None:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"hi {sid}"}],
                                       extra_headers={"X-Session-Id": sid})
        assert admin.post("/rl/set_reward", json={"reward": 1.0, "session_id": sid}).status_code == 200
        assert admin.post("/rl/end_session", json={"session_id": sid}).status_code == 200

    def promotion() -> dict[str, Any]:
        r = admin.get("/rl/status")
        assert r.status_code == 200, r.text
        return dict(r.json()["promotion"])

    def run_once() -> Any:
        assert proxy.loop is not None
        return asyncio.run_coroutine_threadsafe(proxy.state.trainer.run_once(), proxy.loop).result(60)

    try:
        for i in range(2):
            session(f"s{i}")
            wait_for(lambda i=i: len(backend.published) >= i + 1, 30, f"step {i + 1} published")
        assert backend.sampler().policy_version == 2
        applied = list(backend.applied)

        # the checkpoint of v0 is gone at the backend (a hosted service lost it): a clear 409, no
        # decision recorded, and v0 does not serve
        del backend.disk["v00000000-base"]
        r = admin.post("/rl/rollback", json={"version": 0})
        assert r.status_code == 409 and r.json()["error"]["code"] == "checkpoint_unavailable", r.text
        assert "nothing changed: v2 still serves" in r.json()["error"]["message"]
        assert promotion()["decisions"] == []
        wait_for(lambda: not proxy.state.trainer.keeper.dirty, 30, "the trainer to reload what it held")
        assert backend.applied == applied and backend.sampler().policy_version != 0

        # a rollback that works holds: v1 serves, and a rewarded session trains nothing
        r = admin.post("/rl/rollback", json={"version": 1})
        assert r.status_code == 200 and r.json()["held"] is True, r.text
        rolled = backend.sampler().policy_version  # a rollback version carrying v1's weights
        published = list(backend.published)
        session("after-rollback")
        assert run_once() is None  # the batch is ready, but the hold runs no step
        assert backend.published == published and backend.sampler().policy_version == rolled
        p = promotion()
        assert p["held_version"] == 1 and p["holding"].startswith("rolled back to v1 by the admin")
        assert p["decisions"][0]["source"] == "admin" and p["decisions"][0]["version"] == 1
        words = " ".join(promotion_lines(p))
        assert "rollback holds: v1 serves and training waits until `clawbridge resume`" in words
        overview = proxy.state  # the dashboard shows the same lines (dashboard.data.promotion)
        from clawbridge.dashboard.data import promotion as dashboard_promotion

        assert any("rollback holds: v1" in line for line in dashboard_promotion(overview)["lines"])

        # resume (the dashboard's button: a login, and the CSRF token on the write): training goes
        # on from v1's weights
        page = httpx.Client(base_url=proxy.base, follow_redirects=False, timeout=60)
        assert page.post("/dashboard/login", data={"key": proxy.state.keys.admin}).status_code == 303
        m = re.search(r'<meta name="csrf-token" content="([^"]+)">', page.get("/dashboard").text)
        assert m is not None
        assert page.post("/dashboard/api/promotion/resume", json={}).status_code == 403  # no CSRF token
        assert promotion()["held_version"] == 1
        r = page.post("/dashboard/api/promotion/resume", json={}, headers={"X-CSRF-Token": m.group(1)})
        assert r.status_code == 200 and r.json() == {"resumed": True, "held_version": 1,
                                                     "serving_version": rolled}, r.text
        page.close()
        wait_for(lambda: len(backend.published) > len(published), 30, "a step after resume")
        assert promotion()["held_version"] is None
        r = admin.post("/rl/resume")
        assert r.status_code == 200 and r.json()["resumed"] is False
        # bad input: a version that does not exist is 404, a bad body 422
        r = admin.post("/rl/rollback", json={"version": 999})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = admin.post("/rl/rollback", json={"version": "one"})
        assert r.status_code == 422
        r = httpx.post(proxy.base + "/rl/resume", headers={"Authorization": f"Bearer {proxy.state.keys.client}"})
        assert r.status_code == 403
    finally:
        admin.close()
        proxy.stop()

    # offline: `clawbridge rollback` holds too, `clawbridge status` says so, `clawbridge resume` ends it
    state = str(tmp_path / "state")
    out = cli("rollback", "1", "--state-dir", state)
    assert out.returncode == 0 and "training holds until `clawbridge resume`" in out.stdout, out.stderr
    words = " ".join(cli("status", "--state-dir", state).stdout.split())
    assert "rollback holds: v1 serves and training waits until `clawbridge resume`" in words, words
    out = cli("resume", "--state-dir", state)
    assert out.returncode == 0 and "resumed: training goes on from v1" in out.stdout, out.stdout + out.stderr
    assert "rollback holds" not in cli("status", "--state-dir", state).stdout


@pytest.mark.parametrize("mode", ["eval", "off"])
def test_a_server_that_does_not_train_serves_the_last_promoted_version(tiny_model_dir: Path, tmp_path: Path,
                                                                       mode: str) -> None:
    """v1 was trained and rejected (eval), v0 is the serving version: `up --no-train` on a backend
    that serves one version at a time serves v0, not v1. With promotion off, the newest serves."""
    from clawbridge.server import build_state

    state = tmp_path / "state"
    store = Store.open(state)
    versions, ps = VersionStore(store), PromotionStore(store)
    versions.commit_base("fake://v00000000-base", None)
    v1 = versions.reserve("step")
    versions.commit(v1, "fake://v00000001-step", None)
    ps.set_state("eval", 0)
    assert ps.decide(Decision(v1, "rejected", "eval", "worse", 0, 0.25, 1.0), "eval")
    store.close()
    evals = tmp_path / "evals.jsonl"
    evals.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "expect": "x"}) + "\n")
    disk = {"v00000000-base": (0, ()), "v00000001-step": (1, ("t1",))}
    backend = FakeTrainingBackend(FakeSampler(script=[7]), info(tiny_model_dir), disk=disk)
    extra: dict[str, Any] = {"eval_set": str(evals)} if mode == "eval" else {}
    settings = Settings(state_dir=state, model=str(tiny_model_dir), served_model_name="tiny", train=False,
                        promotion_mode=mode, **extra)

    async def start() -> tuple[int, int]:
        st = await build_state(settings, backend)
        try:
            return st.router.serving_version, st.backend.sampler().policy_version
        finally:
            st.writer.close()
            st.store.close()

    serving, published = asyncio.run(start())
    expected = 0 if mode == "eval" else 1
    assert (serving, published) == (expected, expected)
    assert backend.applied == ([] if mode == "eval" else ["t1"])
