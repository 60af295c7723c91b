"""`clawbridge up` under an agent's load, over HTTP, for the benchmarks that measure it from outside.

What the bench scripts share (`engine_memory.py`'s `clawbridge up` rows, `multi_adapter.py`):
- `UpServer.start`: `clawbridge up --backend local` as a subprocess (the user's own path), settings
  from CLAWBRIDGE_* variables, keys generated into its state dir;
- `TreeRss`: the resident memory of that process and every descendant (psutil), sampled on a thread
  through the run: the peak, and a timeline;
- `run_sessions`: agents' sessions through the real `openai` SDK, streamed, several turns each (each
  turn resends the history, so a session's later turns can reuse the prefix cache), every turn
  rewarded through `/rl/set_reward` and the session ended through `/rl/end_session`, so the trainer
  runs its steps meanwhile;
- `UpServer.wait_trained`: until the trainer has nothing ready and no step runs (bounded).

Nothing here imports torch: the measured process is the server, not this one.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from clawbridge.devtools.demo import PROMPTS, free_port, stop_proxy, wait_healthy

FOLLOW_UPS = ("Go on, with an example.", "Now say it more briefly.", "Why is that?", "And what comes next?")


class TreeRss:
    """Samples the RSS of `pid` and all its descendants every `every_s` on a thread."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        self.pid = pid
        self.every_s = every_s
        self.peak_bytes = 0
        self.timeline: list[tuple[float, int]] = []
        """(seconds since start, tree RSS bytes), one sample a second."""
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> int:
        """The tree's RSS now (bytes); 0 once the process is gone."""
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return total

    def _run(self) -> None:
        last = -1.0
        while not self._stop.wait(self.every_s):
            rss = self.now()
            self.peak_bytes = max(self.peak_bytes, rss)
            t = time.monotonic() - self._t0
            if t - last >= 1.0:
                self.timeline.append((round(t, 1), rss))
                last = t

    def stop(self) -> int:
        """Stop sampling; the peak (bytes)."""
        self._stop.set()
        self._thread.join()
        return self.peak_bytes


@dataclass
class UpServer:
    """One `clawbridge up --backend local` process."""

    proc: Any
    base: str
    state_dir: Path

    @classmethod
    def start(cls, model_dir: Path, state_dir: Path, env: dict[str, str], served_name: str = "model",
              timeout_s: float = 900.0, log_level: str = "warning") -> UpServer:
        """`clawbridge up` with `env` (CLAWBRIDGE_* settings) over `model_dir`, logging at `log_level`
        into `state_dir/proxy.log`; returns once `/health` answers."""
        state_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        full = {**os.environ, "OMP_NUM_THREADS": "1", **env}
        for k in ("CLAWBRIDGE_API_KEY", "CLAWBRIDGE_ADMIN_KEY"):
            full.pop(k, None)
        with (state_dir / "proxy.log").open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "clawbridge.cli.main", "up", "--backend", "local", "--model", str(model_dir),
                 "--served-model-name", served_name, "--port", str(port), "--state-dir", str(state_dir),
                 "--log-level", log_level], stdout=log, stderr=subprocess.STDOUT, env=full)
        server = cls(proc, f"http://127.0.0.1:{port}", state_dir)
        try:
            wait_healthy(server.base, proc, timeout_s)
        except BaseException:
            server.stop()
            raise RuntimeError(f"clawbridge up did not start; log:\n{server.log_tail()}") from None
        return server

    @property
    def admin_key(self) -> str:
        return (self.state_dir / "admin_key").read_text().strip()

    @property
    def client_key(self) -> str:
        return (self.state_dir / "client_key").read_text().strip()

    def log_size(self) -> int:
        return (self.state_dir / "proxy.log").stat().st_size

    def log_since(self, offset: int) -> str:
        """What the server logged after byte `offset`."""
        with (self.state_dir / "proxy.log").open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return (self.state_dir / "proxy.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def call(self, method: str, path: str, key: str | None = None, body: dict[str, Any] | None = None,
             timeout_s: float = 120.0) -> dict[str, Any]:
        r = httpx.request(method, self.base + path, json=body, timeout=timeout_s,
                          headers={"Authorization": f"Bearer {key or self.admin_key}"})
        r.raise_for_status()
        return dict(r.json())

    def status(self) -> dict[str, Any]:
        return self.call("GET", "/rl/status")

    def add_user(self, name: str) -> str:
        """A new user's key."""
        return str(self.call("POST", "/rl/users", body={"user": name})["api_key"])

    def wait_trained(self, timeout_s: float) -> dict[str, Any]:
        """Poll `/rl/status` until nothing is ready to train and no step (of any lane) runs, three
        looks in a row, or `timeout_s`; the last status."""
        deadline = time.monotonic() + timeout_s
        quiet = 0
        st = self.status()
        while time.monotonic() < deadline:
            st = self.status()
            tr = st["trainer"]
            lanes = st.get("lanes") or {}
            idle = (tr["waiting"]["ready_datums"] == 0 and not tr["in_step"]
                    and not any(lane["in_step"] or lane["pending_turns"] for lane in lanes.values()))
            quiet = quiet + 1 if idle else 0
            if quiet >= 3:
                break
            time.sleep(1.0)
        return st

    def stop(self) -> None:
        if self.proc.poll() is None:
            stop_proxy(self.proc)


