"""Helpers for the kill -9 tests: drive `clawbridge up` (a subprocess) with the real `openai` SDK,
freeze it at a named fault point (`clawbridge.runtime.faults`), SIGKILL it, and read what the store says.

The store is read through a read-only SQLite connection, so it can be read while a server runs.
Every wait is a bounded poll on a condition.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from clawbridge.runtime.faults import FAULT_ENV, HOLD_ENV, MARKER_ENV
from clawbridge.store import DB_FILENAME
from clawbridge.store.codec import decode_floats, decode_ids
from tests.support import ProxyProcess

WAIT_S = 240.0
"""Generous bound for anything a loaded 2-core machine does here (a step, a restart)."""


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = WAIT_S,
               proxy: ProxyProcess | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proxy is not None and proxy.proc is not None and proxy.proc.poll() is not None:
            raise AssertionError(f"the server exited ({proxy.proc.returncode}) while waiting for {what}; "
                                 f"log:\n{_tail(proxy)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}"
                                 + (f"; log:\n{_tail(proxy)}" if proxy is not None else ""))
        time.sleep(0.1)


def _tail(proxy: ProxyProcess) -> str:
    return proxy.log_path.read_text(errors="replace")[-4000:] if proxy.log_path else ""


def fault_env(state: Path, point: str, nth: int) -> dict[str, str]:
    """Arm fault `point` at its `nth` occurrence; the marker file goes in the state dir."""
    return {FAULT_ENV: f"{point}:{nth}", MARKER_ENV: str(marker_path(state)), HOLD_ENV: "300"}


def marker_path(state: Path) -> Path:
    return state / "fault-reached.json"


def kill_at_marker(proxy: ProxyProcess, point: str) -> None:
    """Wait until the server froze at `point`, then SIGKILL it."""
    marker = marker_path(proxy.state_dir)
    wait_until(marker.exists, f"fault point {point}", proxy=proxy)
    assert json.loads(marker.read_text())["name"] == point
    proxy.kill()
    marker.unlink()


class Agent:
    """The user's agent: chat calls through the `openai` SDK, rewards and session ends through /rl."""

    def __init__(self, proxy: ProxyProcess) -> None:
        self.proxy = proxy
        self.client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=proxy.key(), max_retries=0, timeout=120)
        self.admin = httpx.Client(base_url=proxy.base, timeout=60,
                                  headers={"Authorization": f"Bearer {proxy.admin_key}"})

    def call(self, session: str, seed: int, max_tokens: int = 6) -> str:
        """One chat turn in `session`; returns its turn id."""
        r = self.client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": f"say something, {session}"}],
            max_tokens=max_tokens, seed=seed, temperature=1.0, extra_headers={"X-Session-Id": session})
        return r.id.replace("chatcmpl-", "turn_")

    def reward(self, session: str, value: float) -> None:
        r = self.admin.post("/rl/set_reward", json={"reward": value, "session_id": session})
        assert r.status_code == 200, r.text

    def end(self, session: str) -> None:
        r = self.admin.post("/rl/end_session", json={"session_id": session})
        assert r.status_code == 200, r.text

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(self.proxy.base + "/health", timeout=30).json())

    def close(self) -> None:
        self.admin.close()
        self.client.close()


@dataclass(frozen=True)
class Step:
    step: int
    version: int | None
    status: str
    metrics: dict[str, Any]
    checkpoint: str | None


class StoreView:
    """Read-only queries on a state dir's store (safe while a server writes to it)."""

    def __init__(self, state: Path) -> None:
        self.path = state / DB_FILENAME

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30)
        conn.row_factory = sqlite3.Row
        try:
            return conn.execute(sql, args).fetchall()
        finally:
            conn.close()

    def steps(self) -> list[Step]:
        return [Step(int(r["step"]), r["policy_version"], str(r["status"]), json.loads(r["metrics_json"] or "{}"),
                     r["checkpoint"]) for r in self._rows("SELECT * FROM steps ORDER BY step")]

    def ok_steps(self) -> list[Step]:
        return [s for s in self.steps() if s.status == "ok"]

    def versions(self) -> dict[int, tuple[str, str, str | None]]:
        """version -> (status, kind, checkpoint)."""
        return {int(r["version"]): (str(r["status"]), str(r["kind"]), r["checkpoint"])
                for r in self._rows("SELECT * FROM policy_versions ORDER BY version")}

    def committed(self) -> list[int]:
        return [v for v, (status, _, _) in self.versions().items() if status == "committed"]

    def consumed(self) -> dict[str, int | None]:
        """session id -> the step that consumed its sample (None: not yet)."""
        return {str(r["session_id"]): r["consumed_step"]
                for r in self._rows("SELECT session_id, consumed_step FROM samples")}

    def sequences(self, sessions: list[str]) -> list[tuple[int, ...]]:
        """What each session's turns train on: (prompt + completion)[:-1], as model_input."""
        marks = ",".join("?" * len(sessions))
        rows = self._rows(f"SELECT prompt_token_ids, completion_token_ids FROM turns WHERE session_id IN ({marks})",
                          tuple(sessions))
        return [tuple((decode_ids(r[0]) + decode_ids(r[1]))[:-1]) for r in rows]

    def turn(self, turn_id: str) -> dict[str, Any]:
        (r,) = self._rows("SELECT policy_version, completion_logprobs, prompt_token_ids, completion_token_ids "
                          "FROM turns WHERE turn_id=?", (turn_id,))
        return {"policy_version": int(r[0]), "logprobs": decode_floats(r[1]), "prompt": decode_ids(r[2]),
                "completion": decode_ids(r[3])}


