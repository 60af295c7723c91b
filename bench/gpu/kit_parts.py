"""The parts of the GPU kit: each is a generator of table rows, run in its own process by
`bench/gpu/kit.py --part NAME` (docs/gpu-kit.md says what each row measures).

A part yields each row as soon as it has it, so a part cut by its time budget keeps the rows it
finished; a measurement inside a part that fails becomes a `failed: ...` row and the part goes on
with the next one. Every figure stands beside a baseline measured in the same run. The bench
scripts are reused (imported from bench/), not copied.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                    "L4": 121.0, "A10": 125.0, "RTX 4090": 165.0, "B200": 2250.0}
"""Dense bf16 tensor-core peak per GPU name (vendor datasheets; SXM figures for H100/A100). MFU
uses the first key found in `torch.cuda.get_device_name()`; `--peak-tflops` overrides."""
API_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuGraphLaunch", "cudaMemcpy", "cudaMemset")
"""Name prefixes of the CUDA API calls a decode step makes from the host (kernel and graph
launches, copies; CUPTI may add a version suffix), counted per token by the `graphs` part."""


@dataclass
class Row:
    """One line of the table."""

    part: str
    what: str
    figure: str
    baseline: str = ""


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
        """The shape's model folder, built once per run (random weights drawn on the device, bf16
        on CUDA; scaled to 2 layers with --quick) and shared by the parts."""
        from clawbridge.devtools.shapes import SHAPES, build_shape, scaled

        out = self.work / name
        if not (out / "config.json").exists():  # written last: a cut build is built again
            shape = scaled(SHAPES[name], layers=2, hidden=128, vocab=6000) if self.quick else SHAPES[name]
            t0 = time.perf_counter()
            build_shape(out, shape, dtype="bf16" if self.cuda else "fp32", seed=0,
                        device=self.device if self.cuda else "cpu")
            print(f"[kit] built {name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        return out

    def label(self, shape: str) -> str:
        return shape + (" (scaled)" if self.quick else "")

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def free(self) -> None:
        import gc

        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()


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


def attempt(part: str, what: str, rows: Callable[[], Iterator[Row]]) -> Iterator[Row]:
    """The rows of one measurement; if it breaks, a `failed:` row (traceback on stderr) and no more."""
    try:
        yield from rows()
    except Skip as s:
        yield Row(part, what, f"skipped: {s}")
    except Exception as exc:
        traceback.print_exc()
        yield Row(part, what, f"failed: {type(exc).__name__}: {str(exc)[:200]}")


def prompts(n: int) -> list[list[int]]:
    """The decode prompts (different lengths: padding and length buckets are real), as in
    bench/engine_batching.py."""
    return [list(range(10 + i, 30 + 3 * i)) for i in range(n)]


def run_streams(engine: Any, batch: list[list[int]], tokens: int, temperature: float = 0.0,
                ) -> tuple[float, list[list[tuple[int, float]]]]:
    """Seconds and the (token, logprob) lists of `batch` sampled at once (seed = index)."""
    from clawbridge.sampler import SamplingParams

    async def one(i: int) -> list[tuple[int, float]]:
        params = SamplingParams(max_tokens=tokens, temperature=temperature, seed=i)
        stream = await engine.sample(batch[i], params)
        return [(t.token_id, t.logprob) async for t in stream]

    async def run() -> list[list[tuple[int, float]]]:
        return list(await asyncio.gather(*(one(i) for i in range(len(batch)))))

    t0 = time.perf_counter()
    out = asyncio.run(run())
    return time.perf_counter() - t0, out


def compare(got: list[list[tuple[int, float]]], want: list[list[tuple[int, float]]]) -> tuple[float, int, int]:
    """Largest logprob difference over the tokens both sampled before their first different token,
    how many tokens that covers, and how many there were."""
    worst, same = 0.0, 0
    for g, w in zip(got, want, strict=True):
        for (tg, lg), (tw, lw) in zip(g, w, strict=False):
            if tg != tw:
                break
            worst, same = max(worst, abs(lg - lw)), same + 1
    return worst, same, sum(len(w) for w in want)


class EngineBox:
    """A torch engine of a model folder for one `with` block (`TorchEngine.load` options; a KV
    budget of 16,384 tokens unless given: the default for many streams is far more than a part
    needs); on exit it is shut down, dropped and its memory freed before the next one loads."""

    def __init__(self, kit: Kit, model_dir: Path, **kw: Any) -> None:
        self.kit, self.model_dir, self.kw = kit, model_dir, kw
        self.engine: Any = None

    def __enter__(self) -> Any:
        from clawbridge_local.engine import TorchEngine

        kw = {"dtype": self.kit.dtype, "max_running": 8, "kv_budget_tokens": 16384, **self.kw}
        self.kit.free()  # an engine the caller still named at the last exit is unreachable now
        self.engine = TorchEngine.load(str(self.model_dir), device=self.kit.device, progress=False, **kw)
        return self.engine

    def __exit__(self, *exc: object) -> None:
        self.engine.shutdown()
        self.engine = None
        self.kit.free()


def with_engine(kit: Kit, model_dir: Path, use: Callable[[Any], T], **kw: Any) -> T:
    """`use(engine)` on an `EngineBox` engine."""
    with EngineBox(kit, model_dir, **kw) as engine:
        return use(engine)


def graph_stats(engine: Any) -> str:
    static = engine.static
    if static is None:
        return "eager steps"
    what = "graphs" if static.capture or static.captured else "fixed-shape steps (no capture)"
    failed = f"; capture failed: {static.failed[0][:120]}" if static.failed else ""
    broken = f"; fixed shapes stopped: {static.broken[:120]}" if static.broken else ""
    return (f"{what}: {static.captured} captured, {static.replays} replays, {static.eager_runs} eager runs, "
            f"{engine.packed_prefills} packed prefills{failed}{broken}")


# ------------------------------------------------------------------------------------------------ env


def env_rows(kit: Kit) -> Iterator[Row]:
    import clawbridge_local
    import torch
    import transformers

    import clawbridge

    yield Row("env", "python / torch / transformers",
              f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")
    if kit.cuda:
        props = torch.cuda.get_device_properties(kit.device)
        free, total = torch.cuda.mem_get_info(kit.device)
        yield Row("env", "device", f"{props.name}, {total / 2**30:.0f} GiB ({free / 2**30:.0f} free), "
                  f"compute capability {props.major}.{props.minor}, {torch.cuda.device_count()} visible")
    else:
        yield Row("env", "device", f"cpu x{os.cpu_count()}")
    missing = [m for m in ("fastapi", "pydantic", "uvicorn", "openai", "peft")
               if importlib.util.find_spec(m) is None]
    yield Row("env", "clawbridge installed", f"{Path(clawbridge.__file__).parent}, "
              f"{Path(clawbridge_local.__file__).parent}" + (f"; missing: {missing}" if missing else ""))


# --------------------------------------------------------------------------------------------- graphs


def graphs_rows(kit: Kit) -> Iterator[Row]:
    """Replayed CUDA graphs against eager steps (fp32: to 1e-4; bf16: against the same shapes run
    eagerly), and the CUDA API calls per decode token with and without graphs. On CPU the same
    fixed shapes run without capture."""
    model_dir = kit.shape_dir("qwen3-0.6b")
    streams, tokens = (3, 6) if kit.quick else (4, 16)
    batch = prompts(streams)
    fixed_mode = "auto" if kit.cuda else "static"
    name = "CUDA graphs" if kit.cuda else "fixed-shape steps (no capture on cpu)"

    def sampled(eng: Any) -> tuple[list[list[tuple[int, float]]], str]:
        return run_streams(eng, batch, tokens, temperature=1.0)[1], graph_stats(eng)

    def fp32() -> Iterator[Row]:
        got, stats = with_engine(kit, model_dir, sampled, dtype="float32", graphs=fixed_mode)
        want, _ = with_engine(kit, model_dir, sampled, dtype="float32", graphs="off", batch_decode=False)
        worst, same, total = compare(got, want)
        verdict = "ok" if worst <= 1e-4 else "OVER"
        yield Row("graphs", f"{name} vs eager unbatched steps, fp32, {streams} streams x {tokens} tokens (T=1)",
                  f"max |d logprob| {worst:.1e} (1e-4: {verdict}), {same}/{total} tokens equal", stats)

    yield from attempt("graphs", f"{name} vs eager, fp32", fp32)
    if not kit.cuda:
        yield Row("graphs", "CUDA API calls per decode token", "skipped: no CUDA device")
        return

    def bf16() -> Iterator[Row]:
        got, stats = with_engine(kit, model_dir, sampled, graphs="auto")
        want, _ = with_engine(kit, model_dir, sampled, graphs="static")
        worst, same, total = compare(got, want)
        yield Row("graphs", f"bf16: replayed graphs vs the same fixed-shape steps run eagerly, {streams} streams",
                  f"max |d logprob| {worst:.1e}, {same}/{total} tokens equal", stats)

    yield from attempt("graphs", "bf16 replay vs eager fixed shapes", bf16)

    def per_token(eng: Any) -> tuple[float, float]:
        run_streams(eng, batch[:1], 40)  # warm-up (captures the buckets used below)
        one, one_gpu = api_calls(eng, batch[0], 1)
        many, many_gpu = api_calls(eng, batch[0], 33)
        return (many - one) / 32, (many_gpu - one_gpu) / 32

    def launches() -> Iterator[Row]:
        per = {mode: with_engine(kit, model_dir, per_token, graphs=mode) for mode in ("off", "auto")}
        if per["off"][0] < 10:  # an eager step launches hundreds: the profiler did not see the API calls
            raise Skip(f"the profiler recorded no CUDA API calls (eager: {per['off'][0]:.1f} per token)")
        yield Row("graphs", "CUDA API calls (launches, graph launches, copies) per decode token, 1 stream, bf16",
                  f"with graphs {per['auto'][0]:,.0f} ({per['auto'][1]:,.0f} GPU activities)",
                  f"eager {per['off'][0]:,.0f} ({per['off'][1]:,.0f} GPU activities)")

    yield from attempt("graphs", "CUDA API calls per decode token", launches)


def api_calls(engine: Any, prompt: list[int], tokens: int) -> tuple[int, int]:
    """CUDA API calls (`API_CALLS`) and GPU activities (kernels, copies) during one greedy request
    of `tokens` tokens."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_streams(engine, [prompt], tokens)
        torch.cuda.synchronize()
    calls = kernels = 0
    for e in prof.events():
        if e.name.startswith(API_CALLS):
            calls += 1
        elif getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            kernels += 1
    return calls, kernels


