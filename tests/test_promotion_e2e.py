"""Promotion through `clawbridge up` (tiny model, LoRA, local torch engine) and the real `openai` SDK.

- A poisoned run: the tiny demo's reward pays for tokens with the letter "e"; the eval set expects
  the base model's own greedy answers. With `promotion_mode = eval` the answers the agent gets to
  the eval prompts never change and every candidate's rejection is recorded; with `off` they change.
- Agreeing runs (the eval set asks for an "e" in each answer) learn the reward with most versions
  promoted (two seeds of three at least: the tiny model at lr 0.03 stalls when given too few steps).
- `kill -9` between a candidate's evaluation and its decision, and between the decision and the
  trainer's reload: after a restart exactly the last promoted version serves, and the candidate is
  decided once.
- The admin API: `clawbridge promote N` / `rollback N` while serving, `clawbridge eval`, the
  dashboard's CSRF-checked button, bad input.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("torch")
pytest.importorskip("clawbridge_local")

from clawbridge.devtools.tinymodel import build_tiny_model
from tests.kill_support import fault_env, kill_at_marker, wait_until
from tests.promotion_support import (
    DecisionRow,
    PromotionView,
    base_answers_set,
    contains_e_set,
    env,
    run_sessions,
    served_answers,
    start,
    status,
    wait_idle,
)

pytestmark = pytest.mark.slow

SEEDS = (0, 1)
AGREEING_SESSIONS = 400  # see the agreeing test's docstring for why not 240
_BASE: dict[int, tuple[Path, list[str]]] = {}


def base_model(root: Path, seed: int) -> tuple[Path, list[str]]:
    """The tiny model of `seed` and the base version's greedy answers to the demo prompts."""
    if seed not in _BASE:
        model = build_tiny_model(root / f"tiny-{seed}", seed=seed)
        proxy = start(model, root / f"base-{seed}", env("off"))
        try:
            _BASE[seed] = (model, served_answers(proxy))
        finally:
            proxy.stop()
    return _BASE[seed]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("promotion")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clawbridge.cli.main", *args], capture_output=True, text=True,
                          timeout=600)


def health_version(base: str) -> int:
    return int(httpx.get(base + "/health", timeout=30).json()["policy_version"])


@pytest.mark.parametrize("seed", SEEDS)
def test_a_poisoned_run_in_eval_mode_never_changes_what_serves(root: Path, tmp_path: Path, seed: int) -> None:
    model, base = base_model(root, seed)
    state = tmp_path / "state"
    proxy = start(model, state, env("eval", base_answers_set(base, tmp_path / "eval.jsonl")))
    view = PromotionView(state)
    try:
        run_sessions(proxy, 96, seed)
        st = wait_idle(proxy)
        assert served_answers(proxy) == base
        steps = view.step_versions()
        auto = [d for d in view.decisions() if d.source == "eval"]
        assert len(steps) >= 3, steps
        assert sorted(d.version for d in auto) == steps  # every candidate decided, exactly once
        rejected = [d for d in auto if d.verdict == "rejected"]
        print(f"seed {seed} eval: {len(rejected)} of {len(auto)} versions rejected, serving v{view.serving()}, "
              "served answers unchanged")
        assert len(rejected) >= 3, auto
        for d in auto:
            assert d.score is not None and d.incumbent_score is not None
            assert (d.score < d.incumbent_score) == (d.verdict == "rejected"), d  # tolerance 0 for a regex set
            assert "tolerance 0" in d.reason
        assert set(view.rejected_samples()) == {d.version for d in rejected}
        p = st["promotion"]
        assert p["mode"] == "eval" and p["serving_version"] == view.serving() == health_version(proxy.base)
        assert p["candidate_version"] is None and p["tolerance"] == 0
        assert p["decisions"][0]["version"] == max(steps)  # newest first
        assert {"version", "verdict", "score", "incumbent_score", "reason"} <= set(p["decisions"][0])
        words = " ".join(cli("status", "--state-dir", str(state)).stdout.split())
        assert f"promotion: eval on {tmp_path / 'eval.jsonl'} (tolerance 0): serving v{view.serving()}" in words
        assert f"v{rejected[-1].version} rejected (score" in words
        table = cli("eval", "--versions", f"0,{rejected[-1].version}", "--state-dir", str(state))
        assert table.returncode == 0, table.stderr
        text = " ".join(table.stdout.split())
        assert "v0 │ 4/4 │ 1.000" in text and f"v{rejected[-1].version} │" in text
    finally:
        proxy.stop()
    assert proxy.log_path is not None  # the log says it in words
    assert re.search(r"promotion: v\d+ rejected, v\d+ keeps serving and training resumes from it: score",
                     proxy.log_path.read_text())


