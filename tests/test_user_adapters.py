"""Per-user adapters through `clawbridge up` (tiny model, LoRA, local torch engine) and the real
`openai` SDK: two users with opposite rewards train their own adapters over one base.

- alice is rewarded for answer tokens with the letter "e" (the tiny demo's reward), bob for
  tokens without it. After training each user's sampled answers moved toward their own reward
  (two seeds of three at least, as the promotion test asks: the tiny model at lr 0.03 sometimes
  stalls), and the shared key's greedy answers are the base model's, token for token.
- Every step trained one user's turns only, into that user's lane; each user's calls were
  answered by their own lane's versions once it had one.
- A user's key cannot read, reward or end the other's sessions, nor call the other's version
  (`tiny@N`): 404, as for something that does not exist.
- Forgetting bob deletes his adapter's checkpoints, versions and steps; alice's stay and serve.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

pytest.importorskip("torch")
pytest.importorskip("clawbridge_local")

from clawbridge.devtools.demo import PROMPTS, run_episodes, token_reward
from clawbridge.devtools.tinymodel import build_tiny_model
from clawbridge.store import DB_FILENAME
from tests.kill_support import fault_env, kill_at_marker, wait_until
from tests.support import ProxyProcess

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
SESSIONS = 200
"""Sessions per user."""
SEEDS = (0, 1, 2)
MARGIN = 0.15
"""How far a user's mean reward must move from their first fifth of sessions to their last."""


def env() -> dict[str, str]:
    return {"CLAWBRIDGE_LORA_RANK": "8", "CLAWBRIDGE_LEARNING_RATE": "0.03", "CLAWBRIDGE_BATCH_SIZE": "8",
            "CLAWBRIDGE_DEFAULT_MAX_TOKENS": str(MAX_TOKENS), "CLAWBRIDGE_TRAINER_POLL_INTERVAL_S": "0.2",
            "CLAWBRIDGE_BASELINE": "group_mean", "CLAWBRIDGE_MAX_OFF_POLICY_STEPS": "4",
            "CLAWBRIDGE_PROMOTION_MODE": "off", "CLAWBRIDGE_PER_USER_ADAPTERS": "true"}


def call(proxy: ProxyProcess, method: str, path: str, key: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(method, proxy.base + path, json=body, headers={"Authorization": f"Bearer {key}"},
                         timeout=60.0)


@dataclass(frozen=True)
class Episode:
    user: str
    index: int
    share: float
    """Share of answer tokens with the letter e."""
    version: int
    session_id: str


def episode(proxy: ProxyProcess, user: str, key: str, index: int, seed: int) -> Episode:
    """One session of `user`: a demo prompt (groups of 8 per task), rewarded by the user's taste."""
    task = index // 8
    started = call(proxy, "POST", "/rl/start_session", key, {"task_id": f"{user}-task-{task}"})
    started.raise_for_status()
    session_key, session_id = started.json()["api_key"], started.json()["session_id"]
    client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=session_key, max_retries=3, timeout=120)
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[task % len(PROMPTS)]}], max_tokens=MAX_TOKENS,
        temperature=1.0, logprobs=True, seed=seed * 100_003 + index * 2 + (user == "bob"))
    choice = resp.choices[0]
    share = token_reward([c.token for c in (choice.logprobs.content or [])] if choice.logprobs else [])
    reward = share if user == "alice" else 1.0 - share
    call(proxy, "POST", "/rl/set_reward", session_key, {"reward": reward}).raise_for_status()
    call(proxy, "POST", "/rl/end_session", session_key, {}).raise_for_status()
    version = int((resp.system_fingerprint or "policy-v0").removeprefix("policy-v"))
    return Episode(user, index, share, version, session_id)


def greedy(proxy: ProxyProcess, key: str) -> list[str]:
    client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=key, max_retries=2, timeout=120)
    return [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                           max_tokens=MAX_TOKENS, temperature=0).choices[0].message.content or ""
            for p in PROMPTS]


