"""`clawbridge demo`: watch an agent learn, offline, on this machine.

It builds the tiny model, starts `clawbridge up` (local backend, training on) as a subprocess, and
drives sessions through the real `openai` SDK on a toy task with a programmatic reward: the share
of answer tokens that contain the letter "e". Each session: `/rl/start_session` (a task id shared
by a group of sessions, for the group baseline), one chat call with the session key, the reward
through `/rl/set_reward`, `/rl/end_session`. The trainer trains in the background and publishes;
each answer records the policy version that sampled it. At the end: a table per policy version,
first-20% vs last-20% mean reward, and a PNG plot.

With `reward="judge"` (`clawbridge demo --reward judge`) no reward is ever set by hand: a scripted
user answers each first answer in the same session, with acceptance ("Great, thanks!") when at
least `accept_threshold` of its tokens contain the letter, else a correction; the agent answers
that too, and the session ends. The proxy's judge worker reads each turn's next state and
asks a RULE-BASED judge endpoint (`clawbridge.devtools.judge_server`, keyword rules, not a
language model: the tiny model cannot judge) that the demo starts on 127.0.0.1; its verdicts are
the only rewards. The reward plotted is still the task reward of the first answer.

Invariant: the demo only talks to the proxy over HTTP, as any agent would; nothing is faked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx

TARGET = "e"
PROMPTS = (
    "Write one short sentence about the weather.",
    "Name something you would find in a kitchen.",
    "Describe a tree in a few words.",
    "Say hello to the user.",
)


DEFAULT_LEARNING_RATE: dict[str, float] = {"api": 3e-2, "judge": 2e-2}
"""The tiny model on 2 CPU cores, LoRA r8 (alpha 32, lm_head among the targets) and full fine-tuning
alike. LoRA, api: at 3e-2 the 240-session run went from 0.37-0.41 to 1.00 (last 20%) in 4 of 4
seeds (0-3). Full fine-tuning, api: at 3e-2 the 160-session run reached ~1.0 in 12 of 12 tries;
at 1e-2 it rose in only 2 of 3. Judge: both turns of a session are trained, ~1.6x the steps; full
fine-tuning at 3e-2 collapsed once in 4 runs, at 2e-2 10 of 10 reached ~1.0. With the default
`cispo` loss (`bench/stability.py`, two runs at a time, load 8-16, LoRA): judge 8 of 8 seeds learned
(+0.36 to +0.63; unclipped importance sampling collapsed in 1 of 8), api 4 of 4 (+0.28 to +0.62). The
tiny model is a toy: a real model wants far lower rates (`Settings.effective_learning_rate`)."""


@dataclass(frozen=True)
class DemoConfig:
    """Knobs of one demo run (the defaults finish in under a minute on 2 CPU cores)."""

    sessions: int = 240
    group_size: int = 8
    """Sessions per task id: the group baseline compares answers to the same prompt."""
    concurrency: int = 8
    max_tokens: int = 12
    batch_size: int = 8
    learning_rate: float | None = None
    """None: the measured default of the reward mode (`DEFAULT_LEARNING_RATE`)."""
    lora_rank: int = 8
    """LoRA rank, as most users train (0: full fine-tuning)."""
    seed: int = 0
    reward: Literal["api", "judge"] = "api"
    """api: the reward is set through /rl/set_reward; judge: only the judge's verdicts."""
    accept_threshold: float = 0.4
    """judge: the scripted user accepts an answer with at least this share of target tokens."""
    settings: dict[str, str] = field(default_factory=dict)
    """Extra CLAWBRIDGE_* variables for the proxy (they win over the demo's own), e.g.
    {"CLAWBRIDGE_LOSS": "ppo"}: how `bench/stability.py` compares training settings."""

    @property
    def lr(self) -> float:
        """The learning rate this run uses."""
        return self.learning_rate if self.learning_rate is not None else DEFAULT_LEARNING_RATE[self.reward]


@dataclass
class Episode:
    """One finished session."""

    index: int
    policy_version: int
    reward: float
    text: str
    accepted: bool | None = None
    """judge mode: the scripted user thanked the first answer (its share reached `accept_threshold`);
    None in api mode, where no one answers."""