def test_a_poisoned_run_with_promotion_off_changes_what_serves(root: Path, tmp_path: Path) -> None:
    model, base = base_model(root, 0)
    proxy = start(model, tmp_path / "state", env("off", base_answers_set(base, tmp_path / "eval.jsonl")))
    try:
        run_sessions(proxy, 96, 0)
        st = wait_idle(proxy)
        assert st["trainer"]["steps"]["ok"] >= 3
        after = served_answers(proxy)
        print(f"off: {sum(a != b for a, b in zip(after, base, strict=True))} of {len(base)} served answers changed "
              f"after {st['trainer']['steps']['ok']} steps")
        assert after != base
        assert st["promotion"]["decisions"] == [] and st["promotion"]["serving_version"] == health_version(proxy.base)
    finally:
        proxy.stop()


@dataclass(frozen=True)
class AgreeingRun:
    seed: int
    first: float
    last: float
    decisions: list[DecisionRow]

    @property
    def learned(self) -> bool:
        return self.last - self.first >= 0.3


def agreeing_run(root: Path, tmp_path: Path, seed: int) -> AgreeingRun:
    """One agreeing run of `seed`; asserts what holds whether or not it learned."""
    model, _ = base_model(root, seed)
    state = tmp_path / f"state-{seed}"
    proxy = start(model, state, env("eval", contains_e_set(tmp_path / "eval.jsonl")))
    view = PromotionView(state)
    try:
        episodes = run_sessions(proxy, AGREEING_SESSIONS, seed)
        wait_idle(proxy)
        k = len(episodes) // 5
        run = AgreeingRun(seed, sum(e.reward for e in episodes[:k]) / k, sum(e.reward for e in episodes[-k:]) / k,
                          [d for d in view.decisions() if d.source == "eval"])
        promoted = [d for d in run.decisions if d.verdict == "promoted"]
        print(f"seed {seed}: reward {run.first:.3f} -> {run.last:.3f}; {len(promoted)} of {len(run.decisions)} "
              "versions promoted")
        assert view.serving() == max((d.version for d in promoted), default=0) == health_version(proxy.base)
        if run.learned:
            # With tolerance 0, a step that loses the "e" on one prompt is rejected and training
            # goes on from the serving version. Seeds 0-5 on a quiet box promoted 8/12 to 15/16;
            # with a second test suite running beside them, the trainer took more, smaller steps
            # and seeds 0-2 promoted 11/24 to 14/29. Every run that learned ended promoted.
            assert len(promoted) >= 5 and len(promoted) >= len(run.decisions) / 3, run.decisions
            assert run.decisions[-1].verdict == "promoted", run.decisions
            assert all(("e" in a.lower()) for a in served_answers(proxy))
        return run
    finally:
        proxy.stop()


def test_runs_whose_reward_and_eval_agree_are_promoted_version_after_version(root: Path, tmp_path: Path) -> None:
    """Seeds 0-2, 400 sessions each. The tiny model at lr 0.03 is chaotic: a step can collapse its
    greedy answers into a repeated token, the gate rejects it, the next steps run at a fraction of
    the learning rate (step_backoff) and learning comes in a late burst once several steps in a row
    are promoted. At 240 sessions (about 29 steps) 6 of 12 runs on 2026-12-07 stalled near 0.4
    (CI: 0.394 -> 0.387 and 0.420 -> 0.451) and the test failed 2 of 4 times (with step_backoff off,
    2 of 6 stalled: the backoff slows the burst, it does not cause the stall); at 400 sessions 15 of
    15 learned (seeds 0-5, one set beside a busy core), 0.38-0.44 -> 1.000. Two of three must learn."""
    runs = [agreeing_run(root, tmp_path, seed) for seed in (*SEEDS, 2)]
    assert sum(r.learned for r in runs) >= 2, [(r.seed, round(r.first, 3), round(r.last, 3)) for r in runs]


@pytest.mark.parametrize(("point", "agree"), [("promotion.evaluated", False), ("promotion.decided", False),
                                              ("promotion.decided", True)])