def rows(state: Path, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
    conn = sqlite3.connect(f"file:{state / DB_FILENAME}?mode=ro", uri=True, timeout=30)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def status(proxy: ProxyProcess) -> dict[str, Any]:
    r = call(proxy, "GET", "/rl/status", proxy.admin_key)
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_trained(proxy: ProxyProcess, timeout_s: float = 600.0) -> dict[str, Any]:
    """Until no ready turn waits in any lane and no step runs, three looks in a row."""
    seen: list[Any] = []

    def idle() -> bool:
        st = status(proxy)
        lanes = st["lanes"] or {}
        quiet = (st["trainer"]["waiting"]["ready_datums"] == 0 and not st["trainer"]["in_step"]
                 and not any(lane["in_step"] for lane in lanes.values()))
        seen.append((st["trainer"]["steps"]["ok"],) if quiet else None)
        if len(seen) >= 3 and seen[-1] is not None and seen[-1] == seen[-2] == seen[-3]:
            return True
        time.sleep(0.5)
        return False

    wait_until(idle, "every lane to finish training", timeout_s, proxy=proxy)
    return status(proxy)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@dataclass
class Run:
    seed: int
    proxy: ProxyProcess
    keys: dict[str, str]
    episodes: list[Episode]
    base_greedy: list[str]
    final: dict[str, Any]

    def head_tail(self, user: str) -> tuple[float, float]:
        eps = sorted((e for e in self.episodes if e.user == user), key=lambda e: e.index)
        fifth = len(eps) // 5
        return mean([e.share for e in eps[:fifth]]), mean([e.share for e in eps[-fifth:]])

    def learned(self) -> bool:
        a0, a1 = self.head_tail("alice")
        b0, b1 = self.head_tail("bob")
        return a1 - a0 >= MARGIN and b0 - b1 >= MARGIN


def train(root: Path, seed: int) -> Run:
    model = build_tiny_model(root / f"tiny-{seed}", seed=seed)
    proxy = ProxyProcess(model, root / f"state-{seed}", env=env(), extra_args=("--served-model-name", "tiny")).start(300)
    try:
        keys = {u: call(proxy, "POST", "/rl/users", proxy.admin_key, {"user": u}).json()["api_key"]
                for u in ("alice", "bob")}
        base_greedy = greedy(proxy, proxy.key())
        episodes: list[Episode] = []

        def one(i: int) -> Episode:
            user = ("alice", "bob")[i % 2]
            return episode(proxy, user, keys[user], i // 2, seed)

        run_episodes(one, 2 * SESSIONS, 8, episodes)
        final = wait_trained(proxy)
    except BaseException:
        proxy.stop()
        raise
    return Run(seed, proxy, keys, episodes, base_greedy, final)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("user-adapters")
    out: list[Run] = []
    try:
        for seed in SEEDS:
            out.append(train(root, seed))
            if seed != SEEDS[0]:
                out[-1].proxy.stop()  # the first run's server stays up for the isolation checks
        yield out
    finally:
        for r in out:
            r.proxy.stop()


def test_each_user_learns_their_own_reward_and_the_shared_policy_does_not_move(runs: list[Run]) -> None:
    report = {r.seed: (r.head_tail("alice"), r.head_tail("bob")) for r in runs}
    print("e-share, first fifth -> last fifth of each user's sessions, per seed:",
          {s: {"alice": f"{a0:.3f} -> {a1:.3f}", "bob": f"{b0:.3f} -> {b1:.3f}"} for s, ((a0, a1), (b0, b1)) in report.items()})
    assert sum(r.learned() for r in runs) >= 2, report
    for r in runs:
        lanes = r.final["lanes"]
        assert set(lanes) == {"alice", "bob"}, lanes
        for user in ("alice", "bob"):
            assert lanes[user]["steps"]["ok"] >= 5 and lanes[user]["pending_turns"] == 0, (user, lanes)
            assert lanes[user]["serving_version"] is not None, lanes
        # The shared lane trained nothing (every call had a user) and still serves the base.
        assert r.final["policy_version"] == 0, r.final["policy_version"]
        assert rows(r.proxy.state_dir, "SELECT COUNT(*) FROM steps WHERE lane=''")[0][0] == 0


def test_steps_never_mix_users_and_calls_get_their_own_version(runs: list[Run]) -> None:
    for r in runs:
        state = r.proxy.state_dir
        mixed = rows(state, "SELECT st.step, st.lane, COUNT(DISTINCT COALESCE(s.user_id, '')) AS users, "
                            "MIN(COALESCE(s.user_id, '')) AS who FROM steps st JOIN samples sa ON sa.consumed_step = st.step "
                            "JOIN sessions s ON s.session_id = sa.session_id GROUP BY st.step")
        assert mixed and all(m["users"] == 1 and m["who"] == m["lane"] for m in mixed), [dict(m) for m in mixed]
        lane_of = {int(v["version"]): str(v["lane"]) for v in rows(state, "SELECT version, lane FROM policy_versions")}
        for e in r.episodes:
            assert e.version == 0 or lane_of.get(e.version) == e.user, (e, lane_of.get(e.version))
        for user in ("alice", "bob"):
            answered = {e.version for e in r.episodes if e.user == user}
            assert len(answered - {0}) >= 3, (user, answered)  # their own versions answered them as they trained


def test_a_user_cannot_reach_the_other_users_sessions_or_version(runs: list[Run]) -> None:
    r = runs[0]
    alice, bob = r.keys["alice"], r.keys["bob"]
    bob_session = next(e.session_id for e in r.episodes if e.user == "bob")
    assert call(r.proxy, "GET", f"/rl/sessions/{bob_session}", alice).status_code == 404
    assert call(r.proxy, "POST", "/rl/set_session_reward", alice,
                {"session_id": bob_session, "reward": 1.0}).status_code == 404
    assert call(r.proxy, "POST", "/rl/end_session", alice, {"session_id": bob_session}).status_code == 404
    assert call(r.proxy, "GET", f"/rl/sessions/{bob_session}", bob).status_code == 200
    bob_version = r.final["lanes"]["bob"]["serving_version"]
    messages = [{"role": "user", "content": PROMPTS[0]}]
    as_alice = openai.OpenAI(base_url=r.proxy.base + "/v1", api_key=alice, max_retries=0)
    with pytest.raises(openai.NotFoundError) as refused:
        as_alice.chat.completions.create(model=f"tiny@{bob_version}", messages=messages, max_tokens=2)
    assert "does not exist" in str(refused.value)
    shared = openai.OpenAI(base_url=r.proxy.base + "/v1", api_key=r.proxy.key(), max_retries=0)
    with pytest.raises(openai.NotFoundError):
        shared.chat.completions.create(model=f"tiny@{bob_version}", messages=messages, max_tokens=2)
    as_bob = openai.OpenAI(base_url=r.proxy.base + "/v1", api_key=bob, max_retries=0)
    pinned = as_bob.chat.completions.create(model=f"tiny@{bob_version}", messages=messages, max_tokens=2)
    assert pinned.system_fingerprint == f"policy-v{bob_version}"
    plain = as_bob.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert plain.system_fingerprint == f"policy-v{bob_version}"
    # The shared key's greedy answers are still the base model's, token for token.
    assert greedy(r.proxy, r.proxy.key()) == r.base_greedy


def test_forgetting_a_user_deletes_their_adapter(runs: list[Run]) -> None:
    r = runs[0]
    state = r.proxy.state_dir
    bob_dir = state / "checkpoints" / "local" / "users" / "bob"
    assert any(bob_dir.iterdir())
    alice_version = r.final["lanes"]["alice"]["serving_version"]
    forgot = call(r.proxy, "POST", "/rl/users/bob/forget", r.proxy.admin_key)
    assert forgot.status_code == 200, forgot.text
    deleted = forgot.json()["deleted"]
    assert deleted["adapter_checkpoints"] >= 1 and deleted["adapter_versions"] >= 2 and deleted["steps"] >= 5, deleted
    assert not bob_dir.exists() and not (state / "trainer" / "local" / "users" / "bob").exists()
    assert rows(state, "SELECT COUNT(*) FROM policy_versions WHERE lane='bob'")[0][0] == 0
    assert rows(state, "SELECT COUNT(*) FROM steps WHERE lane='bob'")[0][0] == 0
    assert "bob" not in status(r.proxy)["lanes"]
    assert call(r.proxy, "GET", "/rl/sessions", r.keys["bob"]).status_code == 401
    as_alice = openai.OpenAI(base_url=r.proxy.base + "/v1", api_key=r.keys["alice"], max_retries=0)
    after = as_alice.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}],
                                             max_tokens=2)
    assert after.system_fingerprint == f"policy-v{alice_version}"


