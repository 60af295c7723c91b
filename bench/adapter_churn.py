"""Where does memory go when many users' adapters come and go? The torch engine alone, SmolLM2.

    python bench/adapter_churn.py --phase loads     # adapters loaded from files and dropped, 16 kept
    python bench/adapter_churn.py --phase mix       # 8 streams of 8 different users' adapters at once

A diagnostic for issue 32 §2 (`python bench/multi_adapter.py --model smollm2` grew `clawbridge up`
from 2.4 to 6.0 GB with 16 users' adapters resident, for about 0.6 GB of adapter tensors). Each
phase isolates one thing `up` does during that run, in one process with glibc's mmap threshold
fixed at 1 MiB as `up` fixes it (`clawbridge_local.malloc`):

- `loads`: `--users` random rank-`--rank` adapters (the default target modules) are written as
  peft-named safetensors files, as checkpoints hold them; then `--loads` times a user not loaded is
  read from its file on a worker thread (`LoraAdapter.from_safetensors`, as
  `LocalTrainer.checkpoint_update` does), loaded beside the base (`TorchEngine.load_version`), and
  answers one 8-token call; past 16 loaded, the least recently loaded is dropped. Prints RSS, the
  bytes of live tensor storage (every tensor the garbage collector sees, each storage once) and the
  KV pool's positions written so far every 20 loads: RSS that grows while live storage does not is
  either the preallocated KV pool being written (resident as first written, up to its budget) or
  the allocator keeping freed memory.
- `mix`: 16 adapters loaded, then `--rounds` rounds of 8 concurrent streams of 8 random users
  (4 to 25 tokens each, so the mix of adapters in a decode step changes as streams end). Prints RSS
  every 5 rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "backends" / "local"))

import torch  # noqa: E402
from bench_common import rss_mib  # noqa: E402
from clawbridge_local.engine import TorchEngine  # noqa: E402
from clawbridge_local.lora_serving import LoraAdapter  # noqa: E402
from clawbridge_local.malloc import fix_mmap_threshold  # noqa: E402
from multi_adapter import random_peft_tensors  # noqa: E402

from clawbridge.config import LORA_TARGET_MODULES  # noqa: E402
from clawbridge.models import cached_model  # noqa: E402
from clawbridge.serving.sampler import Sampler, SamplingParams  # noqa: E402

KEEP = 16
"""Adapters kept loaded (`max_user_adapters`' default)."""


def peft_tensors(model: torch.nn.Module, seed: int, rank: int) -> dict[str, torch.Tensor]:
    """A random adapter of `rank` on the default target modules, peft-named as a checkpoint holds it."""
    return random_peft_tensors(model, seed, rank, list(LORA_TARGET_MODULES))


def live_storage_mib() -> float:
    """Bytes of every tensor storage the garbage collector sees, each once."""
    gc.collect()
    storages = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values()) / 2**20


def pool_written_mib(engine: TorchEngine) -> float:
    """The KV pool's positions written so far (its high-water mark), in MiB: the part of the pool's
    preallocated storage that is resident (a position's pages are committed when first written)."""
    pool = engine.pool
    per_token = sum(t[:, :1].nbytes for t in (*pool.keys, *pool.values))
    return pool.high_water_tokens * per_token / 2**20


async def call(sampler: Sampler, seed: int, tokens: int) -> int:
    stream = await sampler.sample([1, 2, 3, *range(100, 130)], SamplingParams(max_tokens=tokens, seed=seed,
                                                                             stop_token_ids=()))
    return len([t async for t in stream])


async def loads(engine: TorchEngine, model: Any, args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    folder = Path(tempfile.mkdtemp(prefix="clawbridge-churn-"))
    for u in range(args.users):
        save_file(peft_tensors(model, u, args.rank), str(folder / f"u{u}.safetensors"))
    size = os.path.getsize(folder / "u0.safetensors") / 2**20
    print(f"engine loaded: RSS {rss_mib():.0f} MiB; one adapter file {size:.1f} MiB", flush=True)
    loaded: dict[int, Sampler] = {}
    rng = random.Random(0)
    for k in range(1, args.loads + 1):
        u = rng.choice([x for x in range(args.users) if x not in loaded])

        def read(u: int = u) -> LoraAdapter:
            return LoraAdapter.from_safetensors(folder / f"u{u}.safetensors", 1.0, f"user {u}")

        loaded[u] = await engine.load_version(await asyncio.to_thread(read), 10 + u)
        while len(loaded) > KEEP:
            loaded.pop(next(iter(loaded)))
        await call(loaded[u], k, 8)
        if k % 20 == 0:
            print(f"loads {k}: RSS {rss_mib():.0f} MiB, live tensor storage {live_storage_mib():.0f} MiB, "
                  f"KV pool written so far {pool_written_mib(engine):.0f} MiB", flush=True)


async def mix(engine: TorchEngine, model: Any, args: argparse.Namespace) -> None:
    samplers = [await engine.load_version(LoraAdapter.from_peft(peft_tensors(model, u, args.rank), 1.0, f"user {u}"),
                                          10 + u) for u in range(KEEP)]
    print(f"{KEEP} adapters loaded: RSS {rss_mib():.0f} MiB", flush=True)
    rng = random.Random(0)
    for r in range(1, args.rounds + 1):
        users = rng.sample(range(KEEP), 8)
        await asyncio.gather(*(call(samplers[u], r * 10 + k, 4 + 3 * k) for k, u in enumerate(users)))
        if r % 5 == 0:
            print(f"round {r} (8 streams of 8 users): RSS {rss_mib():.0f} MiB, "
                  f"KV pool written so far {pool_written_mib(engine):.0f} MiB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=["loads", "mix"], default="loads")
    ap.add_argument("--users", type=int, default=48, help="loads: users with an adapter file")
    ap.add_argument("--loads", type=int, default=140)
    ap.add_argument("--rounds", type=int, default=30, help="mix: rounds of 8 streams")
    ap.add_argument("--rank", type=int, default=32, help="LoRA rank (the default lora_rank)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    fix_mmap_threshold(1024 * 1024)
    engine = TorchEngine.load(str(cached_model("smollm2-135m-instruct")), device="cpu", dtype="float32",
                              max_running=8, progress=False)
    try:
        asyncio.run((loads if args.phase == "loads" else mix)(engine, engine._current.model, args))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
