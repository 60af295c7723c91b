"""The GPU kit's training parts: `train` (the trainer against the plain transformers/peft loop,
with both MFUs), `publish` (train step to the first token of the new version, against a reload),
`demo` (the tiny demo through `clawbridge up`) and `fsdp-N`; docs/gpu-kit.md says what each row
measures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kit_common import PEAK_BF16_TFLOPS, Kit, Row, Skip, attempt, bench_module

# ---------------------------------------------------------------------------------------------- train


def mfu(kit: Kit, n_params: int, tokens_per_s: float, lora: bool) -> str:
    """Model FLOPs utilization: 6N per token for full training, 4N for LoRA (no weight gradients of
    the frozen base), attention FLOPs and recomputed activations left out; against the GPU's dense
    bf16 peak."""
    if not kit.cuda:
        return "MFU n/a (cpu)"
    import torch

    peak = kit.peak_tflops
    if peak is None:
        name = torch.cuda.get_device_name(kit.device)
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
        if peak is None:
            return f"MFU n/a (peak of {name!r} unknown: --peak-tflops)"
    return f"MFU {100 * (4 if lora else 6) * n_params * tokens_per_s / (peak * 1e12):.1f}%"


def train_rows(kit: Kit, shape: str, world: int = 1) -> Iterator[Row]:
    """Trainer tokens/s against the plain transformers/peft loop, same batch, each alone in memory."""
    from clawbridge.devtools.shapes import SHAPES, count_parameters

    tt = bench_module("train_throughput")
    model_dir = kit.shape_dir(shape)
    n_params = count_parameters(SHAPES[shape]) if not kit.quick else _count(model_dir)
    batch_n, plen, clen, steps = (4, 16, 16, 2) if kit.quick else (8, 256, 256, 10)
    batch = tt.make_batch(model_dir, batch_n, plen, clen, device=kit.device)
    tokens = sum(len(d.tokens) - 1 for d in batch)
    loss = tt.LossConfig("importance_sampling")
    kit.free()

    def timed(step: Callable[[Any, Any], float]) -> float:
        step(batch, loss)  # warm-up
        secs = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step(batch, loss)
            kit.sync()
            secs.append(time.perf_counter() - t0)
        return tokens / statistics.median(secs)

    for lora in (tt.LORA, None):
        mode = f"LoRA r{tt.LORA.rank}" if lora else "full"

        def one(lora: Any = lora, mode: str = mode) -> Iterator[Row]:
            base = None
            if world == 1:
                plain = tt.PlainLoop(model_dir, lora, device=kit.device)
                try:
                    base = timed(plain.step)
                finally:
                    del plain
                    kit.free()
            with tempfile.TemporaryDirectory(dir=kit.work) as tmp:
                runner = tt.fsdp_runner(f"fsdp-{world}", model_dir, Path(tmp), lora, world,
                                        int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
                try:
                    tps = timed(runner.step)
                    kept = runner.metrics.get("activation_checkpointing") == 0.0
                finally:
                    runner.close()
                    kit.free()
            how = "in-process trainer (world 1, no FSDP wrap)" if world == 1 else f"FSDP2 world {world}"
            total = tps * world if world > 1 else tps
            yield Row("train", f"{kit.label(shape)} {mode}, {kit.dtype}, {how}, {tokens} tokens/step, activations "
                      f"{'kept' if kept else 'recomputed'} (auto)", f"{tps:,.0f} tok/s, {mfu(kit, n_params, total, bool(lora))}",
                      f"plain loop {base:,.0f} tok/s, {mfu(kit, n_params, base, bool(lora))} ({tps / base:.2f}x)"
                      if base else "world 1 rows above")

        yield from attempt("train", f"{shape} {mode}", one)


def _count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for k in f.keys():  # noqa: SIM118
            n = 1
            for d in f.get_slice(k).get_shape():
                n *= d
            total += n
    return total


# -------------------------------------------------------------------------------------------- publish


def publish_rows(kit: Kit) -> Iterator[Row]:
    pl = bench_module("publish_latency")
    model_dir = kit.shape_dir("qwen3-0.6b")
    args = argparse.Namespace(publishes=2 if kit.quick else 3, device=kit.device, dtype=kit.dtype)
    for rank in (8, 0):
        def one(rank: int = rank) -> Iterator[Row]:
            t = asyncio.run(pl.bench_mode(model_dir, rank, args))
            p, r = statistics.median(t["publish"]), statistics.median(t["reload"])
            yield Row("publish", f"{kit.label('qwen3-0.6b')} {'LoRA r8' if rank else 'full'}: train step -> first "
                      f"token of the new version, median of {args.publishes}",
                      f"{1e3 * p:,.0f} ms (with a stream in flight {1e3 * statistics.median(t['publish+stream']):,.0f})",
                      f"reload {1e3 * r:,.0f} ms ({r / p:.1f}x)")
            kit.free()

        yield from attempt("publish", "LoRA r8" if rank else "full", one)


# ----------------------------------------------------------------------------------------------- demo


def demo_rows(kit: Kit) -> Iterator[Row]:
    from clawbridge.devtools.demo import DemoConfig, run_demo

    for rank in (8, 0):
        mode = f"LoRA r{rank}" if rank else "full"

        def one(rank: int = rank, mode: str = mode) -> Iterator[Row]:
            cfg = DemoConfig(sessions=32 if kit.quick else 240, lora_rank=rank, seed=0, settings={
                "CLAWBRIDGE_LOCAL_ENGINE": "torch", "CLAWBRIDGE_LOCAL_DEVICE": kit.device,
                "CLAWBRIDGE_LOCAL_DTYPE": kit.dtype})
            res = run_demo(cfg, kit.work / f"demo-{rank}")
            first, last = res.head_tail()
            versions = max(e.policy_version for e in res.episodes)
            yield Row("demo", f"tiny demo via clawbridge up, {mode}, {kit.dtype}",
                      f"reward {last:.3f} (last 20%), {versions} versions, {res.seconds:.0f}s", f"first 20% {first:.3f}")

        yield from attempt("demo", mode, one)


def gpu_count(kit: Kit) -> int:
    if not kit.cuda:
        return 0
    import torch

    return torch.cuda.device_count()


def multi_gpu_rows(kit: Kit) -> Iterator[Row]:
    n = gpu_count(kit)
    if n < 2:
        raise Skip(f"{n} GPU(s) visible; multi-GPU FSDP needs 2 or more")
    yield from train_rows(kit, "qwen3-0.6b", world=n)