def test_eight_users_with_four_agents_each_at_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    """32 agents (8 users x 4) at once, 3 two-turn sessions each: every call answered (no 5xx, no
    retry), every user's turns trained in their own lane, no step mixing users; with only 2 users'
    adapters kept loaded, each user's call still gets their own version (reloaded from its checkpoint)."""
    proxy = ProxyProcess(tiny_model_dir, tmp_path / "state",
                         env={**env(), "CLAWBRIDGE_BASELINE": "none", "CLAWBRIDGE_MAX_USER_ADAPTERS": "2"},
                         extra_args=("--served-model-name", "tiny")).start(300)
    try:
        users = [f"user{i}" for i in range(8)]
        keys = {u: call(proxy, "POST", "/rl/users", proxy.admin_key, {"user": u}).json()["api_key"] for u in users}

        def agent(i: int) -> int:
            user, n = users[i % 8], i // 8
            client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=keys[user], max_retries=0, timeout=120)
            calls = 0
            for s in range(3):
                sid = f"agent{n}-s{s}"
                history: list[Any] = [{"role": "user", "content": PROMPTS[(i + s) % len(PROMPTS)]}]
                for _ in range(2):
                    r = client.chat.completions.create(model="tiny", messages=history, max_tokens=MAX_TOKENS,
                                                       extra_headers={"X-Session-Id": sid})
                    history += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                                {"role": "user", "content": "And then?"}]
                    calls += 1
                call(proxy, "POST", "/rl/set_session_reward", keys[user],
                     {"session_id": sid, "reward": float(s % 2)}).raise_for_status()
                call(proxy, "POST", "/rl/end_session", keys[user], {"session_id": sid}).raise_for_status()
            return calls

        answered: list[int] = []
        run_episodes(agent, 32, 32, answered)
        assert sum(answered) == 32 * 3 * 2
        final = wait_trained(proxy)
        lanes = final["lanes"]
        assert sorted(lanes) == users, lanes
        assert all(lane["steps"]["ok"] >= 1 and lane["pending_turns"] == 0 and lane["steps"]["failed"] == 0
                   for lane in lanes.values()), lanes
        state = proxy.state_dir
        untrained = rows(state, "SELECT s.user_id, COUNT(*) FROM samples sa JOIN sessions s ON s.session_id = "
                                "sa.session_id WHERE sa.consumed_step IS NULL GROUP BY 1")
        assert not untrained, [tuple(r) for r in untrained]
        per_user = rows(state, "SELECT s.user_id, COUNT(*) FROM samples sa JOIN sessions s ON s.session_id = "
                               "sa.session_id GROUP BY 1")
        assert {r[0]: r[1] for r in per_user} == dict.fromkeys(users, 4 * 3 * 2)
        mixed = rows(state, "SELECT st.step FROM steps st JOIN samples sa ON sa.consumed_step = st.step JOIN sessions "
                            "s ON s.session_id = sa.session_id GROUP BY st.step HAVING COUNT(DISTINCT s.user_id) > 1 "
                            "OR MIN(s.user_id) != st.lane")
        assert not mixed
        for user in users:
            client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=keys[user], max_retries=0, timeout=120)
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert r.system_fingerprint == f"policy-v{lanes[user]['serving_version']}", (user, r.system_fingerprint)
    finally:
        proxy.stop()


