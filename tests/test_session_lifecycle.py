"""Ending a session means the same thing on every path (`clawbridge.runtime.lifecycle`): `/rl/end_session`,
the dashboard's end action, Claw-R1's complete_trajectory, `clawbridge sessions end` and the idle
reaper all end it and give a session the client manages (a session key's, a trajectory's) that
ended with no reward `default_reward_value` on its last turn; the refresh of a session key too.

Against the real app, the real openai SDK and a real SQLite file; the CLI as a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clawbridge.chat.render import Renderer
from clawbridge.runtime.clock import FakeClock
from tests.fake_proxy import SwitchableSampler, script_for, start_fake_proxy
from tests.support import InProcessProxy, wait_for

MSG: Any = [{"role": "user", "content": "hi"}]
DEFAULT = -0.25
IDLE_S = 600.0


@pytest.fixture(scope="module")
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, clock: FakeClock, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessProxy]:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    p = start_fake_proxy(tiny_model_dir, tmp_path_factory.mktemp("lifecycle"),
                         SwitchableSampler(script=script_for(renderer, "ok")), clock,
                         default_reward_value=DEFAULT, session_idle_timeout_s=IDLE_S)
    yield p
    p.stop()


def admin(proxy: InProcessProxy, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    r = httpx.post(proxy.base + path, json=body or {}, headers={"Authorization": f"Bearer {proxy.state.keys.admin}"})
    assert r.status_code == 200, r.text
    return r


def keyed_session_with_a_turn(proxy: InProcessProxy, key: str) -> str:
    sid = str(admin(proxy, "/rl/start_session", {"api_key": key}).json()["session_id"])
    openai.OpenAI(base_url=proxy.base + "/v1", api_key=key, max_retries=0).chat.completions.create(
        model="tiny", messages=MSG)
    return sid


def rewards_of(proxy: InProcessProxy, sid: str) -> list[tuple[float, str, str | None]]:
    view = proxy.state.store.session_view(sid)
    assert view is not None
    return [(r["value"], r["source"], r["turn_id"]) for r in view["rewards"]]


def last_turn(proxy: InProcessProxy, sid: str) -> str:
    view = proxy.state.store.session_view(sid)
    assert view is not None and view["turns"]
    return str(view["turns"][-1]["turn_id"])


def end_by_rl(proxy: InProcessProxy, sid: str) -> None:
    assert admin(proxy, "/rl/end_session", {"session_id": sid}).json()["ended"] is True


def end_by_dashboard(proxy: InProcessProxy, sid: str) -> None:
    assert admin(proxy, f"/dashboard/api/sessions/{sid}/end").json()["ended"] is True


def end_by_cli(proxy: InProcessProxy, sid: str) -> None:
    """The CLI reads the same settings as the server (here from the environment)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(proxy.settings.state_dir), "PYTHONPATH": ":".join(sys.path),
           "CLAWBRIDGE_DEFAULT_REWARD_VALUE": str(DEFAULT)}
    out = subprocess.run([sys.executable, "-m", "clawbridge.cli.main", "sessions", "end", sid, "--state-dir",
                          str(proxy.settings.state_dir)], capture_output=True, text=True, timeout=120, env=env,
                         check=False)
    assert out.returncode == 0 and f"ended session {sid}" in out.stdout, out.stdout + out.stderr


def end_by_reaper(proxy: InProcessProxy, sid: str) -> None:
    clock = proxy.clock
    assert isinstance(clock, FakeClock)
    wait_for(lambda: clock.waiting >= 1, what="the idle reaper never slept on the clock")
    clock.advance(IDLE_S + 60.0)

    def ended() -> bool:
        row = proxy.state.store.get_session(sid)
        return row is not None and row.status == "ended"

    wait_for(ended, what=f"the reaper never ended {sid}")


@pytest.mark.parametrize("end", [end_by_rl, end_by_dashboard, end_by_cli, end_by_reaper],
                         ids=["rl", "dashboard", "cli", "reaper"])
def test_every_path_gives_an_unrewarded_keyed_session_the_default_reward(
        proxy: InProcessProxy, end: Callable[[InProcessProxy, str], None]) -> None:
    sid = keyed_session_with_a_turn(proxy, f"sk-sess-lifecycle-{end.__name__}")
    rewarded = keyed_session_with_a_turn(proxy, f"sk-sess-rewarded-{end.__name__}")
    admin(proxy, "/rl/set_reward", {"session_id": rewarded, "reward": 1.0})
    end(proxy, sid)
    if end is not end_by_reaper:  # the reaper ended both at once
        end(proxy, rewarded)
    # Committed with the end itself: there the moment the session reads as ended.
    assert rewards_of(proxy, sid) == [(DEFAULT, "default", last_turn(proxy, sid))]
    assert [source for _, source, _ in rewards_of(proxy, rewarded)] == ["api"], "a rewarded session keeps its own"
    # Ending it again (any path) adds nothing.
    r = httpx.post(proxy.base + "/rl/end_session", json={"session_id": sid},
                   headers={"Authorization": f"Bearer {proxy.state.keys.admin}"})
    assert r.json()["ended"] is False and len(rewards_of(proxy, sid)) == 1


def test_complete_trajectory_without_a_reward_gives_the_default(proxy: InProcessProxy) -> None:
    traj, prompt = "traj-lifecycle", "p1"
    admin(proxy, f"/{traj}/{prompt}/v1/register_trajectory", {})
    openai.OpenAI(base_url=f"{proxy.base}/{traj}/{prompt}/v1", api_key=proxy.state.keys.client,
                  max_retries=0).chat.completions.create(model="tiny", messages=MSG)
    assert admin(proxy, f"/{traj}/{prompt}/v1/complete_trajectory", {}).json()["ended"] is True
    assert rewards_of(proxy, traj) == [(DEFAULT, "default", last_turn(proxy, traj))]

    # With a reward, that reward is the only one.
    admin(proxy, f"/{traj}-2/{prompt}/v1/register_trajectory", {})
    openai.OpenAI(base_url=f"{proxy.base}/{traj}-2/{prompt}/v1", api_key=proxy.state.keys.client,
                  max_retries=0).chat.completions.create(model="tiny", messages=MSG)
    admin(proxy, f"/{traj}-2/{prompt}/v1/complete_trajectory", {"reward": 0.5})
    assert rewards_of(proxy, f"{traj}-2") == [(0.5, "api", None)]


def test_an_implicit_session_never_gets_the_default(proxy: InProcessProxy) -> None:
    """X-Session-Id sessions (OpenClaw) are rewarded by the judge or explicitly; ending one adds nothing."""
    openai.OpenAI(base_url=proxy.base + "/v1", api_key=proxy.state.keys.client, max_retries=0).chat.completions.create(
        model="tiny", messages=MSG, extra_headers={"X-Session-Id": "lifecycle-header"})
    end_by_dashboard(proxy, "lifecycle-header")
    assert rewards_of(proxy, "lifecycle-header") == []
