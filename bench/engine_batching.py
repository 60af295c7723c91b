"""Torch engine decode speed with batched decoding (`engine_batch_decode`, the default) against
unbatched (the baseline), on the same model, prompts and seeds in the same run.

`--concurrency` requests of `--tokens` sampled tokens each (no stop token) run at once, first with
`batch_decode=False`, then True, one thread (`engine_threads` auto on 2 cores). Printed: wall
seconds, tokens/s, the speed-up, and the largest difference between the two runs' logprobs of the
tokens both sampled at the same position before their first difference (batching changes float
summation order only).

Run (SmolLM2-135M-Instruct from the model cache, `clawbridge model get`; or the tiny model):
    . .venv/bin/activate && python bench/engine_batching.py --model smollm2
    python bench/engine_batching.py --model tiny
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(model_dir: str, batch: bool, tokens: int, concurrency: int, device: str = "cpu",
            dtype: str = "float32") -> tuple[float, list[list[tuple[int, float]]]]:
    """Wall seconds and per-request (token, logprob) lists of `concurrency` requests decoded at once."""
    from clawbridge_local.engine import TorchEngine

    from clawbridge.serving.sampler import SamplingParams

    engine = TorchEngine.load(model_dir, device=device, dtype=dtype, max_running=concurrency, progress=False,
                              batch_decode=batch, max_queued=max(64, concurrency))
    prompts = [list(range(10 + i, 30 + 3 * i)) for i in range(concurrency)]  # different lengths: padding is real

    async def one(i: int) -> list[tuple[int, float]]:
        stream = await engine.sample(prompts[i], SamplingParams(max_tokens=tokens, seed=i))
        return [(t.token_id, t.logprob) async for t in stream]

    async def run() -> list[list[tuple[int, float]]]:
        return list(await asyncio.gather(*(one(i) for i in range(concurrency))))

    try:
        t0 = time.perf_counter()
        lps = asyncio.run(run())
        return time.perf_counter() - t0, lps
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            from clawbridge.devtools.tinymodel import build_tiny_model

            model_dir = str(build_tiny_model(Path(tmp) / "tiny", seed=0))
        else:
            from clawbridge.models import cached_model

            model_dir = str(cached_model("smollm2-135m-instruct"))
        base_s, base_lps = measure(model_dir, False, args.tokens, args.concurrency)
        batch_s, batch_lps = measure(model_dir, True, args.tokens, args.concurrency)
    n = args.tokens * args.concurrency
    diff = 0.0
    for a, b in zip(base_lps, batch_lps, strict=True):
        for (ta, x), (tb, y) in zip(a, b, strict=True):
            if ta != tb:
                break
            diff = max(diff, abs(x - y))
    print(f"model {args.model}, {args.concurrency} concurrent requests x {args.tokens} tokens, {args.threads} thread(s)")
    print(f"unbatched (baseline): {base_s:7.2f} s  {n / base_s:7.1f} tok/s")
    print(f"batched:              {batch_s:7.2f} s  {n / batch_s:7.1f} tok/s  ({base_s / batch_s:.2f}x)")
    print(f"largest logprob difference between the runs: {diff:.1e}")


if __name__ == "__main__":
    main()