def test_a_lane_killed_mid_step_recovers_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`kill -9` after bob's lane published a step it had not committed: at the restart that step
    is failed and its version abandoned in bob's lane only, bob's turns train again onto weights
    that never saw them, and alice's committed adapter serves as before."""
    state = tmp_path / "state"
    start_env = {**env(), "CLAWBRIDGE_BASELINE": "none"}
    proxy = ProxyProcess(tiny_model_dir, state, env={**start_env, **fault_env(state, "step.published", 2)},
                         extra_args=("--served-model-name", "tiny")).start(300)
    try:
        keys = {u: call(proxy, "POST", "/rl/users", proxy.admin_key, {"user": u}).json()["api_key"]
                for u in ("alice", "bob")}
        for user in ("alice", "bob"):  # 8 sessions each: one step per lane, alice's first
            for i in range(8):
                episode(proxy, user, keys[user], i, 0)
            if user == "alice":
                wait_until(lambda: (status(proxy)["lanes"] or {}).get("alice", {}).get("serving_version") is not None,
                           "alice's first step", 300, proxy=proxy)
                alice_version = status(proxy)["lanes"]["alice"]["serving_version"]
        kill_at_marker(proxy, "step.published")
    finally:
        proxy.stop()
    killed = [dict(r) for r in rows(state, "SELECT step, lane, status FROM steps")]
    assert killed == [{"step": 1, "lane": "alice", "status": "ok"}, {"step": 2, "lane": "bob", "status": "running"}]
    reserved = [int(r[0]) for r in rows(state, "SELECT version FROM policy_versions WHERE lane='bob' AND status='reserved'")]
    assert len(reserved) == 1
    proxy = ProxyProcess(tiny_model_dir, state, env=start_env, extra_args=("--served-model-name", "tiny")).start(300)
    try:
        final = wait_trained(proxy)
        lanes = final["lanes"]
        assert lanes["alice"]["serving_version"] == alice_version and lanes["alice"]["steps"]["ok"] == 1
        assert lanes["bob"]["steps"] == {"ok": 1, "failed": 1} and lanes["bob"]["serving_version"] not in (None, *reserved)
        steps = [dict(r) for r in rows(state, "SELECT step, lane, status, error FROM steps ORDER BY step")]
        assert steps[1]["status"] == "failed" and "interrupted" in steps[1]["error"] and steps[2]["lane"] == "bob", steps
        assert rows(state, "SELECT status FROM policy_versions WHERE version=?", (reserved[0],))[0][0] == "abandoned"
        consumed = rows(state, "SELECT s.user_id, sa.consumed_step FROM samples sa JOIN sessions s "
                               "ON s.session_id = sa.session_id")
        assert sorted((r[0], r[1]) for r in consumed) == [("alice", 1)] * 8 + [("bob", steps[2]["step"])] * 8
        bob = openai.OpenAI(base_url=proxy.base + "/v1", api_key=keys["bob"], max_retries=0)
        answer = bob.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                             max_tokens=2)
        assert answer.system_fingerprint == f"policy-v{lanes['bob']['serving_version']}"
    finally:
        proxy.stop()