def test_kill_between_evaluation_and_promotion(root: Path, tmp_path: Path, point: str, agree: bool) -> None:
    """One batch trains v1; the server is killed at `point`; the restarted one decides v1 exactly
    once and serves the last promoted version (v0 when v1 is rejected, v1 when it is promoted)."""
    model, base = base_model(root, 0)
    state = tmp_path / "state"
    evals = contains_e_set(tmp_path / "eval.jsonl") if agree else base_answers_set(base, tmp_path / "eval.jsonl")
    settings = env("eval", evals)
    proxy = start(model, state, {**settings, **fault_env(state, point, 1)})
    view = PromotionView(state)
    try:
        run_sessions(proxy, 8, 0)
        kill_at_marker(proxy, point)
    finally:
        proxy.stop()
    before = view.decisions()
    assert [d.version for d in before] == ([1] if point == "promotion.decided" else [])
    proxy = start(model, state, settings)
    try:
        wait_idle(proxy)
        decided = [d for d in view.decisions() if d.version == 1]
        assert len(decided) == 1 and decided[0].verdict == ("promoted" if agree else "rejected"), decided
        expected = 1 if agree else 0
        assert view.serving() == expected == health_version(proxy.base)
        if not agree:
            assert served_answers(proxy) == base
            # the trainer went on from the serving version: a rollback version carries v0's weights
            assert any(kind == "rollback" and src == 0 for _, status_, kind, src in view.versions()
                       if status_ == "committed"), view.versions()
    finally:
        proxy.stop()


def test_promote_and_rollback_while_serving(root: Path, tmp_path: Path) -> None:
    model, base = base_model(root, 0)
    state = tmp_path / "state"
    proxy = start(model, state, env("eval", base_answers_set(base, tmp_path / "eval.jsonl")))
    view = PromotionView(state)
    admin = httpx.Client(base_url=proxy.base, headers={"Authorization": f"Bearer {proxy.admin_key}"}, timeout=120)
    try:
        run_sessions(proxy, 24, 0)
        wait_idle(proxy)
        rejected = [d.version for d in view.decisions() if d.verdict == "rejected"]
        assert rejected and view.serving() == 0
        target = rejected[-1]
        # the admin serves a rejected version anyway (CLI, against the running server)
        done = cli("promote", str(target), "--state-dir", str(state))
        assert done.returncode == 0 and f"v{target} serves now (was v0)" in done.stdout, done.stderr
        assert health_version(proxy.base) == target and served_answers(proxy) != base
        # ... and goes back (the dashboard's button: a login, and the CSRF token on the write)
        c = httpx.Client(base_url=proxy.base, follow_redirects=False, timeout=120)
        assert c.post("/dashboard/login", data={"key": proxy.admin_key}).status_code == 303
        m = re.search(r'<meta name="csrf-token" content="([^"]+)">', c.get("/dashboard").text)
        assert m is not None
        r = c.post("/dashboard/api/promotion/rollback", json={"version": 0})
        assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
        r = c.post("/dashboard/api/promotion/rollback", json={"version": 0}, headers={"X-CSRF-Token": m.group(1)})
        assert r.status_code == 200 and r.json()["serving_version"] == 0, r.text
        assert health_version(proxy.base) == 0 and served_answers(proxy) == base
        overview = c.get("/dashboard/api/overview").json()["promotion"]
        assert overview["lines"][0].startswith("promotion: eval") and overview["evals"]
        assert [d["source"] for d in overview["decisions"][:2]] == ["admin", "admin"]
        # bad input: clear 4xx, nothing changed
        r = admin.post("/rl/promote", json={"version": 999})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        r = admin.post("/rl/promote", json={"version": "x"})
        assert r.status_code == 422, r.text
        bad = json.dumps({"messages": [{"role": "user", "content": "hi"}], "expect": "(oops"})
        r = admin.post("/rl/eval", json={"eval_set": bad + "\n", "versions": [0]})
        assert r.status_code == 400 and "line 1" in r.json()["error"]["message"], r.text
        r = admin.post("/rl/eval", json={"versions": ["newest"]})
        assert r.status_code == 422, r.text
        r = httpx.post(proxy.base + "/rl/promote", json={"version": 0}, timeout=30,
                       headers={"Authorization": f"Bearer {proxy.key()}"})
        assert r.status_code == 403, r.text
        assert health_version(proxy.base) == 0
    finally:
        admin.close()
        proxy.stop()


