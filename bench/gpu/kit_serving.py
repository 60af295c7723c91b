"""The GPU kit's serving parts: `graphs` (replayed CUDA graphs against eager steps, and the CUDA
API calls per decode token), `decode` (torch engine tokens/s against transformers' `generate`) and
`sglang`; docs/gpu-kit.md says what each row measures.
"""

from __future__ import annotations

import asyncio
import importlib.util
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kit_common import API_CALLS, Kit, Row, Skip, T, attempt


def prompts(n: int) -> list[list[int]]:
    """The decode prompts (different lengths: padding and length buckets are real), as in
    bench/engine_batching.py."""
    return [list(range(10 + i, 30 + 3 * i)) for i in range(n)]


def run_streams(engine: Any, batch: list[list[int]], tokens: int, temperature: float = 0.0,
                ) -> tuple[float, list[list[tuple[int, float]]]]:
    """Seconds and the (token, logprob) lists of `batch` sampled at once (seed = index)."""
    from clawbridge.serving.sampler import SamplingParams

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
    from clawbridge.serving.sampler import SamplingParams

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