# --------------------------------------------------------------------------------------------- decode


def decode_rows(kit: Kit) -> Iterator[Row]:
    """Torch engine tokens/s (greedy, prefill included) at 1, 32 and 128 streams, then the baseline
    rows: transformers' `generate` on the same prompts at 1 and 32 streams, and (CUDA) the engine
    with graphs off at 1 stream."""
    model_dir = kit.shape_dir("qwen3-0.6b")
    tokens = 8 if kit.quick else 128
    counts = (1, 4, 8) if kit.quick else (1, 32, 128)
    label = kit.label("qwen3-0.6b")
    ours: dict[int, float] = {}

    def engine() -> Iterator[Row]:
        need = sum(len(p) + tokens for p in prompts(max(counts)))
        with EngineBox(kit, model_dir, max_running=max(counts), max_queued=max(counts) + 8,
                       kv_budget_tokens=need + 1024) as eng:
            for n in counts:  # warm-up: lazy initialisation, and the buckets the timed runs start in
                run_streams(eng, prompts(n), 2)
            for n in counts:
                secs, _ = run_streams(eng, prompts(n), tokens)
                ours[n] = n * tokens / secs
                base = f"1 stream {ours[1]:,.0f} tok/s ({ours[n] / ours[1]:.1f}x)" if n > 1 else ""
                yield Row("decode", f"torch engine, {label}, {n} stream{'s' if n > 1 else ''} x {tokens} tokens, "
                          f"greedy, {kit.dtype}", f"{ours[n]:,.0f} tok/s ({graph_stats(eng)})", base)

    yield from attempt("decode", "torch engine", engine)
    for n in counts[:2]:
        def baseline(n: int = n) -> Iterator[Row]:
            tps = generate_tps(kit, model_dir, prompts(n), tokens)
            vs = f"engine {ours[n] / tps:.1f}x" if n in ours else ""
            yield Row("decode", f"transformers generate (baseline), {label}, {n} stream{'s' if n > 1 else ''} x "
                      f"{tokens} tokens, greedy, {kit.dtype}", f"{tps:,.0f} tok/s", vs)

        yield from attempt("decode", f"generate, {n} streams", baseline)
    if not kit.cuda:
        return

    def eager() -> Iterator[Row]:
        short = 32  # eager steps run ~10 tokens/s at one stream: a short request tells as much
        secs, _ = with_engine(kit, model_dir, lambda eng: (run_streams(eng, prompts(1), 2),
                                                           run_streams(eng, prompts(1), short))[1], graphs="off")
        tps = short / secs
        yield Row("decode", f"torch engine with graphs off (baseline), {label}, 1 stream x {short} tokens, greedy, "
                  f"{kit.dtype}", f"{tps:,.0f} tok/s", f"with graphs {ours[1] / tps:.1f}x" if 1 in ours else "")

    yield from attempt("decode", "eager engine, 1 stream", eager)