@dataclass
class DemoResult:
    episodes: list[Episode] = field(default_factory=list)
    seconds: float = 0.0
    plot: Path | None = None
    judge_calls: int = 0
    """judge mode: requests the rule-based judge answered."""

    def head_tail(self, frac: float = 0.2) -> tuple[float, float]:
        eps = sorted(self.episodes, key=lambda e: e.index)
        k = max(1, int(len(eps) * frac))
        first = sum(e.reward for e in eps[:k]) / k
        last = sum(e.reward for e in eps[-k:]) / k
        return first, last

    def acceptance(self, frac: float = 0.2) -> tuple[float, float] | None:
        """judge mode: the share of first answers the user accepted in the first and the last `frac`
        of sessions, what the judge's verdicts reward (None in api mode). Once every answer of a group
        is accepted its verdicts are all alike and carry no signal, so training stops wherever the
        token share then stands (0.72 to 0.92 over six runs of seed 0): acceptance, not the share,
        is what this mode teaches."""
        eps = sorted((e for e in self.episodes if e.accepted is not None), key=lambda e: e.index)
        if not eps:
            return None
        k = max(1, int(len(eps) * frac))
        return sum(bool(e.accepted) for e in eps[:k]) / k, sum(bool(e.accepted) for e in eps[-k:]) / k

    def by_version(self) -> list[tuple[int, int, float]]:
        groups: dict[int, list[float]] = {}
        for e in self.episodes:
            groups.setdefault(e.policy_version, []).append(e.reward)
        return [(v, len(r), sum(r) / len(r)) for v, r in sorted(groups.items())]


def token_reward(tokens: list[str]) -> float:
    """Share of answer tokens containing the target letter (the stop token is not counted)."""
    toks = [t for t in tokens if t not in ("<|im_end|>", "<|endoftext|>")]
    return sum(TARGET in t for t in toks) / len(toks) if toks else 0.0


