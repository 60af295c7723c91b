"""Forgetting a user while one of her streams runs, through `clawbridge up` (tiny model, per-user
LoRA adapters served by the SGLang protocol server, trained in the server's process) and the real
`openai` SDK.

Alice and bob each train their own adapter; alice starts a long stream; the admin forgets her
after its first chunk. Then: the stream is cut (it never finishes as an answer), no file under the
state dir (store, WAL, checkpoints, trainer exports, `versions/vN` adapter folders, the server's
log) holds any text of hers, the SGLang server holds none of her adapters, and her version numbers
are never given again. A new user named alice starts clean: nothing of the old one is hers to see
and her calls are answered by the shared policy, not by the forgotten adapter. Bob's text and
adapter are still there, which proves the searches can find what they look for.
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

pytest.importorskip("torch")
pytest.importorskip("clawbridge_local")

from clawbridge.config import LORA_TARGET_MODULES
from clawbridge.store import DB_FILENAME
from tests.kill_support import wait_until
from tests.sglang_server import FakeSGLang
from tests.support import ProxyProcess, free_port

pytestmark = pytest.mark.slow

LONG = 400
"""Tokens of alice's stream: 400 x 20 ms at the SGLang server, far longer than the forget takes."""


def call(proxy: ProxyProcess, method: str, path: str, key: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(method, proxy.base + path, json=body, headers={"Authorization": f"Bearer {key}"},
                         timeout=120.0)


def rows(state: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{state / DB_FILENAME}?mode=ro", uri=True, timeout=30)
    try:
        return [tuple(r) for r in conn.execute(sql).fetchall()]
    finally:
        conn.close()


def files_holding(state: Path, needles: list[bytes]) -> dict[str, list[str]]:
    """Every file under `state` whose bytes hold one of `needles` (needle -> relative paths)."""
    out: dict[str, list[str]] = {}
    for path in sorted(state.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            for needle in needles:
                if needle in data:
                    out.setdefault(needle.decode(), []).append(str(path.relative_to(state)))
    return out


def train_sessions(proxy: ProxyProcess, key: str, secret: str, n: int) -> None:
    """`n` rewarded, ended sessions of one user, each message holding `secret`."""
    client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=key, max_retries=0, timeout=120)
    for i in range(n):
        sid = f"s{i}"
        client.chat.completions.create(model="tiny", max_tokens=4, extra_headers={"X-Session-Id": sid},
                                       messages=[{"role": "user", "content": f"note {i}: {secret}"}])
        call(proxy, "POST", "/rl/set_session_reward", key, {"session_id": sid, "reward": 1.0}).raise_for_status()
        call(proxy, "POST", "/rl/end_session", key, {"session_id": sid}).raise_for_status()


def test_forgetting_a_user_mid_stream_leaves_nothing_of_hers(tiny_model_dir: Path, tmp_path: Path) -> None:
    fake = FakeSGLang(tiny_model_dir, port=free_port(), enable_lora=True, max_lora_rank=8,
                      lora_target_modules=LORA_TARGET_MODULES, token_delay_s=0.02,
                      script=list(range(200, 210))).start()  # ordinary tokens: a stream ends at max_tokens
    state = tmp_path / "state"
    env = {"CLAWBRIDGE_LOCAL_SGLANG_URL": fake.url, "CLAWBRIDGE_LORA_RANK": "4", "CLAWBRIDGE_PER_USER_ADAPTERS": "true",
           "CLAWBRIDGE_BATCH_SIZE": "2", "CLAWBRIDGE_BASELINE": "none", "CLAWBRIDGE_TRAINER_POLL_INTERVAL_S": "0.2",
           "CLAWBRIDGE_PROMOTION_MODE": "off", "CLAWBRIDGE_LEARNING_RATE": "0.01"}
    proxy = ProxyProcess(tiny_model_dir, state, env=env, extra_args=("--served-model-name", "tiny")).start(300)
    try:
        admin = proxy.admin_key
        keys = {u: call(proxy, "POST", "/rl/users", admin, {"user": u}).json()["api_key"] for u in ("alice", "bob")}
        secrets = {u: f"{u}-secret-{uuid.uuid4().hex}" for u in ("alice", "bob")}
        late = f"alice-late-{uuid.uuid4().hex}"
        for user in ("alice", "bob"):
            train_sessions(proxy, keys[user], secrets[user], 2)

        def lanes() -> dict[str, Any]:
            return dict(call(proxy, "GET", "/rl/status", admin).json().get("lanes") or {})

        wait_until(lambda: all((lanes().get(u) or {}).get("serving_version") is not None for u in ("alice", "bob")),
                   "both users' first adapter", 300, proxy=proxy)
        served = {u: lane["serving_version"] for u, lane in lanes().items()}
        hers = sorted(int(r[0]) for r in rows(state, "SELECT version FROM policy_versions WHERE lane='alice'"))
        assert served["alice"] in hers and f"v{served['alice']}" in fake.adapters, (served, fake.adapters)
        assert (state / "trainer" / "local" / "versions" / f"v{served['alice']}").is_dir()

        # Alice's long stream; the admin forgets her after its first chunk.
        first = threading.Event()
        seen: dict[str, Any] = {"chunks": 0, "error": None, "finish": None}

        def stream() -> None:
            client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=keys["alice"], max_retries=0, timeout=120)
            try:
                for chunk in client.chat.completions.create(
                        model="tiny", max_tokens=LONG, stream=True, extra_headers={"X-Session-Id": "late"},
                        messages=[{"role": "user", "content": f"write a long story about {late}"}]):
                    seen["chunks"] += 1
                    if chunk.choices and chunk.choices[0].finish_reason:
                        seen["finish"] = chunk.choices[0].finish_reason
                    first.set()
            except openai.APIError as exc:
                seen["error"] = exc
            finally:
                first.set()

        runner = threading.Thread(target=stream)
        runner.start()
        assert first.wait(120), "alice's stream never started"
        forgot = call(proxy, "POST", "/rl/users/alice/forget", admin)
        runner.join(120)
        assert not runner.is_alive()
        assert forgot.status_code == 200, forgot.text
        report = forgot.json()
        assert report["cut"] == 1 and report["deleted"]["adapter_versions"] == len(hers), report
        # The stream was cut, not answered: an error event, never a finish reason, far from its end.
        assert seen["finish"] is None and seen["error"] is not None and seen["chunks"] < LONG, seen
        assert "forgotten" in str(seen["error"])

        # Nothing of hers is served: her key is refused, no adapter of hers is on the SGLang server.
        assert call(proxy, "GET", "/rl/sessions", keys["alice"]).status_code == 401
        assert not {f"v{v}" for v in hers} & set(fake.adapters), (hers, fake.adapters)
        assert f"v{served['bob']}" in fake.adapters
        versions_dir = state / "trainer" / "local" / "versions"
        assert not {f"v{v}" for v in hers} & {p.name for p in versions_dir.iterdir()}

        # A new alice starts clean: no session of the old one, the shared policy answers her, and the
        # numbers given from now on are new ones.
        new_key = call(proxy, "POST", "/rl/users", admin, {"user": "alice"}).json()["api_key"]
        assert call(proxy, "GET", "/rl/sessions", new_key).json()["sessions"] == []
        assert call(proxy, "GET", "/rl/sessions/late", new_key).status_code == 404
        client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=new_key, max_retries=0, timeout=120)
        answer = client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert answer.system_fingerprint == "policy-v0" and fake.requests[-1].get("lora_path") is None
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=f"tiny@{served['alice']}", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
        train_sessions(proxy, new_key, "fresh start", 2)
        wait_until(lambda: (lanes().get("alice") or {}).get("serving_version") is not None,
                   "the new alice's first adapter", 300, proxy=proxy)
        assert lanes()["alice"]["serving_version"] > max([*hers, served["bob"]])
    finally:
        proxy.stop()
        fake.stop()

    # After the server stopped (its log flushed): no file under the state dir holds alice's text.
    found = files_holding(state, [secrets["alice"].encode(), late.encode(), secrets["bob"].encode()])
    assert set(found) == {secrets["bob"]}, found
    assert DB_FILENAME in found[secrets["bob"]]