def test_more_users_than_loaded_adapters_each_answered_by_their_own(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Six users, each with a trained adapter, with two users' adapters loaded at once (and one lane
    trainer in memory): greedy calls of all six, at random and six at a time, each answered by the
    caller's own newest version, token for token what that version's adapter answers loaded alone
    (its checkpoint in a fresh engine, one request at a time). Keys and values in float32, so a
    batched row's logits equal its unbatched ones to 1e-4 and greedy tokens can differ only at an
    exact tie."""
    import asyncio
    import random

    import torch
    from clawbridge_local.engine import TorchEngine
    from clawbridge_local.lora_serving import LoraAdapter
    from safetensors.torch import load_file

    from clawbridge.serving.sampler import SamplingParams
    from clawbridge.store.codec import decode_ids

    users = [f"u{i}" for i in range(6)]
    proxy = ProxyProcess(tiny_model_dir, tmp_path / "state", extra_args=("--served-model-name", "tiny"),
                         env={**env(), "CLAWBRIDGE_BASELINE": "none", "CLAWBRIDGE_BATCH_SIZE": "1",
                              "CLAWBRIDGE_LEARNING_RATE": "0.05", "CLAWBRIDGE_LORA_ALPHA": "16",
                              "CLAWBRIDGE_MAX_USER_ADAPTERS": "2",
                              "CLAWBRIDGE_LOCAL_MAX_LOADED_VERSIONS": "1", "CLAWBRIDGE_LOCAL_MAX_LANE_TRAINERS": "1",
                              "CLAWBRIDGE_LOCAL_KV_DTYPE": "float32"}).start(300)
    try:
        keys = {u: call(proxy, "POST", "/rl/users", proxy.admin_key, {"user": u}).json()["api_key"] for u in users}
        for i, user in enumerate(users):
            episode(proxy, user, keys[user], i, seed=i)
        lanes = wait_trained(proxy)["lanes"]
        assert sorted(lanes) == users and all(lane["serving_version"] for lane in lanes.values()), lanes
        rng = random.Random(0)
        plan = [(rng.choice(users), rng.randrange(len(PROMPTS))) for _ in range(36)]

        def one(i: int) -> tuple[str, str]:
            user, p = plan[i]
            client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=keys[user], max_retries=0, timeout=120)
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[p]}],
                                               max_tokens=MAX_TOKENS, temperature=0)
            return user, r.id.replace("chatcmpl-", "turn_")

        answered: list[tuple[str, str]] = []
        run_episodes(one, len(plan), 6, answered)
        loaded = status(proxy)
    finally:
        proxy.stop()
    state = proxy.state_dir
    checkpoint = {int(r[0]): (str(r[1]), str(r[2])) for r in rows(
        state, "SELECT version, lane, checkpoint FROM policy_versions WHERE status='committed' AND lane != ''")}
    turns = {str(r["turn_id"]): r for r in rows(
        state, "SELECT turn_id, prompt_token_ids, completion_token_ids, policy_version FROM turns")}
    assert loaded["engine"]["kv_dtype"] == "fp32"
    engine = TorchEngine.load(str(tiny_model_dir), device="cpu", dtype="float32", progress=False,
                              kv_dtype=torch.float32)
    alone: dict[int, Any] = {}

    async def reference(version: int, prompt: list[int], n: int) -> list[int]:
        if version not in alone:
            ckpt = Path(checkpoint[version][1])
            adapter = LoraAdapter.from_peft(load_file(str(ckpt / "model.safetensors")), 16.0 / 8, str(ckpt))
            alone[version] = await engine.load_version(adapter, version)
        stream = await alone[version].sample(prompt, SamplingParams(max_tokens=n, temperature=0.0))
        return [t.token_id async for t in stream]

    async def check() -> list[tuple[str, int]]:
        wrong = []
        for user, turn_id in answered:
            turn = turns[turn_id]
            version = int(turn["policy_version"])
            assert checkpoint[version][0] == user and version == lanes[user]["serving_version"], (user, version)
            got = decode_ids(turn["completion_token_ids"])
            if await reference(version, decode_ids(turn["prompt_token_ids"]), len(got)) != got:
                wrong.append((user, version))
        return wrong

    try:
        wrong = asyncio.run(check())
    finally:
        engine.shutdown()
    assert not wrong, wrong
    assert len({v for v, _ in checkpoint.values()}) == len(users)
    assert len({turns[t]["policy_version"] for _, t in answered}) == len(users)  # all six were called
