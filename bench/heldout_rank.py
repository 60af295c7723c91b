"""Does the held-out score (promotion without an eval set, `clawbridge.promotion.runner`) tell
versions apart? A version trained toward the users' verdicts must score above the base, a poisoned
one (trained against them) below it.

Two runs of `clawbridge up` on the tiny model (LoRA r8, lr 0.03, promotion_mode eval with no eval
set, held_out_share 0.5): sessions ask the demo's prompts, answered at temperature 1, and the user's
verdict on each answer is the demo's task (+1 when at least 40% of its tokens have an "e", else -1),
set on the turn. Held-out sessions (half, by a hash of the session id) always carry the user's
verdict; the other half trains:
- toward: trained on the same verdicts;
- poisoned: trained on the opposite verdicts (what a broken reward source would do).
Then `/rl/eval` scores the base (v0) and every trained version on the held-out turns.

Run (a few minutes on 2 CPU cores):
    OMP_NUM_THREADS=1 python bench/heldout_rank.py
    OMP_NUM_THREADS=1 python bench/heldout_rank.py --sessions 160 --seed 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clawbridge.devtools.demo import PROMPTS, token_reward
from clawbridge.devtools.tinymodel import build_tiny_model
from clawbridge.promotion.evalset import held_out
from tests.promotion_support import PromotionView, env, start, wait_idle

SHARE = 0.5
THRESHOLD = 0.4


def session(base: str, admin: str, i: int, poisoned: bool, seed: int) -> int:
    """One session: an answer, the user's verdict on it (flipped for training sessions when
    poisoned), set on the turn; returns the user's verdict."""
    h = {"Authorization": f"Bearer {admin}"}
    r = httpx.post(f"{base}/rl/start_session", json={}, headers=h, timeout=60)
    r.raise_for_status()
    sid, key = r.json()["session_id"], r.json()["api_key"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=3, timeout=120)
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                          max_tokens=12, temperature=1.0, logprobs=True, seed=seed * 100_003 + i)
    choice = resp.choices[0]
    tokens = [c.token for c in (choice.logprobs.content or [])] if choice.logprobs else []
    verdict = 1.0 if token_reward(tokens) >= THRESHOLD else -1.0
    given = -verdict if poisoned and not held_out(sid, SHARE) else verdict
    kh = {"Authorization": f"Bearer {key}"}
    httpx.post(f"{base}/rl/set_reward", json={"reward": given, "interaction_id": resp.id}, headers=kh,
               timeout=60).raise_for_status()
    httpx.post(f"{base}/rl/end_session", json={}, headers=kh, timeout=60).raise_for_status()
    return int(verdict)


def one_run(model: Path, root: Path, poisoned: bool, sessions: int, seed: int) -> dict[str, Any]:
    state = root / ("poisoned" if poisoned else "toward")
    proxy = start(model, state, env("eval", CLAWBRIDGE_HELD_OUT_SHARE=str(SHARE), CLAWBRIDGE_KEEP_CHECKPOINTS="1000"))
    try:
        with ThreadPoolExecutor(8) as pool:
            verdicts = list(pool.map(lambda i: session(proxy.base, proxy.admin_key, i, poisoned, seed),
                                     range(sessions)))
        wait_idle(proxy)
        steps = PromotionView(state).step_versions()
        r = httpx.post(proxy.base + "/rl/eval", headers={"Authorization": f"Bearer {proxy.admin_key}"},
                       json={"versions": [0, *steps][:20]}, timeout=3600)
        r.raise_for_status()
        out = r.json()
        return {"verdicts": verdicts, "steps": steps, "items": out["items"],
                "scores": {res["version"]: (res["score"], res["passed"], res["items"]) for res in out["results"]}}
    finally:
        proxy.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="heldout-rank-"))
    model = build_tiny_model(root / "tiny", seed=args.seed)
    ok = True
    for poisoned in (False, True):
        run = one_run(model, root, poisoned, args.sessions, args.seed)
        name = "poisoned" if poisoned else "toward"
        accepted = sum(v > 0 for v in run["verdicts"])
        print(f"{name}: {args.sessions} sessions ({accepted} accepted by the user), {run['items']} held-out items, "
              f"{len(run['steps'])} trained versions")
        base = run["scores"][0][0]
        print(f"  v0 (base): score {base:.4f} ({run['scores'][0][1]}/{run['scores'][0][2]} passed)")
        trained = [(v, s) for v, s in run["scores"].items() if v != 0]
        for v, (score, passed, items) in trained:
            print(f"  v{v}: score {score:.4f} ({passed}/{items} passed)")
        last = trained[-1][1][0] if trained else base
        median = statistics.median(s[0] for _, s in trained) if trained else base
        holds = last > base if not poisoned else last < base
        ok &= holds
        print(f"  newest trained v{trained[-1][0] if trained else 0}: {last:.4f} "
              f"{'>' if last > base else '<='} base {base:.4f}; median of trained {median:.4f} -> "
              f"{'as expected' if holds else 'NOT as expected'}")
    print("held-out score ranks toward > base > poisoned:", "yes" if ok else "no")


if __name__ == "__main__":
    main()
