"""Torch engine decode speed by CPU thread count: 1, half the cores, all cores (torch's default).

Each thread count runs in a fresh process (OMP_NUM_THREADS set before torch loads, so no OpenMP
pool from an earlier run spins in the background), on the same model and workload:
- `1 stream`: one request of `--tokens` tokens;
- `N concurrent`: `--concurrency` requests of `--tokens` tokens at once (the engine batches them).
Every request samples exactly `--tokens` tokens (no stop token), seeded. Printed: wall seconds and
tokens/s per thread count, and each one's speed relative to all cores (torch's default, the
baseline) in the same run. `engine_threads = 0` (auto) picks what this measured best on a busy
machine: one thread per two cores.

Measured on the shared 2-core machine (busy with other work), `python bench/engine_threads.py`:
1 thread 29.8 tok/s for one stream and 27.3 tok/s for 16 concurrent, 4.2x and 4.3x torch's default
of 2 threads (7.0 and 6.3 tok/s).

Run (about 9 minutes on 2 busy CPU cores, most of it the slow all-cores run):
    . .venv/bin/activate && python bench/engine_threads.py
    python bench/engine_threads.py --model tiny --tokens 64 --concurrency 8    # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def worker(model_dir: str, tokens: int, concurrency: int) -> dict[str, float]:
    """Run in a process whose OMP_NUM_THREADS is already set: time both workloads."""
    import torch
    from clawbridge_local.engine import TorchEngine

    from clawbridge.serving.sampler import SamplingParams

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    engine = TorchEngine.load(model_dir, device="cpu", dtype="float32", max_running=concurrency, progress=False)
    prompt = list(range(10, 42))

    async def one(seed: int) -> int:
        stream = await engine.sample(prompt, SamplingParams(max_tokens=tokens, seed=seed))
        return sum([1 async for _ in stream])

    async def run(n: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - t0, sum(counts)

    try:
        asyncio.run(run(1))  # warm-up
        single_s, single_n = asyncio.run(run(1))
        conc_s, conc_n = asyncio.run(run(concurrency))
    finally:
        engine.shutdown()
    return {"single_s": single_s, "single_tok_s": single_n / single_s, "conc_s": conc_s, "conc_tok_s": conc_n / conc_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "small"], default="small")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.tokens, args.concurrency)))
        return

    from bench_common import model_specs

    from clawbridge.devtools.tinymodel import build_tiny_model

    cores = os.cpu_count() or 1
    counts = sorted({1, max(1, cores // 2), cores})
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / args.model, seed=0, spec=model_specs()[args.model])
        results: dict[int, dict[str, float]] = {}
        for n in counts:
            env = {**os.environ, "OMP_NUM_THREADS": str(n)}
            out = subprocess.run([sys.executable, __file__, "--worker", str(model_dir), "--tokens", str(args.tokens),
                                  "--concurrency", str(args.concurrency)], env=env, capture_output=True, text=True,
                                 check=True)
            results[n] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results[cores]
    print(f"model {args.model}, {args.tokens} tokens per request, {cores} cores; baseline: {cores} threads "
          "(torch's default)")
    print(f"{'threads':>8} {'1 stream s':>11} {'tok/s':>8} {'vs base':>8} {args.concurrency:>3} concurrent s "
          f"{'tok/s':>8} {'vs base':>8}")
    for n, r in results.items():
        print(f"{n:>8} {r['single_s']:>11.2f} {r['single_tok_s']:>8.1f} {r['single_tok_s'] / base['single_tok_s']:>7.2f}x "
              f"{r['conc_s']:>16.2f} {r['conc_tok_s']:>8.1f} {r['conc_tok_s'] / base['conc_tok_s']:>7.2f}x")
    best = max(results, key=lambda n: results[n]["conc_tok_s"])
    print(f"fastest under concurrent load: {best} thread(s)")


if __name__ == "__main__":
    main()
