"""A real proxy that has trained a little, for the dashboard, metrics and export tests.

The real app under uvicorn (`InProcessProxy`), the real store, tokenizer and trainer loop, over
`FakeTrainingBackend` (scripted answers; `publish()` bumps the policy version). Sessions are
driven with the openai SDK and rewarded through `/rl/*`, so the store holds what a short real
run leaves: turns at two policy versions, api rewards, two committed steps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clawbridge.backend import ModelInfo
from clawbridge.chat.render import Renderer
from clawbridge.config import Settings
from clawbridge.serving.sampler import FakeSampler
from clawbridge.trainer import FakeTrainingBackend
from tests.fake_proxy import script_for
from tests.support import InProcessProxy, free_port, wait_for

ANSWER = "The capital of France is Paris."


@dataclass
class TrainedProxy:
    proxy: InProcessProxy
    backend: FakeTrainingBackend
    sessions: list[str]
    """Session ids, oldest first."""
    questions: dict[str, str]
    """session id -> its user message."""

    @property
    def base(self) -> str:
        return self.proxy.base

    @property
    def admin(self) -> str:
        return str(self.proxy.state.keys.admin)

    @property
    def client_key(self) -> str:
        return str(self.proxy.state.keys.client)




def screenshots_dir(factory: pytest.TempPathFactory, name: str) -> Path:
    """Where a browser test keeps its screenshots: `$CLAWBRIDGE_ARTIFACTS_DIR/<name>` when CI sets
    it (kept as artifacts), else a fresh folder under the test's tmp dir."""
    where = os.environ.get("CLAWBRIDGE_ARTIFACTS_DIR")
    path = Path(where) / name if where else factory.mktemp(f"{name}-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_trained_proxy(model_dir: Path, state_dir: Path, **settings: Any) -> TrainedProxy:
    """Two rewarded sessions at v0 -> a step publishes v1 -> two rewarded sessions at v1 -> a step
    publishes v2 (each step awaited, so the store is the same in every run)."""
    renderer = Renderer.from_pretrained(str(model_dir))
    sampler = FakeSampler(script=script_for(renderer, ANSWER))
    values: dict[str, Any] = {"port": free_port(), "state_dir": state_dir, "model": str(model_dir),
                              "served_model_name": "tiny", "batch_size": 2, "baseline": "none",
                              "trainer_poll_interval_s": 0.05}
    values.update(settings)
    info = ModelInfo(name="tiny", tokenizer_path=str(model_dir), context_window=4096, max_output_tokens=256)
    backend = FakeTrainingBackend(sampler, info)
    proxy = InProcessProxy(Settings(**values), backend).start()
    out = TrainedProxy(proxy, backend, [], {})
    try:
        client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=out.client_key, max_retries=0)
        admin = {"Authorization": f"Bearer {out.admin}"}
        for i, reward in enumerate((0.0, 1.0, 0.5, 1.0)):
            sid = f"dash-{i}"
            question = f"Question {i}: what is the capital of France?"
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                           extra_headers={"X-Session-Id": sid})
            r = httpx.post(proxy.base + "/rl/set_reward", json={"reward": reward, "session_id": sid}, headers=admin)
            assert r.status_code == 200, r.text
            r = httpx.post(proxy.base + "/rl/end_session", json={"session_id": sid}, headers=admin)
            assert r.status_code == 200, r.text
            out.sessions.append(sid)
            out.questions[sid] = question
            if i % 2 == 1:  # batch_size 2: each pair of sessions is one step
                steps = (i + 1) // 2
                wait_for(lambda n=steps: len(backend.published) == n, what=f"training step {steps}")
        return out
    except BaseException:
        proxy.stop()
        raise


LONG_NOTE = ("Always cite the file you changed, e.g. ~/projects/clawbridge/clawbridge/dashboard/static/dashboard.js, "
             "and keep answers under thirty words.")
"""A note by hand with a long path in it: a cell that must wrap between words, never inside one."""
CORRECTION = "You didn't use my name. Please call me Sam."


def start_talking_proxy(model_dir: Path, state_dir: Path, judge_url: str) -> TrainedProxy:
    """`start_trained_proxy` with a judge (the rule-based endpoint at `judge_url`), so notes from
    talk are on; then one session corrected by the user (the judge's hint becomes a note of the
    shared key) and a note written by hand for user alice (`LONG_NOTE`)."""
    t = start_trained_proxy(model_dir, state_dir, judge="endpoint", judge_base_url=judge_url,
                            judge_model="rule-based", judge_votes=1, judge_poll_interval_s=0.05)
    try:
        admin = {"Authorization": f"Bearer {t.admin}"}
        client = openai.OpenAI(base_url=t.base + "/v1", api_key=t.client_key, max_retries=0)
        question = {"role": "user", "content": "How do I make tea?"}
        first = client.chat.completions.create(model="tiny", messages=[question],
                                               extra_headers={"X-Session-Id": "talk-0"})
        client.chat.completions.create(
            model="tiny", extra_headers={"X-Session-Id": "talk-0", "X-Session-Done": "true"},
            messages=[question, {"role": "assistant", "content": first.choices[0].message.content or ""},
                      {"role": "user", "content": CORRECTION}])
        wait_for(lambda: httpx.get(t.base + "/rl/notes", headers=admin).json()["notes"], 60, "the note from talk")
        assert httpx.post(t.base + "/rl/users", json={"user": "alice"}, headers=admin).status_code == 200
        r = httpx.post(t.base + "/rl/notes", json={"text": LONG_NOTE, "user": "alice"}, headers=admin)
        assert r.status_code == 200, r.text
        return t
    except BaseException:
        t.proxy.stop()
        raise