def generate_tps(kit: Kit, model_dir: Path, batch: list[list[int]], tokens: int) -> float:
    """Tokens/s of `model.generate` on `batch` (left-padded), greedy, exactly `tokens` new tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, kit.dtype), local_files_only=True)
    model = loaded.to(kit.device).eval()
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=kit.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=kit.device)
    common = {"attention_mask": mask, "do_sample": False, "pad_token_id": 0}
    try:
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, **common)  # warm-up
            kit.sync()
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **common)
            kit.sync()
            secs = time.perf_counter() - t0
        assert out.shape[1] == width + tokens, out.shape
        return len(batch) * tokens / secs
    finally:
        del model
        kit.free()


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
    batch_n, plen, clen, steps = (4, 16, 16, 2) if kit.quick else (8, 256, 256, 3)
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


# ------------------------------------------------------------------------------------ sglang, fsdp-N


def sglang_skip(kit: Kit) -> str | None:
    """Why the sglang part cannot run here (None: it can)."""
    if importlib.util.find_spec("sglang") is None:
        return "the sglang package is not importable (not in the wheel folder: install it on the box)"
    if not kit.cuda:
        return "SGLang serves on CUDA only; --device is " + kit.device
    return None


def sglang_rows(kit: Kit) -> Iterator[Row]:
    why = sglang_skip(kit)
    if why:
        raise Skip(why)
    yield asyncio.run(_sglang(kit))


async def _sglang(kit: Kit) -> Row:
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
    return Row("sglang", "qwen3-0.6b, 32 streams x 64 tokens; LoRA publish",
               f"{n / secs:,.0f} tok/s; publish {1e3 * pub:,.0f} ms", "torch engine rows above")


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


@dataclass(frozen=True)
class Part:
    """One part: its rows, its time budget (full sizes / --quick) and, where it can be known without
    starting it, why it cannot run."""

    rows: Callable[[Kit], Iterator[Row]]
    budget_s: float
    quick_budget_s: float
    precheck: Callable[[Kit], str | None] = lambda kit: None


PARTS: dict[str, Part] = {
    # Quickest evidence first: what runs, then the engine (the slowest row of the last run), then training.
    "env": Part(env_rows, 60, 120),
    "graphs": Part(graphs_rows, 100, 300),
    "decode": Part(decode_rows, 120, 300),
    "train-0.6b": Part(lambda kit: train_rows(kit, "qwen3-0.6b"), 90, 300),
    "publish": Part(publish_rows, 75, 300),
    "train-1.7b": Part(lambda kit: train_rows(kit, "qwen3-1.7b"), 100, 300),
    "demo": Part(demo_rows, 150, 300),
    "sglang": Part(sglang_rows, 150, 60, sglang_skip),
    "fsdp-N": Part(multi_gpu_rows, 150, 120,
                   lambda kit: None if gpu_count(kit) >= 2 else f"{gpu_count(kit)} GPU(s) visible; multi-GPU FSDP "
                   "needs 2 or more"),
}
"""The kit's parts, in the order they run."""
