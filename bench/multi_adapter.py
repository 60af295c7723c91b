"""Many adapters over one base in the torch engine: what each loaded adapter costs, and decode when
every stream of a batch runs a different adapter (issue 21 §2: one engine serves every user's adapter).

Measured, in one process, OMP_NUM_THREADS=1, on SmolLM2-135M-Instruct fp32 (`--model tiny`: the
tiny model, to check that it runs):

- memory: the engine's RSS after loading, then after each of `--adapters` LoRA versions (rank
  `--rank` on the default target modules: every attention and MLP projection and lm_head, random
  weights) is loaded beside the published one (`TorchEngine.load_version`); the growth per adapter
  against the adapter's own tensor bytes (`LoraAdapter.nbytes`).
- decode: `--streams` concurrent streams of `--tokens` tokens (sampled, seeded), wall time from
  the first request to the last token, three ways in the same run, interleaved over `--rounds`:
  the base alone (no adapter), every stream on the same adapter (the baseline: one version per
  batch), and every stream on its own adapter (one decode forward whose rows add different
  adapters, `lora_serving.AdapterHooks`). Median of the rounds.

Run (about 2-3 minutes on 2 shared cores):
    . .venv/bin/activate && python bench/multi_adapter.py
    python bench/multi_adapter.py --model tiny --rounds 1      # quick
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from bench_common import model_folder, rss_mib  # noqa: E402
from clawbridge_local.engine import TorchEngine  # noqa: E402
from clawbridge_local.lora_serving import LoraAdapter  # noqa: E402

from clawbridge.config import LORA_TARGET_MODULES  # noqa: E402
from clawbridge.sampler import Sampler, SamplingParams  # noqa: E402


def random_adapter(model: torch.nn.Module, seed: int, rank: int, targets: list[str]) -> LoraAdapter:
    """A LoRA adapter of `rank` on every linear module whose name ends with one of `targets`."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules():
        weight = getattr(mod, "weight", None)
        if name.split(".")[-1] not in targets or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        out_f, in_f = weight.shape
        tensors[f"base_model.model.{name}.lora_A.default.weight"] = torch.randn(rank, in_f, generator=gen) * 0.02
        tensors[f"base_model.model.{name}.lora_B.default.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
    return LoraAdapter.from_peft(tensors, 2.0, f"random adapter {seed}")


async def decode(samplers: list[Sampler], tokens: int) -> float:
    """Tokens/s of one stream per sampler, all at once."""

    async def one(i: int, sampler: Sampler) -> int:
        stream = await sampler.sample([1, 2, 3 + i, *range(100, 116)], SamplingParams(max_tokens=tokens, seed=i,
                                                                                    stop_token_ids=()))
        return len([t async for t in stream])

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, s) for i, s in enumerate(samplers)))
    return sum(counts) / (time.perf_counter() - t0)


async def run(model_dir: str, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    engine = TorchEngine.load(model_dir, device="cpu", dtype="float32", max_running=args.streams, progress=False)
    try:
        model: Any = engine._current.model
        targets = list(LORA_TARGET_MODULES)
        loaded_rss = rss_mib()
        adapters = [random_adapter(model, seed, args.rank, targets) for seed in range(args.adapters + 1)]
        await engine.swap_weights(adapters[0], 1)
        kept: list[Sampler] = []
        for i, adapter in enumerate(adapters[1:]):
            kept.append(await engine.load_version(adapter, 2 + i))
        after_rss = rss_mib()
        per_adapter = (after_rss - loaded_rss) / (args.adapters + 1)  # made and loaded (placing copies nothing)
        nbytes = adapters[0].nbytes / 2**20
        base = await engine.load_version(LoraAdapter(adapters[0].down, {k: torch.zeros_like(v) for k, v in
                                                                        adapters[0].up.items()}), 0)
        runs: dict[str, list[float]] = {"base": [], "same": [], "mixed": []}
        for _ in range(args.rounds):
            runs["base"].append(await decode([base] * args.streams, args.tokens))
            runs["same"].append(await decode([engine] * args.streams, args.tokens))
            runs["mixed"].append(await decode([kept[i % len(kept)] for i in range(args.streams)], args.tokens))
        med = {k: statistics.median(v) for k, v in runs.items()}
        distinct = min(args.streams, len(kept))
        return [
            ("engine RSS after load", f"{loaded_rss:.0f} MiB", ""),
            (f"RSS per loaded adapter (rank {args.rank}, {len(adapters[0].down)} modules), "
             f"{args.adapters + 1} loaded", f"{per_adapter:.1f} MiB", f"its tensors: {nbytes:.1f} MiB"),
            (f"decode tokens/s, {args.streams} streams x {args.tokens}: the base, no adapter", f"{med['base']:.1f}",
             ""),
            ("  every stream on the same adapter (baseline)", f"{med['same']:.1f}", "1.00x"),
            (f"  every stream on its own adapter ({distinct} adapters in each forward)", f"{med['mixed']:.1f}",
             f"{med['mixed'] / med['same']:.2f}x"),
        ]
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--adapters", type=int, default=8, help="adapters loaded beside the published one")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_folder(args.model, tmp)
        rows = asyncio.run(run(model_dir, args))
    print(f"\nmodel {args.model}, torch {torch.__version__}, OMP_NUM_THREADS=1, {args.rounds} round(s)")
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>10}  {note}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