@dataclass(frozen=True)
class SessionLoad:
    """Agents' sessions: `sessions` in all, `concurrency` at a time, `turns` streamed calls each."""

    sessions: int = 64
    concurrency: int = 16
    turns: int = 3
    max_tokens: int = 96
    temperature: float = 1.0
    model: str = "model"


@dataclass
class LoadResult:
    """What the agents saw."""

    turns: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def p(self, q: float) -> float:
        xs = sorted(self.first_token_s)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def one_session(base: str, admin_key: str, index: int, load: SessionLoad, into: LoadResult,
                lock: threading.Lock) -> None:
    """One agent's session: start it, `load.turns` streamed turns (each resends the history and adds a
    follow-up), a reward on every turn, then end it."""
    import openai

    started = httpx.post(f"{base}/rl/start_session", json={"task_id": f"task-{index % 8}"},
                         headers={"Authorization": f"Bearer {admin_key}"}, timeout=120)
    started.raise_for_status()
    key = started.json()["api_key"]
    kh = {"Authorization": f"Bearer {key}"}
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=5, timeout=600)
    rng = random.Random(index)
    messages: list[dict[str, str]] = [{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}]
    for turn in range(load.turns):
        t0 = time.monotonic()
        first: float | None = None
        parts: list[str] = []
        n = 0
        stream = client.chat.completions.create(
            model=load.model, messages=messages, max_tokens=load.max_tokens, temperature=load.temperature,
            stream=True, stream_options={"include_usage": True}, seed=index * 100 + turn)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first if first is not None else time.monotonic() - t0
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
        text = "".join(parts)
        reward = sum(c == "e" for c in text) / max(1, len(text))
        httpx.post(f"{base}/rl/set_reward", json={"reward": reward}, headers=kh, timeout=120).raise_for_status()
        with lock:
            into.turns += 1
            into.tokens += n
            if first is not None:
                into.first_token_s.append(first)
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": FOLLOW_UPS[(turn + rng.randrange(4)) % len(FOLLOW_UPS)]}]
    httpx.post(f"{base}/rl/end_session", json={}, headers=kh, timeout=120).raise_for_status()


def run_sessions(server: UpServer, load: SessionLoad) -> LoadResult:
    """`load.sessions` sessions, `load.concurrency` at a time; a session that fails is counted in
    `errors` (the others go on)."""
    out = LoadResult()
    lock = threading.Lock()
    admin = server.admin_key
    t0 = time.monotonic()

    def guarded(i: int) -> None:
        try:
            one_session(server.base, admin, i, load, out, lock)
        except Exception as exc:
            with lock:
                out.errors.append(f"session {i}: {type(exc).__name__}: {exc}")

    # The first session alone: the openai SDK builds its response models lazily, and threads that
    # race to build them the first time fail with pydantic's "BaseModel cannot be instantiated
    # directly" (seen in 4 of 64 sessions of a run), a client-side error that is not the server's.
    guarded(0)
    with ThreadPoolExecutor(load.concurrency) as pool:
        list(pool.map(guarded, range(1, load.sessions)))
    out.wall_s = time.monotonic() - t0
    return out


def prefix_figures(engine: dict[str, Any] | None, store: dict[str, Any]) -> dict[str, Any]:
    """The prefix cache's reuse from `/rl/status`: the share of all prompt tokens whose keys and
    values came from the cache, and the share of turns that reused a prefix."""
    if not engine:
        return {}
    turns = max(1, int(store["turns"]["main"]) + int(store["turns"]["side"]))
    prompt = max(1, int(store["prompt_tokens"]))
    return {"prefix_hits": engine["prefix_hits"], "prefix_tokens_reused": engine["prefix_tokens_reused"],
            "prompt_tokens": store["prompt_tokens"], "turns": turns,
            "token_hit_rate": round(engine["prefix_tokens_reused"] / prompt, 4),
            "turn_hit_rate": round(engine["prefix_hits"] / turns, 4)}


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
