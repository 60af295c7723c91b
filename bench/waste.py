"""How many rewarded turns the trainer actually trains when agents outpace it (issue 10, item 4).

Runs `clawbridge up` (local backend, tiny model, LoRA at the default settings) twice in one
invocation and drives it with N concurrent agents for T seconds each time, every agent looping
over one-call sessions: `/rl/start_session`, one chat call through the openai SDK, `/rl/set_reward`,
`/rl/end_session`. After the agents stop, the trainer gets up to `--drain` seconds to finish what
is ready (it stops early once nothing is pending). Printed per run, where every rewarded turn
went: trained, dropped (by reason), ready but untrained (a short batch still waiting), not yet
trainable (session active or no reward seen), and agent errors; then the share trained and its
difference from the baseline run (`old`) measured in the same invocation.

- `old`: the behaviour before: stale samples (more than max_off_policy_steps=2 behind) dropped,
  fixed batch_size steps, unclipped importance-sampling loss, and a batch waits until it is full
  (batch_wait_s=0), so the last turns before the agents stop stay untrained.
- `new`: the defaults now: stale samples kept as importance-weighted data, a backlog trained in
  larger steps (max_batch_tokens), nothing dropped unless drop_stale_after is set, and fewer than
  batch_size ready turns train as a short batch after batch_wait_s (30 s).

Any CLAWBRIDGE_* variable in the environment reaches both servers (e.g. CLAWBRIDGE_BATCH_WAIT_S=0
to see the `new` defaults without short batches). The machine's load average is printed with
the figures: on a shared, loaded machine fewer turns are served, not a different share trained.

Usage: python bench/waste.py [--agents 32] [--seconds 45] [--drain 120] [--only new]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import exit_on_sigterm, set_threads_from_argv

from clawbridge.devtools.demo import free_port, stop_proxy, wait_healthy

set_threads_from_argv(1)

MODES: dict[str, dict[str, str]] = {
    "old": {"CLAWBRIDGE_STALE_POLICY": "drop", "CLAWBRIDGE_MAX_BATCH_TOKENS": "0",
            "CLAWBRIDGE_LOSS": "importance_sampling", "CLAWBRIDGE_BATCH_WAIT_S": "0"},
    "new": {},
}


def _agent(base: str, admin: str, stop: threading.Event, rewarded: list[int], lock: threading.Lock) -> None:
    import openai

    h = {"Authorization": f"Bearer {admin}"}
    i = 0
    while not stop.is_set():
        r = httpx.post(f"{base}/rl/start_session", json={}, headers=h, timeout=60)
        if r.status_code == 429:
            time.sleep(float(r.headers.get("Retry-After", "1")))
            continue
        r.raise_for_status()
        key = r.json()["api_key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=5, timeout=120)
        resp = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Say something about the sea ({i})."}],
            max_tokens=12, temperature=1.0)
        text = resp.choices[0].message.content or ""
        reward = sum(c == "e" for c in text) / max(1, len(text))
        kh = {"Authorization": f"Bearer {key}"}
        httpx.post(f"{base}/rl/set_reward", json={"reward": reward}, headers=kh, timeout=60).raise_for_status()
        httpx.post(f"{base}/rl/end_session", json={}, headers=kh, timeout=60).raise_for_status()
        with lock:
            rewarded[0] += 1
        i += 1


def run(mode: str, model_dir: Path, out: Path, agents: int, seconds: float, drain: float) -> dict[str, Any]:
    state = out / f"state-{mode}"
    state.mkdir(parents=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env.pop("CLAWBRIDGE_API_KEY", None)
    env.pop("CLAWBRIDGE_ADMIN_KEY", None)
    env.update({"CLAWBRIDGE_DEFAULT_MAX_TOKENS": "12",
                "CLAWBRIDGE_TRAINER_POLL_INTERVAL_S": "0.2", "CLAWBRIDGE_BASELINE": "running_mean"})
    env.update(MODES[mode])
    log = (state / "proxy.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "clawbridge.cli.main", "up", "--backend", "local", "--model", str(model_dir),
         "--served-model-name", "tiny", "--port", str(port), "--state-dir", str(state), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(base, proc, timeout_s=300.0)
        admin = (state / "admin_key").read_text().strip()
        h = {"Authorization": f"Bearer {admin}"}
        stop, lock, rewarded = threading.Event(), threading.Lock(), [0]
        with ThreadPoolExecutor(agents) as pool:
            futs = [pool.submit(_agent, base, admin, stop, rewarded, lock) for _ in range(agents)]
            time.sleep(seconds)  # the measured window itself, not a wait for a condition
            stop.set()
            errors = [f.exception() for f in futs if f.exception() is not None]
        deadline = time.monotonic() + drain
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:  # poll until nothing is left to train, within the drain bound
            status = httpx.get(f"{base}/rl/status", headers=h, timeout=30).json()["trainer"]
            waiting = status["waiting"]
            if (status["samples"]["pending"] == 0 and not status["in_step"]
                    and waiting["active_session_turns"] == 0 and waiting["unrewarded_turns"] == 0):
                break
            time.sleep(1.0)
        samples, waiting = status["samples"], status["waiting"]
        dropped = {k: int(v) for k, v in samples["dropped"].items()}
        return {"mode": mode, "rewarded": rewarded[0], "trained": samples["consumed"],
                "dropped_stale": dropped.pop("stale", 0), "dropped_other": sum(dropped.values()),
                "ready_untrained": waiting["ready_datums"],
                "not_trainable": waiting["active_session_turns"] + waiting["unrewarded_turns"],
                "steps": status["steps"]["ok"], "agent_errors": len(errors),
                "load_avg": round(os.getloadavg()[0], 1)}
    finally:
        stop_proxy(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=45.0)
    ap.add_argument("--drain", type=float, default=120.0,
                    help="Seconds the trainer gets after the agents stop (batch_wait_s is 30 s).")
    ap.add_argument("--only", choices=sorted(MODES), default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    exit_on_sigterm()
    from clawbridge.devtools.tinymodel import build_tiny_model

    out = Path(tempfile.mkdtemp(prefix="clawbridge-waste-"))
    model_dir = build_tiny_model(out / "tiny", seed=0)
    rows = [run(m, model_dir, out, args.agents, args.seconds, args.drain)
            for m in ([args.only] if args.only else ["old", "new"])]
    print(f"{args.agents} agents x {args.seconds:.0f}s, tiny model, LoRA defaults, drain <= {args.drain:.0f}s; "
          f"state in {out}")
    cols = ("rewarded", "trained", "dropped_stale", "dropped_other", "ready_untrained", "not_trainable",
            "agent_errors", "steps", "load_avg")
    print(f"{'mode':<5} " + " ".join(f"{c:>15}" for c in cols) + f" {'trained %':>10}")
    shares: dict[str, float] = {}
    for r in rows:
        shares[r["mode"]] = 100.0 * r["trained"] / r["rewarded"] if r["rewarded"] else 0.0
        print(f"{r['mode']:<5} " + " ".join(f"{r[c]:>15}" for c in cols) + f" {shares[r['mode']]:>9.1f}%")
    if "old" in shares and "new" in shares:
        print(f"trained share: new {shares['new']:.1f}% vs baseline (old) {shares['old']:.1f}%: "
              f"{shares['new'] - shares['old']:+.1f} points; target >= 95%: "
              f"{'met' if shares['new'] >= 95.0 else 'NOT met'}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
