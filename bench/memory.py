"""Peak memory (RSS) of the local backend's trainer and engine, against a plain loop, same run.

Each measurement runs in its own fresh Python process (`--child NAME`), one at a time, so peaks do
not mix. A child reports its RSS after importing torch/transformers/peft (the floor every process
pays) and its peak RSS (`VmHWM` from /proc/self/status) at the end; the table shows both and the
difference (what the model, optimizer, activations and caches added). For the torchrun group the
child reads `VmHWM` of every rank process (FSDP2, gloo, 2 ranks) just before shutting it down.

Measured (same model and batch as bench/train_throughput.py, 3 optimizer steps):
- plain-full / plain-lora: the baseline loop of bench/train_throughput.py (transformers + peft).
- trainer-1-full / trainer-1-lora: `FsdpTrainerClient` in-process (world size 1).
- trainer-2-full / trainer-2-lora: `FsdpTrainerClient` under torchrun, per rank.
- engine: `TorchEngine` serving 4 concurrent greedy streams of 64 tokens.
- engine-swap: the same, plus a publish while a stream is in flight (the engine holds two copies).
- backend-lora: the whole `LocalBackend` in one process as `clawbridge up` runs it (engine +
  in-process LoRA trainer + kept base weights for merging), 3 train steps and publishes.
tracemalloc is not used: torch allocates tensor memory outside Python's allocator, so it would
not see the model, gradients or optimizer state.

Threads: OMP_NUM_THREADS=1 in every child (each torchrun rank too); memory does not depend on it.

Run (about 1-2 minutes on 2 CPU cores; Linux only, reads /proc):
    . .venv/bin/activate && python bench/memory.py
    python bench/memory.py --model tiny --no-torchrun    # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ["OMP_NUM_THREADS"] = "1"

STEPS = 3
CHILDREN = (
    "plain-full",
    "trainer-1-full",
    "trainer-2-full",
    "plain-lora",
    "trainer-1-lora",
    "trainer-2-lora",
    "engine",
    "engine-swap",
    "backend-lora",
)


def proc_kb(field: str, pid: int | str = "self") -> int:
    """A `kB` field (VmRSS, VmHWM) of /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


# ------------------------------------------------------------------------------------------ children


def child(name: str, model_dir: Path, batch_file: Path, work: Path) -> dict[str, Any]:
    """Run one measurement in this process; return what to print."""
    import asyncio

    import peft  # noqa: F401 - part of the import floor
    import torch
    import transformers  # noqa: F401
    from clawbridge_local.trainer.batch import read_batch
    from clawbridge_local.trainer.client import FsdpTrainerClient
    from train_throughput import LORA, PlainLoop, trainer_config

    from clawbridge.backend import LossConfig

    torch.set_num_threads(1)
    floor = proc_kb("VmRSS")  # after imports, before any model exists
    batch = read_batch(batch_file)
    lora = LORA if name.endswith("lora") else None
    loss = LossConfig()
    out: dict[str, Any] = {"name": name, "floor_kb": floor}
    if name.startswith("plain"):
        plain = PlainLoop(model_dir, lora)
        for _ in range(STEPS):
            plain.step(batch, loss)
    elif name.startswith("trainer"):
        world = int(name.split("-")[1])
        client = FsdpTrainerClient(trainer_config(model_dir, lora), work, launcher="inprocess" if world == 1 else "torchrun")
        client.start(world)
        for _ in range(STEPS):
            client.train_step(batch, loss)
        if world > 1:
            import psutil

            assert client._proc is not None
            ranks = [
                p
                for p in psutil.Process(client._proc.pid).children(recursive=True)
                if "clawbridge_local.trainer.worker" in " ".join(p.cmdline())
            ]
            out["ranks_kb"] = sorted(proc_kb("VmHWM", p.pid) for p in ranks)
        client.close()
    elif name.startswith("engine"):
        asyncio.run(_engine(model_dir, swap=name == "engine-swap"))
    elif name == "backend-lora":
        asyncio.run(_backend(model_dir, work, batch))
    else:
        raise ValueError(name)
    out["peak_kb"] = proc_kb("VmHWM")
    return out


async def _engine(model_dir: Path, swap: bool) -> None:
    import asyncio

    from clawbridge_local.engine import TorchEngine
    from safetensors.torch import load_file

    from clawbridge.serving.sampler import SamplingParams

    engine = TorchEngine.load(str(model_dir), device="cpu", dtype="float32", progress=False)
    params = SamplingParams(max_tokens=64, temperature=0.0)

    async def one(i: int) -> None:
        stream = await engine.sample([1, 2, 3, i + 4], params)
        async for _ in stream:
            pass

    await asyncio.gather(*(one(i) for i in range(4)))
    if swap:
        state = load_file(str(model_dir / "model.safetensors"))
        state = {k: v * 1.001 for k, v in state.items()}
        old = await engine.sample([1, 2, 3], SamplingParams(max_tokens=100_000, temperature=0.0))
        async for _ in old:
            break
        await engine.swap_weights(state, 1)
        await asyncio.gather(*(one(i) for i in range(4)))
        await old.aclose()
    engine.shutdown()


async def _backend(model_dir: Path, work: Path, batch: list[Any]) -> None:
    from clawbridge_local.backend import LocalBackend

    from clawbridge.backend import LossConfig
    from clawbridge.config import Settings

    settings = Settings.model_validate(
        {
            "model": str(model_dir),
            "state_dir": str(work),
            "backends": {"local": {"device": "cpu", "dtype": "float32"}},
            "lora_rank": 8,
            "lora_alpha": 16.0,
        }
    )
    backend = LocalBackend(settings, progress=False)
    await backend.start()
    for _ in range(STEPS):
        await backend.train_step(batch, LossConfig())
        await backend.publish()
    await backend.close()


# -------------------------------------------------------------------------------------------- parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "small"], default="small")
    ap.add_argument("--no-torchrun", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory() as work:
            out = child(
                args.child, Path(args.model_dir), Path(args.model_dir).parent / "batch.json", Path(work)
            )
            print(json.dumps(out))
        return

    from clawbridge_local.trainer.batch import write_batch
    from train_throughput import MODEL_SPECS, make_batch

    from clawbridge.devtools.tinymodel import build_tiny_model

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", spec=MODEL_SPECS[args.model])
        write_batch(Path(tmp) / "batch.json", make_batch(model_dir, 8, 64, 64))
        size = (model_dir / "model.safetensors").stat().st_size
        print(f"model {args.model}: {size / 2**20:.1f} MiB of fp32 weights; OMP_NUM_THREADS=1 per process")
        print(f"{'measurement':16} {'floor MiB':>10} {'peak MiB':>10} {'peak-floor':>11}")
        for name in CHILDREN:
            if args.no_torchrun and name.startswith("trainer-2"):
                continue
            cmd = [sys.executable, __file__, "--child", name, "--model-dir", str(model_dir)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
            if res.returncode != 0:
                print(f"{name:16} FAILED:\n{res.stderr[-2000:]}")
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            floor, peak = r["floor_kb"] / 1024, r["peak_kb"] / 1024
            if "ranks_kb" in r:
                for i, kb in enumerate(r["ranks_kb"]):
                    print(f"{name + f' rank{i}':16} {'':>10} {kb / 1024:10.0f} {'':>11}")
                print(f"{name + ' client':16} {floor:10.0f} {peak:10.0f} {peak - floor:11.0f}")
            else:
                print(f"{name:16} {floor:10.0f} {peak:10.0f} {peak - floor:11.0f}")
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