def test_canary_rolls_back_a_worse_candidate_and_promotes_one_that_is_not(root: Path, tmp_path: Path) -> None:
    """Mode canary: the candidate answers about half of the NEW sessions, each session sticks to one
    version; sessions it answers are rewarded -1 and the incumbent's +1, so the test rolls it back
    (training goes on from v0); the next candidate's sessions are rewarded like the incumbent's and
    it is promoted."""
    model, _ = base_model(root, 0)
    state = tmp_path / "state"
    # A tolerance of 0.5 lets an equal candidate (every session rewarded alike) show "not worse" in
    # about 15 pairs of sessions (the test by betting needs evidence of 1 / (1 - 0.9) = 10).
    proxy = start(model, state, env("canary", CLAWBRIDGE_BASELINE="none", CLAWBRIDGE_CANARY_SHARE="0.5",
                                    CLAWBRIDGE_CANARY_MIN_SESSIONS="4", CLAWBRIDGE_CANARY_MAX_SESSIONS="40",
                                    CLAWBRIDGE_CANARY_CONFIDENCE="0.9", CLAWBRIDGE_PROMOTION_TOLERANCE="0.5",
                                    CLAWBRIDGE_PROMOTION_POLL_INTERVAL_S="0.2", CLAWBRIDGE_BATCH_WAIT_S="0"))
    view = PromotionView(state)
    admin = httpx.Client(base_url=proxy.base, headers={"Authorization": f"Bearer {proxy.admin_key}"}, timeout=120)
    client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=proxy.key(), max_retries=2, timeout=120)

    def session(i: int, reward_of: dict[int, float]) -> int:
        r = admin.post("/rl/start_session", json={})
        assert r.status_code == 200, r.text
        key = r.json()["api_key"]
        versions = set()
        for turn in range(2):  # two calls: a session sticks to the version that answered it first
            out = client.chat.completions.create(model="tiny", max_tokens=6, temperature=1.0, seed=i * 7 + turn,
                                                 messages=[{"role": "user", "content": f"say something {i}"}],
                                                 extra_headers={"Authorization": f"Bearer {key}"})
            versions.add(int((out.system_fingerprint or "").removeprefix("policy-v")))
        assert len(versions) == 1, versions
        (version,) = versions
        h = {"Authorization": f"Bearer {key}"}
        assert httpx.post(proxy.base + "/rl/set_reward", json={"reward": reward_of.get(version, 1.0)}, headers=h,
                          timeout=30).status_code == 200
        assert httpx.post(proxy.base + "/rl/end_session", json={}, headers=h, timeout=30).status_code == 200
        return version

    def until_decided(version: int, reward_of: dict[int, float], start_at: int) -> tuple[int, list[int]]:
        seen: list[int] = []
        for i in range(start_at, start_at + 200):
            seen.append(session(i, reward_of))
            if any(d.version == version for d in view.decisions()):
                return i + 1, seen
        raise AssertionError(f"v{version} was not decided after 200 sessions; seen {seen}")

    try:
        worse = {1: -1.0, 0: 1.0}
        for i in range(4):  # one batch (two turns a session): v1 is trained and becomes the candidate
            session(i, worse)
        wait_until(lambda: any(d.version == 1 for d in view.decisions())
                   or status(proxy)["promotion"]["candidate_version"] == 1, "v1 on canary", proxy=proxy)
        nxt, seen = until_decided(1, worse, 4)
        assert 0 < seen.count(1) < len(seen), seen  # both sides answered new sessions
        (d1,) = [d for d in view.decisions() if d.version == 1]
        assert d1.verdict == "rejected" and d1.source == "canary" and d1.score == 0.0 and d1.incumbent_score == 1.0
        assert "worse" in d1.reason and "canary_max_sessions" not in d1.reason  # the test, not the cap
        wait_until(lambda: status(proxy)["promotion"]["candidate_version"] not in (None, 1), "the next candidate",
                   proxy=proxy)
        assert health_version(proxy.base) == 0
        assert any(kind == "rollback" and src == 0 for _, st, kind, src in view.versions() if st == "committed")
        candidate = status(proxy)["promotion"]["candidate_version"]
        _, seen = until_decided(candidate, {}, nxt)
        (d2,) = [d for d in view.decisions() if d.version == candidate]
        assert d2.verdict == "promoted", d2
        assert view.serving() == candidate == health_version(proxy.base)
        figures = status(proxy)["promotion"]["decisions"][0]["figures"]["canary"]
        assert figures["candidate_sessions"] >= 4 and figures["incumbent_sessions"] >= 4
        assert figures["e_not_worse"] >= figures["threshold"] == pytest.approx(10.0)  # shown, not capped
    finally:
        admin.close()
        proxy.stop()
