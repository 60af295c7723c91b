"""What promotion's evaluation costs per version: `/rl/eval` of one version on an eval set of N
items (greedy, up to --max-tokens each; a fresh set each round, so nothing comes from the cache)
through a running `clawbridge up`, beside the baseline measured in the same run: the same N
prompts answered greedily through `/v1/chat/completions`, 4 at a time (the evaluator's own
concurrency). In `promotion_mode = eval` each new version costs one such pass (the serving
version's figures are cached per set).

Run (a minute or two on 2 CPU cores):
    . .venv/bin/activate && OMP_NUM_THREADS=1 python bench/promotion_eval.py --model tiny
    . .venv/bin/activate && OMP_NUM_THREADS=1 python bench/promotion_eval.py --model smollm2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support import ProxyProcess

QUESTIONS = ("What is the capital of France?", "Name a primary colour.", "How many legs has a spider?",
             "What do bees make?", "Say hello.", "What is 2 + 2?", "Name a planet.", "What colour is the sky?")


def model_dir(name: str, root: Path) -> Path:
    if name == "tiny":
        from clawbridge.devtools.tinymodel import build_tiny_model

        return build_tiny_model(root / "tiny", seed=0)
    from clawbridge.models import cached_model
    from tests.conftest import model_cache_dir

    return cached_model("smollm2-135m-instruct", model_cache_dir(), progress=print)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="promotion-bench-"))
    proxy = ProxyProcess(model_dir(args.model, root), root / "state", extra_args=("--served-model-name", "m"),
                         env={"CLAWBRIDGE_PROMOTION_MODE": "eval", "CLAWBRIDGE_EVAL_MAX_TOKENS": str(args.max_tokens),
                              "CLAWBRIDGE_TRAIN": "false"}).start(600)
    admin = {"Authorization": f"Bearer {proxy.admin_key}"}
    client = {"Authorization": f"Bearer {proxy.key()}"}
    prompts = [f"{QUESTIONS[i % len(QUESTIONS)]} ({i})" for i in range(args.items)]
    evals, chats, tokens = [], [], []
    try:
        for r in range(args.rounds):
            lines = [json.dumps({"id": f"r{r}-{i}", "messages": [{"role": "user", "content": p}], "expect": "."})
                     for i, p in enumerate(prompts)]
            t0 = time.monotonic()
            out = httpx.post(proxy.base + "/rl/eval", headers=admin, timeout=3600,
                             json={"versions": [0], "eval_set": "\n".join(lines)}).json()
            evals.append(time.monotonic() - t0)
            tokens.append(out["results"][0]["mean_answer_tokens"])

            def chat(p: str) -> None:
                httpx.post(proxy.base + "/v1/chat/completions", headers=client, timeout=600, json={
                    "model": "m", "messages": [{"role": "user", "content": p}], "max_tokens": args.max_tokens,
                    "temperature": 0}).raise_for_status()

            t0 = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(chat, prompts))
            chats.append(time.monotonic() - t0)
    finally:
        proxy.stop()
    print(f"model {args.model}, {args.items} items, up to {args.max_tokens} tokens "
          f"(mean answer {statistics.mean(tokens):.1f} tokens), {args.rounds} rounds")
    print("| what | median s | per item s |")
    print("|---|---|---|")
    for name, xs in (("evaluation of one version (/rl/eval)", evals),
                     ("baseline: the same prompts via /v1/chat/completions, 4 at a time", chats)):
        med = statistics.median(xs)
        print(f"| {name} | {med:.2f} | {med / args.items:.3f} |")


if __name__ == "__main__":
    main()
