"""The GPU validation kit: one table of what the local backend does on this machine's accelerator.

`bash bench/gpu/run.sh` installs the wheel folder (offline) and runs this; docs/gpu-kit.md says
what each row means. Every part is measured beside a baseline taken in the same run, and every part
that cannot run becomes a "skipped: <reason>" row (a part that breaks: "failed: <error>"), so one
run always prints the whole table.

Parts (reusing the bench scripts, not copies of them):
- demo: `clawbridge up` + the tiny demo (clawbridge.devtools.demo) on --device, LoRA and full, bf16
  on CUDA; the figure is the mean reward of the last 20% of sessions against the first 20%.
- train: trainer tokens/s and model FLOPs utilization (recomputed activations not counted: the
  trainer's default activation checkpointing runs each layer's forward twice, the plain loop once)
  for the qwen3-0.6b and qwen3-1.7b shapes
  (random weights, clawbridge.devtools.shapes), LoRA and full, FSDP2 world 1 (bench/train_throughput.py's
  `fsdp_runner`) against its plain transformers/peft loop (`PlainLoop`), run one after the other
  (each alone in memory).
- decode: torch engine tokens/s at 1, 32 and 128 streams (bench/engine_batching.py's `measure`);
  baseline: 1 stream.
- publish: seconds from a train step to the first token of the new version, LoRA and full
  (bench/publish_latency.py's `bench_mode`); baseline: a from_pretrained reload.
- sglang, fsdp-N: only when `sglang` is importable on CUDA / more than one GPU is visible.

`--quick` shrinks every size (2-layer scaled shapes, a few steps and sessions) so the whole
table runs on a CPU in minutes: the test of the kit (tests/test_gpu_kit.py) runs it that way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                    "L4": 121.0, "A10": 125.0, "RTX 4090": 165.0, "B200": 2250.0}
"""Dense bf16 tensor-core peak per GPU name (vendor datasheets; SXM figures for H100/A100). MFU
uses the first key found in `torch.cuda.get_device_name()`; `--peak-tflops` overrides."""


@dataclass
class Row:
    """One line of the table."""

    part: str
    what: str
    figure: str
    baseline: str = ""


def bench_module(name: str) -> ModuleType:
    """Import bench/<name>.py (the bench scripts are scripts, not a package)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def guarded(part: str, what: str, fn: Callable[[], list[Row]]) -> list[Row]:
    """Run one part; a failure becomes a row, never the end of the run."""
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the bench scripts' own prints: stdout is the table's
            rows = fn()
    except Skip as s:
        return [Row(part, what, f"skipped: {s}")]
    except Exception as exc:  # the table must come out whatever one part does
        traceback.print_exc()
        return [Row(part, what, f"failed: {type(exc).__name__}: {str(exc)[:160]}")]
    print(f"[kit] {part} {what}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return rows


class Skip(Exception):
    """A part that cannot run here; the message is the reason."""


@dataclass
class Kit:
    """Sizes and placement of one run."""

    device: str
    quick: bool
    work: Path
    peak_tflops: float | None

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.cuda else "float32"

    def shape_dir(self, name: str) -> Path:
        """The shape's model folder (built once per run; scaled to 2 layers with --quick)."""
        from clawbridge.devtools.shapes import SHAPES, build_shape, scaled

        out = self.work / name
        if not (out / "config.json").exists():
            shape = scaled(SHAPES[name], layers=2, hidden=128, vocab=6000) if self.quick else SHAPES[name]
            build_shape(out, shape, dtype="fp32", seed=0)
        return out

    def free(self) -> None:
        import gc

        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ parts


def demo_rows(kit: Kit) -> list[Row]:
    from clawbridge.devtools.demo import DemoConfig, run_demo

    rows = []
    for rank in (8, 0):
        mode = f"LoRA r{rank}" if rank else "full"
        cfg = DemoConfig(sessions=32 if kit.quick else 240, lora_rank=rank, seed=0, settings={
            "CLAWBRIDGE_LOCAL_ENGINE": "torch", "CLAWBRIDGE_LOCAL_DEVICE": kit.device,
            "CLAWBRIDGE_LOCAL_DTYPE": kit.dtype})
        res = run_demo(cfg, kit.work / f"demo-{rank}")
        first, last = res.head_tail()
        versions = max(e.policy_version for e in res.episodes)
        rows.append(Row("demo", f"tiny demo via clawbridge up, {mode}, {kit.dtype}",
                        f"reward {last:.3f} (last 20%), {versions} versions, {res.seconds:.0f}s",
                        f"first 20% {first:.3f}"))
    return rows


def mfu(kit: Kit, n_params: int, tokens_per_s: float, lora: bool) -> str:
    """Model FLOPs utilization: 6N per token for full training, 4N for LoRA (no weight gradients of
    the frozen base), attention FLOPs left out; against the GPU's dense bf16 peak."""
    if not kit.cuda:
        return "MFU n/a (cpu)"
    import torch

    peak = kit.peak_tflops
    if peak is None:
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
        if peak is None:
            return f"MFU n/a (peak of {name!r} unknown: --peak-tflops)"
    return f"MFU {100 * (4 if lora else 6) * n_params * tokens_per_s / (peak * 1e12):.1f}%"


def train_rows(kit: Kit, shape: str, world: int = 1) -> list[Row]:
    from clawbridge.devtools.shapes import SHAPES, count_parameters

    tt = bench_module("train_throughput")
    model_dir = kit.shape_dir(shape)
    n_params = count_parameters(SHAPES[shape]) if not kit.quick else _count(model_dir)
    batch_n, plen, clen, steps = (4, 16, 16, 2) if kit.quick else (8, 256, 256, 5)
    batch = tt.make_batch(model_dir, batch_n, plen, clen, device=kit.device)
    tokens = sum(len(d.tokens) - 1 for d in batch)
    loss = tt.LossConfig("importance_sampling")
    rows = []
    for lora in (tt.LORA, None):
        mode = f"LoRA r{tt.LORA.rank}" if lora else "full"

        def timed(step: Callable[[Any, Any], float]) -> float:
            step(batch, loss)  # warmup
            secs = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step(batch, loss)
                if kit.cuda:
                    import torch

                    torch.cuda.synchronize()
                secs.append(time.perf_counter() - t0)
            return tokens / statistics.median(secs)

        base = None
        if world == 1:
            plain = tt.PlainLoop(model_dir, lora, device=kit.device)
            base = timed(plain.step)
            del plain
            kit.free()
        with tempfile.TemporaryDirectory(dir=kit.work) as tmp:
            runner = tt.fsdp_runner(f"fsdp-{world}", model_dir, Path(tmp), lora, world,
                                    int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
            try:
                tps = timed(runner.step)
            finally:
                runner.close()
        kit.free()
        label = shape + (" (scaled)" if kit.quick else "")
        rows.append(Row("train", f"{label} {mode}, FSDP2 world {world}, activation checkpointing",
                        f"{tps:,.0f} tok/s, {mfu(kit, n_params, tps * world if world > 1 else tps, bool(lora))}",
                        f"plain loop {base:,.0f} tok/s ({tps / base:.2f}x)" if base else "world 1 rows above"))
    return rows


def _count(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118


def _prod(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def decode_rows(kit: Kit) -> list[Row]:
    eb = bench_module("engine_batching")
    model_dir = str(kit.shape_dir("qwen3-0.6b"))
    tokens = 8 if kit.quick else 128
    rows, one = [], None
    for streams in (1, 32, 128):
        secs, _ = eb.measure(model_dir, True, tokens, streams, device=kit.device, dtype=kit.dtype)
        tps = tokens * streams / secs
        one = one or tps
        rows.append(Row("decode", f"torch engine, qwen3-0.6b{' (scaled)' if kit.quick else ''}, {streams} streams "
                        f"x {tokens} tokens", f"{tps:,.0f} tok/s", f"1 stream {one:,.0f} tok/s ({tps / one:.1f}x)"))
        kit.free()
    return rows


def publish_rows(kit: Kit) -> list[Row]:
    pl = bench_module("publish_latency")
    model_dir = kit.shape_dir("qwen3-0.6b")
    args = argparse.Namespace(publishes=2 if kit.quick else 5, device=kit.device, dtype=kit.dtype)
    rows = []
    for rank in (8, 0):
        t = asyncio.run(pl.bench_mode(model_dir, rank, args))
        p, r = statistics.median(t["publish"]), statistics.median(t["reload"])
        rows.append(Row("publish", f"qwen3-0.6b{' (scaled)' if kit.quick else ''} {'LoRA r8' if rank else 'full'}: "
                        "train step -> first token of the new version",
                        f"{1e3 * p:,.0f} ms (with a stream in flight {1e3 * statistics.median(t['publish+stream']):,.0f})",
                        f"reload {1e3 * r:,.0f} ms ({r / p:.1f}x)"))
        kit.free()
    return rows


def sglang_rows(kit: Kit) -> list[Row]:
    if importlib.util.find_spec("sglang") is None:
        raise Skip("the sglang package is not importable (not in the wheel folder: install it on the box)")
    if not kit.cuda:
        raise Skip("SGLang serves on CUDA only; --device is " + kit.device)
    return asyncio.run(_sglang(kit))


async def _sglang(kit: Kit) -> list[Row]:
    """Untested by this project's CI (no GPU there): the local backend with engine sglang on the
    qwen3-0.6b shape; 32 streams x 64 tokens, then a LoRA train step and its publish."""
    from clawbridge_local.backend import LocalBackend

    from clawbridge.backend import Datum, LossConfig
    from clawbridge.config import Settings
    from clawbridge.sampler import SamplingParams

    with tempfile.TemporaryDirectory(dir=kit.work) as state:
        settings = Settings.model_validate({"model": str(kit.shape_dir("qwen3-0.6b")), "state_dir": state,
                                            "backends": {"local": {"engine": "sglang"}}, "lora_rank": 8})
        backend = LocalBackend(settings, progress=False)
        await backend.start()
        try:
            sampler = backend.sampler()

            async def one(i: int) -> tuple[list[int], list[int], list[float]]:
                prompt = [10 + i, 11, 12, 13]
                stream = await sampler.sample(prompt, SamplingParams(max_tokens=64, seed=i))
                toks = [t async for t in stream]
                return prompt, [t.token_id for t in toks], [t.logprob for t in toks]

            t0 = time.perf_counter()
            outs = await asyncio.gather(*(one(i) for i in range(32)))
            secs = time.perf_counter() - t0
            n = sum(len(o[1]) for o in outs)
            batch = [Datum.from_turn(p, c, lp, [1.0] * len(c), 0) for p, c, lp in outs[:8]]
            await backend.train_step(batch, LossConfig())
            t0 = time.perf_counter()
            await backend.publish()
            pub = time.perf_counter() - t0
        finally:
            await backend.close()
    return [Row("sglang", "qwen3-0.6b, 32 streams x 64 tokens; LoRA publish",
                f"{n / secs:,.0f} tok/s; publish {1e3 * pub:,.0f} ms", "torch engine rows above")]


def multi_gpu_rows(kit: Kit) -> list[Row]:
    import torch

    n = torch.cuda.device_count() if kit.cuda else 0
    if n < 2:
        raise Skip(f"{n} GPU(s) visible; multi-GPU FSDP needs 2 or more")
    return train_rows(kit, "qwen3-0.6b", world=n)


# ------------------------------------------------------------------------------------------------ table


def parts(kit: Kit) -> Iterator[list[Row]]:
    yield guarded("demo", "tiny demo via clawbridge up", lambda: demo_rows(kit))
    for shape in ("qwen3-0.6b", "qwen3-1.7b"):
        yield guarded("train", shape, lambda shape=shape: train_rows(kit, shape))  # type: ignore[misc]
    yield guarded("decode", "torch engine decode", lambda: decode_rows(kit))
    yield guarded("publish", "publish latency", lambda: publish_rows(kit))
    yield guarded("sglang", "SGLang serving", lambda: sglang_rows(kit))
    yield guarded("fsdp-N", "multi-GPU FSDP", lambda: multi_gpu_rows(kit))


def render(rows: list[Row], header: str) -> str:
    cols = ("part", "what", "figure", "baseline (same run)")
    cells = [cols, *((r.part, r.what, r.figure, r.baseline) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = [header, " | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells[1:]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: the whole table in minutes on a CPU")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, for MFU")
    ap.add_argument("--work", type=Path, default=None, help="folder for models and state (default: a temp dir)")
    args = ap.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"no CUDA device visible to torch {torch.__version__}; rerun with --device cpu", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="clawbridge-gpukit-") as tmp:
        kit = Kit(args.device, args.quick, args.work or Path(tmp), args.peak_tflops)
        kit.work.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name() if kit.cuda else f"cpu x{os.cpu_count()}"
        header = (f"clawbridge GPU kit: {name}, torch {torch.__version__}, device {kit.device}, "
                  f"{'quick (scaled shapes)' if kit.quick else 'full sizes'}")
        rows = [r for part in parts(kit) for r in part]
    print(render(rows, header), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
