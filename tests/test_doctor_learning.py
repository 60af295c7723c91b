"""`clawbridge doctor --learning` against a real `clawbridge up` (the tiny model, the local backend,
real training steps), the real openai SDK as the agent, and the CLI as a user runs it.

One server walks through three states: no session ended (blocked), every reward of a task group
equal (its turns dropped as no_signal: blocked), then a group rewarded differently trains (healthy,
with the no_signal warning). A second server has a judge endpoint that answers 500 (blocked, with
the judge's error). Each state asserts the words, the figure and the exit code.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clawbridge.devtools.judge_server import JudgeServer
from tests.support import ProxyProcess, wait_for
from tests.test_cli import cli

FAST = {"CLAWBRIDGE_BATCH_SIZE": "2", "CLAWBRIDGE_TRAINER_POLL_INTERVAL_S": "0.2", "CLAWBRIDGE_PROMOTION_MODE": "off",
        "CLAWBRIDGE_BATCH_WAIT_S": "0"}


def doctor(proxy: ProxyProcess) -> tuple[int, str]:
    out = cli("doctor", "--learning", "--state-dir", str(proxy.state_dir), check=False)
    assert out.stderr.strip() == "" or "Traceback" not in out.stderr, out.stderr
    return out.returncode, " ".join(out.stdout.split())  # one line: the console may wrap


def chat(proxy: ProxyProcess, key: str, text: str, **headers: str) -> str:
    client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=key, max_retries=0)
    r = client.chat.completions.create(model="default", max_tokens=6, messages=[{"role": "user", "content": text}],
                                       extra_headers=headers)
    return r.choices[0].message.content or ""


def admin(proxy: ProxyProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(proxy.base + path, json=body, headers={"Authorization": f"Bearer {proxy.admin_key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def rewarded_group(proxy: ProxyProcess, task: str, rewards: tuple[float, ...]) -> None:
    """One session per reward, all of task `task`: a call, the reward, the end."""
    for value in rewards:
        started = admin(proxy, "/rl/start_session", {"task_id": task})
        chat(proxy, started["api_key"], f"{task}: name a colour")
        admin(proxy, "/rl/set_reward", {"reward": value, "session_id": started["session_id"]})
        admin(proxy, "/rl/end_session", {"session_id": started["session_id"]})


def samples(proxy: ProxyProcess) -> dict[str, Any]:
    r = httpx.get(proxy.base + "/rl/status", headers={"Authorization": f"Bearer {proxy.admin_key}"}, timeout=60)
    return dict(r.json()["trainer"]["samples"])


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    p = ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("learning-state"), env=FAST).start()
    yield p
    p.stop()


def test_no_session_ended_then_zero_advantage_then_healthy(proxy: ProxyProcess) -> None:
    # 1. an agent that never ends its sessions: nothing can train
    chat(proxy, proxy.key(), "hello", **{"X-Session-Id": "never-ends"})
    rc, out = doctor(proxy)
    assert rc == 1, out
    assert "learning is blocked; what does not hold: sessions end" in out
    assert "BLOCKS sessions end: no session has ended: 1 active, holding 1 turn(s)" in out
    assert "a session ends by itself after session_idle_timeout_s = 1800 s" in out
    assert "change: a session's turns train only once it ends: send `X-Session-Done: true`" in out

    # 2. a task group whose two sessions were rewarded alike: zero advantage, dropped as no_signal
    rewarded_group(proxy, "same", (1.0, 1.0))
    wait_for(lambda: samples(proxy)["dropped"].get("no_signal") == 2, 120, "the no_signal drop")
    rc, out = doctor(proxy)
    assert rc == 1, out
    assert "learning is blocked; what does not hold: rewards differ (else every advantage is 0)" in out
    assert "OK sessions end: 2 of 3 session(s) ended (1 active, holding 1 turn(s))" in out
    assert ("BLOCKS rewards differ (else every advantage is 0): 2 of the last 2 turn(s) that left the training "
            "queue were dropped as no_signal: zero advantage (1 of the last 1 task group(s) rewarded alike)") in out
    assert "change: every answer of a task was rewarded alike" in out
    assert "OK ended sessions get rewards or verdicts: 2 reward(s) recorded" in out
    assert "N/A the judge answers, and clearly: no judge (judge = off)" in out

    # 3. a group rewarded differently trains: learning goes on, the old drops are a warning
    rewarded_group(proxy, "mixed", (1.0, 0.0))
    wait_for(lambda: samples(proxy)["consumed"] == 2, 180, "a training step")
    rc, out = doctor(proxy)
    assert rc == 0, out
    assert out.startswith("learning looks healthy, with warnings")
    assert ("WARN rewards differ (else every advantage is 0): 2 of the last 4 turn(s) that left the training queue "
            "were dropped as no_signal: zero advantage (1 of the last 2 task group(s) rewarded alike)") in out
    assert "OK training steps succeed: the last 1 step(s) succeeded; 1 in all" in out
    assert "OK samples are trained, not dropped: of the last 4 turn(s) that left the training queue: 2 no_signal, " \
           "2 trained" in out


def test_a_judge_that_fails_blocks_learning_and_says_its_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    def overloaded(body: dict[str, Any]) -> str:
        raise RuntimeError("the judge model is overloaded")

    with JudgeServer(overloaded) as judge:
        env = {**FAST, "CLAWBRIDGE_JUDGE": "endpoint", "CLAWBRIDGE_JUDGE_BASE_URL": judge.base_url,
               "CLAWBRIDGE_JUDGE_MODEL": "judge", "CLAWBRIDGE_JUDGE_VOTES": "1", "CLAWBRIDGE_JUDGE_RETRIES": "0",
               "CLAWBRIDGE_JUDGE_MAX_ATTEMPTS": "1", "CLAWBRIDGE_JUDGE_POLL_INTERVAL_S": "0.2"}
        proxy = ProxyProcess(tiny_model_dir, tmp_path / "state", env=env).start()
        try:
            # two turns: the first has a next state (the user's reply), so the judge is asked about it
            first = chat(proxy, proxy.key(), "What is 2+2?", **{"X-Session-Id": "judged"})
            client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=proxy.key(), max_retries=0)
            client.chat.completions.create(
                model="default", max_tokens=6, extra_headers={"X-Session-Id": "judged", "X-Session-Done": "true"},
                messages=[{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": first},
                          {"role": "user", "content": "Thanks, that works."}])
            wait_for(lambda: len(judge.requests) >= 1 and "failed on every one" in doctor(proxy)[1], 120,
                     "the judge's failure")
            rc, out = doctor(proxy)
        finally:
            proxy.stop()
    assert rc == 1, out
    assert "what does not hold: ended sessions get rewards or verdicts; the judge answers, and clearly" in out
    assert ("BLOCKS the judge answers, and clearly: the judge failed on every one of the last 1 turn(s) (1 of the "
            "last 1 votes failed; the last error:") in out
    assert "the judge model is overloaded" in out
    assert (f"change: check the judge (judge@{judge.base_url}): judge_base_url, judge_model, judge_api_key, "
            "judge_timeout_s") in out


def test_no_server_and_no_store_say_so(tmp_path: Path) -> None:
    out = cli("doctor", "--learning", "--state-dir", str(tmp_path / "none"), check=False)
    assert out.returncode == 1
    assert f"learning is blocked: no store at {tmp_path / 'none' / 'clawbridge.db'} yet" in " ".join(out.stdout.split())


def test_without_a_judge_there_are_no_notes_to_show(proxy: ProxyProcess) -> None:
    """Without a judge no note is made from talk (a user may still add one): `clawbridge notes` says
    there is none yet and how to add one; status says nothing of notes or of the probe."""
    out = cli("notes", "--state-dir", str(proxy.state_dir), check=False)
    assert out.returncode == 0 and "no notes yet" in out.stdout and "clawbridge notes add TEXT" in out.stdout
    status = cli("status", "--state-dir", str(proxy.state_dir)).stdout
    assert "server: running" in status
    assert "learning from talk" not in status and "still good?" not in status  # promotion off: no probe either
