"""Publish latency of the local backend: from the end of a train step to the first token served
by the new version, LoRA and full fine-tuning, against a from_pretrained reload in the same run.

For each publish (after a real `LocalBackend.train_step` on CPU):
- `publish`: `await LocalBackend.publish()` (trainer export -> state dict, LoRA merged in float32
  -> `TorchEngine.swap_weights`), then a new stream's first greedy token; the stream must report
  the new version. Timed from the moment the train step returned.
- `publish+stream`: the same while an older stream is still decoding, so the engine must keep the
  old weights for it and deep-copies the model before updating (the costly path of the swap).
- `reload` (baseline): export the same trained weights, load them with `from_pretrained` (full:
  the exported folder; LoRA: the base folder + `PeftModel.from_pretrained(adapter)` +
  `merge_and_unload()`), build a fresh `TorchEngine` on the result and take its first token.
  It leaves out process start and imports, so it is a lower bound for "restart with new weights".
The order of `publish` and `reload` alternates between iterations. p50/min/max over `--publishes`.

Threads: OMP_NUM_THREADS is set to `--threads` (default 1: on a shared 2-core machine, decoding the
tiny models with 2 OpenMP threads was up to 20x slower from spin-waiting) before torch loads.

Run (about 1 minute on 2 CPU cores):
    . .venv/bin/activate && python bench/publish_latency.py
    python bench/publish_latency.py --model tiny --publishes 3    # quicker
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_common import model_specs, set_threads_from_argv  # noqa: E402

set_threads_from_argv(default=1)

import torch  # noqa: E402
from clawbridge_local.backend import LocalBackend  # noqa: E402
from clawbridge_local.engine import TorchEngine  # noqa: E402

from clawbridge.backend import Datum, LossConfig  # noqa: E402
from clawbridge.config import Settings  # noqa: E402
from clawbridge.devtools.tinymodel import build_tiny_model  # noqa: E402
from clawbridge.serving.sampler import SamplingParams  # noqa: E402

MODEL_SPECS = model_specs()
PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)
GREEDY1 = SamplingParams(max_tokens=1, temperature=0.0)


async def first_token(engine: TorchEngine) -> int:
    """Start a greedy stream, read its first token, close it; return the stream's version."""
    stream = await engine.sample(PROMPT, GREEDY1)
    async for _ in stream:
        break
    await stream.aclose()
    return stream.policy_version


def reload_engine(backend: LocalBackend, model_dir: Path, export_root: Path, lora: bool, device: str = "cpu",
                  dtype: str = "float32") -> TorchEngine:
    """The baseline: export, from_pretrained the export, a fresh engine on it (blocking)."""
    from transformers import AutoModelForCausalLM

    trainer = backend._trainer
    assert trainer is not None
    export = trainer.client.export_weights(export_root, name="reload")
    model: Any
    if lora:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
        model = PeftModel.from_pretrained(base, str(export)).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, local_files_only=True)
    return TorchEngine(model.to(device, getattr(torch, dtype)).eval(), max_running=4, max_queued=4)


def summary(xs: list[float]) -> str:
    return f"p50 {1e3 * statistics.median(xs):8.1f} ms   min {1e3 * min(xs):8.1f}   max {1e3 * max(xs):8.1f}"


async def bench_mode(model_dir: Path, lora_rank: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Publish timings (seconds) of one mode: {"publish", "publish+stream", "reload"}; printed too.
    `args.device` / `args.dtype` (optional; default cpu / float32) place the torch engine."""
    label = f"LoRA r={lora_rank}" if lora_rank else "full fine-tuning"
    with tempfile.TemporaryDirectory() as state:
        settings = Settings.model_validate(
            {
                "model": str(model_dir),
                "state_dir": state,
                "backends": {"local": {"engine": "torch", "device": getattr(args, "device", "cpu"),
                                        "dtype": getattr(args, "dtype", "float32"), "max_running_requests": 4}},
                "lora_rank": lora_rank,
                "lora_alpha": 16.0,
                "learning_rate": 1e-4,
            }
        )
        backend = LocalBackend(settings, progress=False)
        await backend.start()
        engine = backend.sampler()
        # A small on-policy batch from what the engine samples.
        batch: list[Datum] = []
        for i in range(4):
            prompt = [*PROMPT[: 4 + i], 50 + i]
            stream = await engine.sample(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=i))
            toks = [t async for t in stream]
            batch.append(
                Datum.from_turn(
                    prompt, [t.token_id for t in toks], [t.logprob for t in toks], [1.0] * len(toks), 0
                )
            )
        publish: list[float] = []
        publish_busy: list[float] = []
        reload: list[float] = []
        try:
            for i in range(args.publishes):
                await backend.train_step(batch, LossConfig())
                order = ("publish", "reload") if i % 2 == 0 else ("reload", "publish")
                for what in order:
                    t0 = time.perf_counter()
                    if what == "publish":
                        version = await backend.publish()
                        assert await first_token(engine) == version
                        publish.append(time.perf_counter() - t0)
                    else:
                        fresh = await asyncio.to_thread(
                            reload_engine, backend, model_dir, Path(state) / "reload", bool(lora_rank),
                            getattr(args, "device", "cpu"), getattr(args, "dtype", "float32"),
                        )
                        await first_token(fresh)
                        reload.append(time.perf_counter() - t0)
                        fresh.shutdown()
                # The copy path: an old stream still decodes while the new weights go in.
                await backend.train_step(batch, LossConfig())
                old = await engine.sample(PROMPT, SamplingParams(max_tokens=100_000, temperature=0.0))
                async for _ in old:
                    break
                t0 = time.perf_counter()
                version = await backend.publish()
                assert await first_token(engine) == version
                publish_busy.append(time.perf_counter() - t0)
                assert old.policy_version == version - 1
                await old.aclose()
        finally:
            await backend.close()
    p, r = statistics.median(publish), statistics.median(reload)
    print(f"\n== {label} ({args.publishes} publishes each)")
    print(f"  publish          {summary(publish)}")
    print(f"  publish+stream   {summary(publish_busy)}")
    print(f"  reload baseline  {summary(reload)}")
    print(f"  publish is {r / p:.1f}x faster than reload (p50)")
    return {"publish": publish, "publish+stream": publish_busy, "reload": reload}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODEL_SPECS), default="small")
    ap.add_argument("--publishes", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS / torch threads")
    ap.add_argument("--mode", choices=["full", "lora", "both"], default="both")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", spec=MODEL_SPECS[args.model])
        from safetensors.torch import load_file

        n = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
        print(
            f"model {args.model}: {n / 1e6:.2f}M parameters; torch {torch.__version__}; "
            f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; in-process trainer (world size 1)"
        )
        if args.mode in ("full", "both"):
            asyncio.run(bench_mode(model_dir, 0, args))
        if args.mode in ("lora", "both"):
            asyncio.run(bench_mode(model_dir, 8, args))
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