ACCEPT = "Great, thanks!"
LEARNED_ACCEPTANCE = 0.9
"""judge mode: a run has learned when at least this share of its last 20% of first answers was
accepted (`DemoResult.acceptance`; tests/test_judge_demo.py and bench/stability.py use it)."""
CORRECT = "No, that's wrong. Use more words with the letter e."


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_proxy(model_dir: Path, state_dir: Path, port: int, settings_env: dict[str, str],
                 served_name: str) -> subprocess.Popen[bytes]:
    """`clawbridge up --backend local` as a subprocess with `settings_env` (CLAWBRIDGE_* values),
    logging into `state_dir/proxy.log`; keys are generated into the state dir."""
    env = dict(os.environ)
    env.update(settings_env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("CLAWBRIDGE_API_KEY", None)
    env.pop("CLAWBRIDGE_ADMIN_KEY", None)
    log = (state_dir / "proxy.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "clawbridge.cli.main", "up", "--backend", "local", "--model", str(model_dir),
         "--served-model-name", served_name, "--port", str(port), "--state-dir", str(state_dir),
         "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env=env)


E = TypeVar("E")
"""An episode result."""


def run_episodes(episode: Callable[[int], E], n: int, concurrency: int, into: list[E],
                 on_episode: Callable[[E], None] | None = None) -> None:
    """Run `episode(0..n-1)` on `concurrency` threads, appending each result to `into` as it finishes
    (then calling `on_episode`); the first failure is raised once all have been waited for."""
    lock = threading.Lock()

    def one(i: int) -> None:
        ep = episode(i)
        with lock:
            into.append(ep)
        if on_episode:
            on_episode(ep)

    with ThreadPoolExecutor(concurrency) as pool:
        for fut in [pool.submit(one, i) for i in range(n)]:
            fut.result()


def stop_proxy(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def _start_proxy(model_dir: Path, state_dir: Path, port: int, cfg: DemoConfig,
                 judge_url: str | None = None) -> subprocess.Popen[bytes]:
    env = {
        "CLAWBRIDGE_TRAIN": "true", "CLAWBRIDGE_BATCH_SIZE": str(cfg.batch_size),
        "CLAWBRIDGE_LORA_RANK": str(cfg.lora_rank), "CLAWBRIDGE_LEARNING_RATE": str(cfg.lr),
        "CLAWBRIDGE_BASELINE": "group_mean",
        "CLAWBRIDGE_TRAINER_POLL_INTERVAL_S": "0.2", "CLAWBRIDGE_MAX_OFF_POLICY_STEPS": "4",
        "CLAWBRIDGE_DEFAULT_MAX_TOKENS": str(cfg.max_tokens),
    }
    if judge_url:
        env.update({
            "CLAWBRIDGE_JUDGE": "endpoint", "CLAWBRIDGE_JUDGE_BASE_URL": judge_url,
            "CLAWBRIDGE_JUDGE_MODEL": "rule-based", "CLAWBRIDGE_JUDGE_POLL_INTERVAL_S": "0.2",
            "CLAWBRIDGE_METHOD": "rl",  # the tiny base model is no teacher: OPD would add noise only
            # nor can it read a note: best of n would pick its answers by noise, and did (last 20%
            # 0.50-0.94 over five runs against 0.80-0.99 over five with one sample; docs/training.md)
            "CLAWBRIDGE_NOTES_BEST_OF": "1",
        })
    env.update(cfg.settings)
    return launch_proxy(model_dir, state_dir, port, env, served_name="tiny")


def wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout_s: float = 600.0) -> None:
    """Until `/health` answers (bounded; model loading took over 3 minutes at load average 24)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"clawbridge up exited with code {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"proxy at {base} not healthy after {timeout_s:.0f}s")


def _episode(base: str, admin: str, index: int, cfg: DemoConfig) -> Episode:
    import openai

    h = {"Authorization": f"Bearer {admin}"}
    task = index // cfg.group_size
    prompt = PROMPTS[task % len(PROMPTS)]
    deadline = time.monotonic() + 900.0
    while True:  # capacity mode may ask us to wait (bounded: a trainer that never catches up fails the run)
        r = httpx.post(f"{base}/rl/start_session", json={"task_id": f"task-{task}"}, headers=h, timeout=30)
        if r.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(float(r.headers.get("Retry-After", "1")))
    r.raise_for_status()
    key = r.json()["api_key"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=3, timeout=120)
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=cfg.max_tokens,
        temperature=1.0, logprobs=True, seed=cfg.seed * 100_003 + index)
    choice = resp.choices[0]
    tokens = [c.token for c in (choice.logprobs.content or [])] if choice.logprobs else []
    reward = token_reward(tokens)
    version = int((resp.system_fingerprint or "policy-v0").removeprefix("policy-v"))
    accepted = reward >= cfg.accept_threshold if cfg.reward == "judge" else None
    if cfg.reward == "judge":  # the scripted user answers in the same session; the judge does the rest
        reply = ACCEPT if accepted else CORRECT
        history: list[Any] = [{"role": "user", "content": prompt},
                              {"role": "assistant", "content": choice.message.content or ""},
                              {"role": "user", "content": reply}]
        client.chat.completions.create(model="tiny", messages=history, max_tokens=cfg.max_tokens,
                                       temperature=1.0, seed=cfg.seed * 100_003 + index + 7)
    else:
        httpx.post(f"{base}/rl/set_reward", json={"reward": reward}, headers={"Authorization": f"Bearer {key}"},
                   timeout=30).raise_for_status()
    httpx.post(f"{base}/rl/end_session", json={}, headers={"Authorization": f"Bearer {key}"},
               timeout=30).raise_for_status()
    text = (choice.message.content or "") + (getattr(choice.message, "reasoning_content", None) or "")
    return Episode(index, version, reward, text, accepted)


def plot(result: DemoResult, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    eps = sorted(result.episodes, key=lambda e: e.index)
    xs = [e.index for e in eps]
    ys = [e.reward for e in eps]
    w = max(1, len(eps) // 20)
    smooth = [sum(ys[max(0, i - w + 1): i + 1]) / len(ys[max(0, i - w + 1): i + 1]) for i in range(len(ys))]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.scatter(xs, ys, s=6, alpha=0.35, label="session reward")
    ax.plot(xs, smooth, color="C3", lw=2, label=f"moving mean ({w})")
    ax2 = ax.twinx()
    ax2.step(xs, [e.policy_version for e in eps], color="C2", lw=1, where="post", label="policy version")
    ax2.set_ylabel("policy version that answered")
    ax.set_xlabel("session")
    ax.set_ylabel(f"reward: share of tokens containing '{TARGET}'")
    first, last = result.head_tail()
    ax.set_title(f"clawbridge demo: first 20% {first:.3f} -> last 20% {last:.3f}")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_demo(cfg: DemoConfig, out_dir: Path, on_episode: Callable[[Episode], None] | None = None,
             port: int = 0) -> DemoResult:
    """Run the demo end to end; `out_dir` gets the model, state, log, results and plot."""
    from clawbridge.devtools.tinymodel import build_tiny_model

    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model(out_dir / "tiny-model", seed=cfg.seed)
    state_dir = out_dir / "state"
    state_dir.mkdir(exist_ok=True)
    port = port or free_port()
    base = f"http://127.0.0.1:{port}"
    judge = None
    if cfg.reward == "judge":
        from clawbridge.devtools.judge_server import JudgeServer

        judge = JudgeServer(model="rule-based").start()
        (out_dir / "judge.txt").write_text(f"rule-based judge (keyword rules, not a language model) at {judge.base_url}\n")
    proc = _start_proxy(model_dir, state_dir, port, cfg, judge.base_url if judge else None)
    result = DemoResult()
    t0 = time.monotonic()
    try:
        wait_healthy(base, proc)
        admin = (state_dir / "admin_key").read_text().strip()

        run_episodes(lambda i: _episode(base, admin, i, cfg), cfg.sessions, cfg.concurrency,
                     result.episodes, on_episode)
    finally:
        stop_proxy(proc)
        if judge is not None:
            result.judge_calls = len(judge.requests)
            judge.stop()
    result.seconds = time.monotonic() - t0
    (out_dir / "episodes.jsonl").write_text(
        "".join(json.dumps(e.__dict__) + "\n" for e in sorted(result.episodes, key=lambda e: e.index)))
    result.plot = plot(result, out_dir / "reward.png")
    return result


def default_out_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="clawbridge-demo-"))
