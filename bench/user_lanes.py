"""What each user's own adapter costs with `per_user_adapters` (issue 21 §4: memory per user stated).

In one process (OMP_NUM_THREADS=1), the local backend serving SmolLM2-135M-Instruct fp32 with LoRA
rank `--rank` (`--model tiny`: the tiny model, to check that it runs):

1. baseline: the shared policy's in-process LoRA trainer (what one clawbridge trains today) runs one
   step of `--datums` datums and publishes it; its RSS growth is the cost of one trained policy;
2. then `--users` user lanes (`LocalBackend.user_lane`), each running one step on its own datums and
   publishing its adapter beside the others (`TorchEngine.load_version`); the RSS growth per lane
   (median and max) against the baseline's.

Then one decode request per user, each answered by that user's adapter, checks that they all serve.

Run (about 2 minutes on 2 shared cores):
    . .venv/bin/activate && python bench/user_lanes.py
    python bench/user_lanes.py --model tiny --users 3      # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from bench_common import model_folder, rss_mib  # noqa: E402
from clawbridge_local.backend import LocalBackend  # noqa: E402

from clawbridge.backend import Datum, LossConfig  # noqa: E402
from clawbridge.config import Settings  # noqa: E402
from clawbridge.serving.sampler import SamplingParams  # noqa: E402


def batch(seed: int, n: int, vocab: int) -> list[Datum]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(100, vocab) for _ in range(48)]
        completion = [rng.randrange(100, vocab) for _ in range(16)]
        out.append(Datum.from_turn(prompt, completion, [-2.0] * 16, [rng.choice((-1.0, 1.0))] * 16, 0))
    return out


async def run(model_dir: str, state: Path, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    settings = Settings(model=model_dir, state_dir=str(state), lora_rank=args.rank, per_user_adapters=True,
                        max_user_adapters=args.users, backends={"local": {"engine": "torch", "engine_threads": 1}})
    backend = LocalBackend(settings, progress=False)
    await backend.start()
    try:
        vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
        loss = LossConfig()
        start = rss_mib()
        t0 = time.perf_counter()
        await backend.train_step(batch(0, args.datums, vocab), loss)
        await backend.publish(1)
        shared = rss_mib() - start
        shared_s = time.perf_counter() - t0
        growth, seconds, lanes = [], [], []
        for i in range(args.users):
            before = rss_mib()
            t0 = time.perf_counter()
            lane = backend.user_lane(f"user{i}")
            await lane.train_step(batch(i + 1, args.datums, vocab), loss)
            await lane.publish(2 + i)
            seconds.append(time.perf_counter() - t0)
            growth.append(rss_mib() - before)
            lanes.append(lane)
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
        served = []
        for lane in lanes:
            stream = await lane.sampler().sample([1, 2, 3], params)
            served.append(stream.policy_version)
            async for _ in stream:
                pass
        assert served == list(range(2, 2 + args.users)), served
        for lane in lanes:
            await lane.close()
        return [
            ("engine RSS after load", f"{start:.0f} MiB", ""),
            (f"baseline: the shared LoRA trainer's first step + publish ({args.datums} datums)", f"{shared:.0f} MiB",
             f"{shared_s:.1f} s"),
            (f"each user lane's first step + publish ({args.users} users): median", f"{statistics.median(growth):.0f} MiB",
             f"{statistics.median(seconds):.1f} s; {statistics.median(growth) / shared:.2f}x the baseline"),
            ("  max", f"{max(growth):.0f} MiB", "each, in order: " + " ".join(f"{g:.0f}" for g in growth)),
            (f"all {args.users} users together", f"{sum(growth):.0f} MiB", f"{sum(growth) / args.users:.0f} MiB per user"),
            (f"RSS with the shared policy and {args.users} users trained and served", f"{rss_mib():.0f} MiB",
             f"every user answered by their own version: {served == list(range(2, 2 + args.users))}"),
        ]
    finally:
        await backend.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--datums", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_folder(args.model, tmp)
        rows = asyncio.run(run(model_dir, Path(tmp) / "state", args))
    print(f"\nmodel {args.model}, LoRA rank {args.rank}, torch {torch.__version__}, OMP_NUM_THREADS=1")
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>9}  {note}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
