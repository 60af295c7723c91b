"""One decode step of one stream: the KV pool's forward against transformers' `DynamicCache`.

The same SmolLM2-135M-Instruct weights (fp32, CPU, one thread) run in two copies in one process:
one through `KVPool.forward` (the torch engine), one through a plain transformers forward with a
`DynamicCache` (what the old engine, `bench/old_engine/`, does per request), the baseline. After
the same prompt, both decode one token per step; blocks of `--steps` steps alternate between the
two (which goes first alternates too). Printed, as the median over `--blocks` blocks per side:
the whole forward in ms per step, and the attention's share of it (the attention function with its
cache writes: `pool_attention`, against transformers' SDPA function plus `DynamicCache.update`).

Run (about a minute):
    . .venv/bin/activate && python bench/engine_step.py
    python bench/engine_step.py --blocks 10 --steps 30 --prompt 200
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def timed(fn: Callable[..., Any], into: dict[str, float], key: str) -> Callable[..., Any]:
    """`fn`, adding the seconds each call takes to `into[key]`."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[key] += time.perf_counter() - t0

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=6, help="blocks of steps per side (median over them)")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per block")
    ap.add_argument("--prompt", type=int, default=30, help="prompt tokens before the first step")
    args = ap.parse_args()

    import clawbridge_local.kvpool as kvpool
    import torch
    from clawbridge_local.loading import load_causal_lm
    from transformers import AttentionInterface, DynamicCache

    from clawbridge.models import cached_model

    torch.set_num_threads(1)
    model = load_causal_lm(str(cached_model("smollm2-135m-instruct")), torch.device("cpu"), torch.float32,
                           local_files_only=True, progress=False)
    model.eval()
    baseline = copy.deepcopy(model)  # keeps transformers' "sdpa" attention
    kvpool.install(model)
    attention = {"pool": 0.0, "dynamic": 0.0}
    AttentionInterface.register(kvpool.ATTN_NAME, timed(kvpool.pool_attention, attention, "pool"))
    AttentionInterface.register("sdpa", timed(AttentionInterface._global_mapping["sdpa"], attention, "dynamic"))
    DynamicCache.update = timed(DynamicCache.update, attention, "dynamic")  # type: ignore[method-assign]

    pool = kvpool.KVPool.for_model(model, args.prompt + args.blocks * args.steps + 8)
    prompt = [10 + i for i in range(args.prompt)]
    cache = DynamicCache(config=baseline.config)
    forward_ms: dict[str, list[float]] = {"pool": [], "dynamic": []}
    attention_ms: dict[str, list[float]] = {"pool": [], "dynamic": []}
    with torch.inference_mode():
        pool.forward(model, [prompt], [kvpool.Row(0, 0, len(prompt))])
        baseline(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        cached = len(prompt)
        for block in range(2 * args.blocks):
            which = ("pool", "dynamic")[(block + block // 2) % 2]  # pool, dynamic, dynamic, pool, ...
            attention[which] = 0.0
            t0 = time.perf_counter()
            for _ in range(args.steps):
                if which == "pool":
                    pool.forward(model, [[5]], [kvpool.Row(0, cached, 1)])
                    cached += 1
                else:
                    baseline(input_ids=torch.tensor([[5]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            forward_ms[which].append((time.perf_counter() - t0) / args.steps * 1000)
            attention_ms[which].append(attention[which] / args.steps * 1000)

    print(f"SmolLM2 fp32, 1 thread, {args.prompt}-token prompt, median of {args.blocks} blocks of {args.steps} steps")
    print(f"{'ms per decode step':<44}{'DynamicCache (baseline)':>24}{'KV pool':>12}")
    for label, figures in (("whole forward", forward_ms), ("attention with its cache writes", attention_ms)):
        print(f"{label:<44}{statistics.median(figures['dynamic']):>24.2f}{statistics.median(figures['pool']):>12.2f}")


if __name__ == "__main__":
    main()