def check_exactly_once(view: StoreView, sessions: list[str]) -> None:
    """Every rewarded session's sample was consumed by exactly one ok step, each ok step consumed
    as many samples as it trained (its `datums` metric), and no failed step consumed any."""
    consumed = view.consumed()
    steps = {s.step: s for s in view.steps()}
    assert all(consumed.get(sid) is not None for sid in sessions), consumed
    by_step: dict[int, int] = {}
    for sid in sessions:
        step = consumed[sid]
        assert step is not None and steps[step].status == "ok", (sid, steps.get(step or -1))
        by_step[step] = by_step.get(step, 0) + 1
    for s in steps.values():
        if s.status == "ok":
            assert s.metrics["datums"] == float(by_step.get(s.step, 0)), s
        else:
            assert s.step not in by_step


# ---------------------------------------------------------------------------------- one scenario

REWARDS = {"s0": 1.0, "s1": -1.0, "s2": 0.5, "s3": -0.25, "s4": -0.5, "s5": 1.0}
"""Six one-turn sessions, all sampled at version 0 before any training; trained in pairs
(batch size 2): s0+s1 (step 1), s2+s3 (step 2, the one killed), s4+s5 (step 3)."""
PAIRS = (("s0", "s1"), ("s2", "s3"), ("s4", "s5"))


def sample_all(agent: Agent) -> None:
    for i, sid in enumerate(REWARDS):
        agent.call(sid, seed=i)
    for sid, r in REWARDS.items():
        agent.reward(sid, r)


def end_and_wait(agent: Agent, view: StoreView, sessions: tuple[str, ...], ok_steps: int) -> None:
    for sid in sessions:
        agent.end(sid)
    wait_until(lambda: len(view.ok_steps()) >= ok_steps, f"{ok_steps} committed step(s)", proxy=agent.proxy)


def uninterrupted_run(start: Callable[[dict[str, str]], ProxyProcess], state: Path) -> dict[str, Any]:
    """Three steps without a kill; returns the losses and a probe turn on the final weights."""
    proxy = start({})
    agent = Agent(proxy)
    view = StoreView(state)
    try:
        sample_all(agent)
        for n, pair in enumerate(PAIRS, start=1):
            end_and_wait(agent, view, pair, n)
        probe = view.turn(agent.call("probe", seed=99))
    finally:
        agent.close()
        proxy.stop()
    return {"losses": [s.metrics["loss"] for s in view.ok_steps()], "probe": probe}


def killed_run(start: Callable[[dict[str, str]], ProxyProcess], state: Path, point: str,
               call_while_frozen: bool = True) -> dict[str, Any]:
    """Step 1 commits; step 2 freezes at `point` and is SIGKILLed (after, if `call_while_frozen`,
    one more agent call to the frozen server); a restart retrains step 2 and trains step 3.
    Returns what was observed; `check_killed_run` asserts what holds on every backend."""
    view = StoreView(state)
    out: dict[str, Any] = {"point": point}
    # the base checkpoint (v0, before step 1) is the first checkpoint write: step 2's is the third
    first = start(fault_env(state, point, nth=3 if point == "checkpoint.mid" else 2))
    agent = Agent(first)
    try:
        sample_all(agent)
        end_and_wait(agent, view, PAIRS[0], 1)
        for sid in PAIRS[1]:
            agent.end(sid)
        wait_until(marker_path(state).exists, point, proxy=first)
        if call_while_frozen:
            out["during"] = view.turn(agent.call("during", seed=7))
        out["reserved"] = [v for v, (status, _, _) in view.versions().items() if status == "reserved"]
        out["committed_before"] = view.committed()
        kill_at_marker(first, point)
    finally:
        agent.close()
        first.stop()

    second = start({})
    agent = Agent(second)
    try:
        out["restart_log"] = second.log_path.read_text(errors="replace") if second.log_path else ""
        wait_until(lambda: len(view.ok_steps()) >= 2, "the interrupted step to be trained again", proxy=second)
        end_and_wait(agent, view, PAIRS[2], 3)
        out["probe"] = view.turn(agent.call("probe", seed=99))
        out["served"] = agent.health()["policy_version"]
    finally:
        agent.close()
        second.stop()
    out["steps"] = view.steps()
    out["versions"] = view.versions()
    return out


def check_killed_run(out: dict[str, Any], view: StoreView) -> None:
    """What every backend keeps through a kill -9 at any point of step 2 (see `killed_run`)."""
    point = out["point"]
    reserved_v2 = point != "step.trained"  # from publish on, v2 is reserved (and served, uncommitted)
    assert out["committed_before"] == [0, 1]
    assert out["reserved"] == ([2] if reserved_v2 else [])
    if "during" in out:
        assert out["during"]["policy_version"] == (2 if reserved_v2 else 1)
    assert "serving policy v1" in out["restart_log"], out["restart_log"][-3000:]  # the last committed
    steps: list[Step] = out["steps"]
    assert [s.status for s in steps] == ["ok", "failed", "ok", "ok"], steps  # step 2 was interrupted
    ok_versions = [s.version for s in steps if s.status == "ok"]
    # no number reused: the killed step's reservation is abandoned; later steps are numbered past it
    assert ok_versions == ([1, 3, 4] if reserved_v2 else [1, 2, 3])
    if reserved_v2:
        assert out["versions"][2][0] == "abandoned"
    assert out["served"] == max(view.committed()) == ok_versions[-1]  # serving = the last committed
    assert out["probe"]["policy_version"] == ok_versions[-1]
    check_exactly_once(view, list(REWARDS))
