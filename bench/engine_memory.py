"""Torch engine memory and speed: `clawbridge up` itself, and the KV-pool engine against the OLD engine.

The headline rows (issue 32 §1) measure `clawbridge up --backend local` from outside, as a user
runs it: bench/up_memory.py's HTTP load (the openai SDK, streamed sessions of several turns, every
turn rewarded, training steps meanwhile) and the peak RSS of the `up` process tree, with the KV
settings as before issue 32 (a budget of max_running_requests x min(context, 4096) positions, float32)
against the defaults, one run each. Then, keys and values in bfloat16 against float32 in the same
greedy streams (how far the logprobs move). The rows below those are issue 22's, object level:

The old engine is `bench/old_engine` (a frozen copy of the engine before the KV pool: a
`DynamicCache` per request, every cache padded and concatenated per decode token); it is used
here only, as the baseline. Each measurement runs in its own fresh Python process (`--child`), one
at a time, OMP_NUM_THREADS=1, so peaks do not mix:

- serve+train: `LocalBackend` as `clawbridge up --backend local` runs it (engine + in-process LoRA
  trainer), SmolLM2-135M-Instruct fp32, 16 concurrent streams of 96 tokens while 2 LoRA train
  steps and publishes run. Peak RSS of the whole process tree (polled every 20 ms: the process and
  all its children), `--repeat` times per column, interleaved, reported as min / median / max (the
  peak varies by ~1 GiB between runs of the same code). The old column also runs the trainer as
  it was: its loss on one whole [B, T, V] fp32 logits tensor, every activation kept for the
  backward pass. Three more rows of the new engine take one change back each, to separate them:
  the trainer keeping every activation (`activation_checkpointing = false`), the unchunked loss,
  and LoRA served as before adapters were served unmerged (each publish merged into the weights,
  a model copy while streams hold the old ones; the trainer with its own copy of the base).
- growth: the engine alone on the tiny model (1,000 requests of SmolLM2 take too long on a shared
  2-core box): 1,000 requests, 8 at a time, agent-like (each session resends its history plus a
  new turn), RSS after 100 and after 1,000.
- speed: SmolLM2 decode tokens/s at 1, 8 and 32 concurrent streams (32 tokens each, sampled,
  seeded), wall time from the first request to the last token; and, on the new engine, the same
  with a LoRA version (rank 8 on every linear layer and lm_head, random) published merged against
  published as an adapter (what unmerged serving costs per token). A further row: 1 stream after
  a 2,048-token prompt (what an agent resending its history sends), 48 tokens, decode tokens/s
  from the first token to the last (the prefill timed apart): the old engine's cache grows by
  concatenation, a copy of the whole cache per layer per token, the pool writes one position.
- exactness: SmolLM2, 8 streams of 32 tokens, batched against `batch_decode=False` (one request
  per forward): max |logprob difference| over the tokens both sampled before their first
  difference; and the pool engine's batched logprobs against a plain transformers full forward.

Run (about 10-12 minutes on 2 shared cores, and ~10 more per `clawbridge up` run):
    . .venv/bin/activate && python bench/engine_memory.py
    python bench/engine_memory.py --only-up    # only the `clawbridge up` rows (old settings, defaults)
    python bench/engine_memory.py --only-kv-dtype   # only bf16 against fp32 keys and values
    python bench/engine_memory.py --quick      # smaller sizes, to check that it runs
    python bench/engine_memory.py --only-serve --repeat 5   # only the serve+train peak
    python bench/engine_memory.py --only-speed --speed-repeat 5   # only decode speed, 5 runs each
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ["OMP_NUM_THREADS"] = "1"
LONG_PROMPT = 2048
"""Prompt tokens of the long-prompt decode row (an agent's resent history)."""
LONG_TOKENS = 48


def tree_rss_kb(pid: int) -> int:
    """RSS of `pid` and all its descendants (kB)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


class PeakSampler:
    """Polls the process tree's RSS in a thread; `peak_kb` is the highest seen."""

    def __init__(self) -> None:
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_kb = max(self.peak_kb, tree_rss_kb(os.getpid()))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak_kb, tree_rss_kb(os.getpid()))


def engine_class(which: str) -> Any:
    if which == "old":
        from old_engine.engine import TorchEngine as Old

        class OldEngine(Old):  # type: ignore[misc]
            lend_base = None  # it only loads full weights: the trainer keeps its own base

            @classmethod
            def load(cls, model: str, **kw: Any) -> Any:
                kw.pop("kv_budget_tokens", None)
                kw.pop("graphs", None)  # newer than it (CUDA graphs; CPU runs eager steps anyway)
                return super().load(model, **kw)

        return OldEngine
    from clawbridge_local.engine import TorchEngine

    return TorchEngine


# ------------------------------------------------------------------------------------------ children


async def serve_train(which: str, model_dir: Path, work: Path, streams: int, tokens: int) -> dict[str, Any]:
    import clawbridge_local.backend as lb
    from clawbridge_local.trainer.batch import read_batch

    from clawbridge.backend import LossConfig
    from clawbridge.config import Settings
    from clawbridge.serving.sampler import SamplingParams

    checkpointing = not (which == "old" or which.endswith("+keepact"))  # the trainer keeping all activations
    which = which.removesuffix("+keepact")
    if which == "old" or which.endswith("+fullloss"):  # the trainer's loss before chunked logprobs
        import clawbridge_local.trainer.step as step
        from clawbridge_local.trainer.logprobs import full_token_logprobs

        step.token_logprobs = full_token_logprobs  # type: ignore[assignment]
        which = which.removesuffix("+fullloss")
    if which.endswith("+merged"):  # LoRA as served before adapters: merged publishes, the trainer's own base
        import clawbridge_local.engine as en
        import clawbridge_local.training as tr
        from old_engine.merged import merged_update

        tr.LocalTrainer.weight_update = merged_update  # type: ignore[assignment,method-assign]
        en.TorchEngine.lend_base = lambda self: None  # type: ignore[method-assign]  # lends nothing
        which = which.removesuffix("+merged")
    lb.TorchEngine = engine_class(which)  # type: ignore[attr-defined,misc]
    settings = Settings.model_validate({
        "model": str(model_dir), "state_dir": str(work), "lora_rank": 8, "lora_alpha": 16.0,
        "backends": {"local": {"device": "cpu", "dtype": "float32", "max_running_requests": streams,
                               "engine_threads": 1, "activation_checkpointing": checkpointing}}})
    sampler_peak = PeakSampler()
    backend = lb.LocalBackend(settings, progress=False)
    await backend.start()
    batch = read_batch(model_dir.parent / "batch.json")
    engine = backend.sampler()

    async def one(i: int) -> int:
        stream = await engine.sample([1, 2, 3 + i, *range(100, 120 + i)], SamplingParams(max_tokens=tokens, seed=i))
        return len([t async for t in stream])

    async def train() -> None:
        for _ in range(2):
            await backend.train_step(batch, LossConfig())
            await backend.publish()

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(i) for i in range(streams)), train())
    wall = time.perf_counter() - t0
    await backend.close()
    return {"tree_peak_kb": sampler_peak.stop(), "tokens": sum(done[:-1]), "wall_s": wall}


async def growth(which: str, model_dir: Path, n: int) -> dict[str, Any]:
    from clawbridge.serving.sampler import SamplingParams

    engine = engine_class(which).load(str(model_dir), device="cpu", dtype="float32", max_running=8,
                                      progress=False)
    histories: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        session = i % 24
        if len(histories.get(session, [])) > 400:  # a session ends; a new one starts
            histories.pop(session)
        prompt = [*histories.get(session, [1, 2, 3]), 10 + i % 50, 11, 12, 13]
        stream = await engine.sample(prompt, SamplingParams(max_tokens=16, seed=i))
        histories[session] = prompt + [t.token_id async for t in stream]
        done += 1
        if done in (100, n):
            rss[done] = tree_rss_kb(os.getpid())

    for start in range(0, n, 8):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + 8))))
    engine.shutdown()
    return {"rss100_kb": rss[100], "rss_n_kb": rss[n]}


def speed(which: str, model_dir: Path, concurrency: int, tokens: int, batch: bool = True,
          kv_dtype: Any = None) -> dict[str, Any]:
    from clawbridge.serving.sampler import SamplingParams

    kw = {"kv_dtype": kv_dtype} if kv_dtype is not None else {}
    engine = engine_class(which).load(str(model_dir), device="cpu", dtype="float32", max_running=concurrency,
                                      progress=False, batch_decode=batch, **kw)
    prompts = [list(range(10 + i, 30 + i + 3 * (i % 8))) for i in range(concurrency)]

    async def one(i: int) -> list[tuple[int, float]]:
        stream = await engine.sample(prompts[i], SamplingParams(max_tokens=tokens, seed=i))
        return [(t.token_id, t.logprob) async for t in stream]

    async def go() -> list[list[tuple[int, float]]]:
        return list(await asyncio.gather(*(one(i) for i in range(concurrency))))

    t0 = time.perf_counter()
    out = asyncio.run(go())
    wall = time.perf_counter() - t0
    ref_diff = None
    if which == "new":  # against a plain transformers forward of each whole sequence (no cache)
        import torch

        model = engine._current.model
        ref_diff = 0.0
        with torch.no_grad():
            for p, toks in zip(prompts, out, strict=True):
                ids = p + [t for t, _ in toks]
                lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
                for k, (t, x) in enumerate(toks):
                    ref_diff = max(ref_diff, abs(x - lp[len(p) - 1 + k, t].item()))
    engine.shutdown()
    return {"tok_s": concurrency * tokens / wall, "lps": out, "ref_diff": ref_diff}


def long_prompt_speed(which: str, model_dir: Path, prompt_len: int, tokens: int) -> dict[str, Any]:
    """One stream after a long prompt (an agent resending its history): decode tokens/s from the
    first token to the last, so the prefill is left out; and the prefill's seconds."""
    from clawbridge.serving.sampler import SamplingParams

    engine = engine_class(which).load(str(model_dir), device="cpu", dtype="float32", max_running=1,
                                      progress=False)
    prompt = [10 + (i * 7919) % 40000 for i in range(prompt_len)]

    async def go() -> list[float]:
        t0 = time.perf_counter()
        stream = await engine.sample(prompt, SamplingParams(max_tokens=tokens, seed=0))
        return [t0] + [time.perf_counter() async for _ in stream]

    times = asyncio.run(go())
    engine.shutdown()
    return {"tok_s": (len(times) - 2) / (times[-1] - times[1]), "prefill_s": times[1] - times[0]}


def lora_speed(model_dir: Path, concurrency: int, tokens: int, adapter: bool) -> dict[str, Any]:
    """Decode tokens/s of the new engine serving a LoRA version (rank 8, every linear layer and
    lm_head, random): as an adapter, or merged into the weights."""
    import torch
    from clawbridge_local.engine import TorchEngine
    from clawbridge_local.lora_serving import LoraAdapter

    from clawbridge.serving.sampler import SamplingParams

    engine = TorchEngine.load(str(model_dir), device="cpu", dtype="float32", max_running=concurrency, progress=False)
    model = engine._current.model
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, Any] = {}
    merged: dict[str, Any] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            out_f, in_f = mod.weight.shape
            a, b = torch.randn(8, in_f, generator=gen) * 0.01, torch.randn(out_f, 8, generator=gen) * 0.01
            tensors[f"base_model.model.{name}.lora_A.weight"], tensors[f"base_model.model.{name}.lora_B.weight"] = a, b
            merged[f"{name}.weight"] = mod.weight.detach() + 2.0 * (b @ a)
    update: Any = LoraAdapter.from_peft(tensors, 2.0, "bench") if adapter else merged
    prompts = [list(range(10 + i, 30 + i + 3 * (i % 8))) for i in range(concurrency)]

    async def go() -> float:
        await engine.swap_weights(update, 1)

        async def one(i: int) -> None:
            stream = await engine.sample(prompts[i], SamplingParams(max_tokens=tokens, seed=i))
            async for _ in stream:
                pass

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(concurrency)))
        return time.perf_counter() - t0

    wall = asyncio.run(go())
    engine.shutdown()
    return {"tok_s": concurrency * tokens / wall}


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    kind, which = args.child.split(":")
    model_dir = Path(args.model_dir)
    if kind == "serve":
        with tempfile.TemporaryDirectory() as work:
            return asyncio.run(serve_train(which, model_dir, Path(work), args.streams, args.tokens))
    if kind == "growth":
        return asyncio.run(growth(which, model_dir, args.requests))
    if kind.startswith("lspeed"):
        return lora_speed(model_dir, int(kind.removeprefix("lspeed")), 32, adapter=which == "adapter")
    if kind.startswith("long"):
        return long_prompt_speed(which, model_dir, int(kind.removeprefix("long")), LONG_TOKENS)
    if kind.startswith("speed"):
        c = int(kind.removeprefix("speed"))
        return speed(which, model_dir, c, 32)
    if kind == "exact":
        a = speed(which, model_dir, 8, 32, batch=True)
        b = speed(which, model_dir, 8, 32, batch=False)
        diff = 0.0
        for x, y in zip(a["lps"], b["lps"], strict=True):
            for (ta, la), (tb, lb_) in zip(x, y, strict=True):
                if ta != tb:
                    break
                diff = max(diff, abs(la - lb_))
        return {"diff": diff, "ref_diff": a["ref_diff"]}
    if kind == "kvdtype":  # the same 8 greedy streams with a float32 pool and a bfloat16 one
        import torch

        a = speed("new", model_dir, 8, 32, kv_dtype=torch.float32)
        b = speed("new", model_dir, 8, 32, kv_dtype=torch.bfloat16)
        diffs: list[float] = []
        for x, y in zip(a["lps"], b["lps"], strict=True):
            for (ta, la), (tb, lb_) in zip(x, y, strict=True):
                if ta != tb:
                    break
                diffs.append(abs(la - lb_))
        return {"max": max(diffs), "mean": sum(diffs) / len(diffs), "compared": len(diffs),
                "of": sum(len(x) for x in a["lps"]), "tok_s_fp32": a["tok_s"], "tok_s_bf16": b["tok_s"]}
    raise ValueError(kind)


# -------------------------------------------------------------------------------------------- parent


def run_child(name: str, model_dir: Path, args: argparse.Namespace, env: dict[str, str] | None = None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", name, "--model-dir", str(model_dir), "--streams", str(args.streams),
           "--tokens", str(args.tokens), "--requests", str(args.requests)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env={**os.environ, **(env or {})})
    if res.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{res.stderr[-3000:]}")
    out = dict(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"[{name}] {out}", file=sys.stderr, flush=True)
    return out


def median(xs: list[float]) -> float:
    ys = sorted(xs)
    return ys[len(ys) // 2] if len(ys) % 2 else (ys[len(ys) // 2 - 1] + ys[len(ys) // 2]) / 2


def serve_rows(model_dir: Path, args: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """The serve+train measurement `args.repeat` times per engine, old and new interleaved (so a
    slow patch of the shared box hits both): min / median / max of the tree peak, median wall."""
    runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": [], "new+keepact": [], "new+fullloss": [],
                                              "new+merged": []}
    for _ in range(args.repeat):
        for w in runs:
            runs[w].append(run_child(f"serve:{w}", model_dir, args))
    mib = 1024

    def peaks(w: str) -> str:
        xs = [r["tree_peak_kb"] / mib for r in runs[w]]
        return f"{min(xs):.0f} / {median(xs):.0f} / {max(xs):.0f} MiB"

    def wall(w: str) -> str:
        return f"{median([r['wall_s'] for r in runs[w]]):.0f} s"

    return [
        (f"SmolLM2 + LoRA, {args.streams} streams x {args.tokens} tok: tree peak RSS, min / median / max "
         f"of {args.repeat}", peaks("old"), peaks("new"), "<= 2048 MiB"),
        ("  the same, the trainer keeping every activation (no activation checkpointing)", "",
         peaks("new+keepact"), ""),
        ("  the same, new engine with the unchunked loss logits", "", peaks("new+fullloss"), ""),
        ("  the same, new engine serving LoRA merged, trainer with its own base", "", peaks("new+merged"), ""),
        ("  (same runs: median wall time, streams + 2 train steps)", wall("old"), wall("new"), ""),
    ]


def fmt(xs: list[float]) -> str:
    """One figure, or the median [min-max] of several."""
    return f"{xs[0]:.1f}" if len(xs) == 1 else f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"


def speed_rows(model_dir: Path, args: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """Decode tokens/s at 1, 8 and 32 streams, old and new engine, `--speed-repeat` runs each,
    alternating which engine goes first."""
    rows: list[tuple[str, str, str, str]] = []
    n = args.speed_repeat
    for c in (1, 8, 32):
        runs: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(n):
            for w in ("old", "new") if r % 2 == 0 else ("new", "old"):
                runs[w].append(run_child(f"speed{c}:{w}", model_dir, args)["tok_s"])

        label = f"SmolLM2 decode tokens/s, {c} stream(s) x 32" + (f", median [min-max] of {n}" if n > 1 else "")
        rows.append((label, fmt(runs["old"]), fmt(runs["new"]), ">= old"))
    long: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    for r in range(n):
        for w in ("old", "new") if r % 2 == 0 else ("new", "old"):
            long[w].append(run_child(f"long{LONG_PROMPT}:{w}", model_dir, args))
    rows.append((f"  1 stream, a {LONG_PROMPT:,}-token prompt: decode tokens/s after the first token",
                 fmt([x["tok_s"] for x in long["old"]]), fmt([x["tok_s"] for x in long["new"]]), ">= old"))
    rows.append(("  (same runs: the prompt's prefill, seconds)", fmt([x["prefill_s"] for x in long["old"]]),
                 fmt([x["prefill_s"] for x in long["new"]]), ""))
    return rows


def other_rows(model_dir: Path, tiny: Path, args: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """Growth (tiny model), decode speed and exactness (SmolLM2), old and new engine."""
    rows: list[tuple[str, str, str, str]] = []
    mib = 1024
    g = {w: run_child(f"growth:{w}", tiny, args) for w in ("old", "new")}
    for w in ("old", "new"):
        g[w]["pct"] = 100 * (g[w]["rss_n_kb"] / g[w]["rss100_kb"] - 1)
    rows.append((f"tiny, RSS after 100 -> {args.requests} requests",
                 f"{g['old']['rss100_kb'] / mib:.0f} -> {g['old']['rss_n_kb'] / mib:.0f} MiB ({g['old']['pct']:+.1f}%)",
                 f"{g['new']['rss100_kb'] / mib:.0f} -> {g['new']['rss_n_kb'] / mib:.0f} MiB ({g['new']['pct']:+.1f}%)",
                 "within 10%"))
    rows += speed_rows(model_dir, args)
    for c in (1, 8, 32):
        ls = {w: run_child(f"lspeed{c}:{w}", model_dir, args) for w in ("merged", "adapter")}
        rows.append((f"  {c} stream(s), a LoRA r8 version: merged (left) / adapter (right)", f"{ls['merged']['tok_s']:.1f}",
                     f"{ls['adapter']['tok_s']:.1f}", ""))
    ex = {w: run_child(f"exact:{w}", model_dir, args) for w in ("old", "new")}
    rows.append(("SmolLM2 max |batched - unbatched logprob|, 8 x 32", f"{ex['old']['diff']:.2e}",
                 f"{ex['new']['diff']:.2e}", "<= 1e-4"))
    rows.append(("SmolLM2 max |batched - full forward logprob|, 8 x 32", "", f"{ex['new']['ref_diff']:.2e}",
                 "<= 1e-4"))
    rows += kv_dtype_rows(model_dir, args)
    return rows


def kv_dtype_rows(model_dir: Path, args: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """Keys and values in bfloat16 against float32, the same greedy streams (kv_dtype)."""
    kv = run_child("kvdtype:new", model_dir, args)
    return [(f"SmolLM2 |bf16 - fp32 KV logprob|, 8 x 32 greedy, {kv['compared']} of {kv['of']} tokens before the "
             "first difference: max / mean", "", f"{kv['max']:.2e} / {kv['mean']:.2e}", ""),
            ("  (same runs: decode tokens/s, fp32 KV (left) / bf16 KV (right))", f"{kv['tok_s_fp32']:.1f}",
             f"{kv['tok_s_bf16']:.1f}", "")]


def up_rows(model_dir: Path, args: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """The headline: `clawbridge up` itself under HTTP load (bench/up_memory.py), the KV settings as
    before issue 32 (left) against the defaults (right), one run each, one after the other."""
    from up_load import SessionLoad
    from up_memory import measure

    load = SessionLoad(args.up_sessions, args.streams, args.up_turns, args.tokens)
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as work:
        for mode in ("old", "new"):
            runs[mode] = measure(model_dir, Path(work), mode, load, args.up_drain)
            print(f"[up:{mode}] {json.dumps(runs[mode])}", file=sys.stderr, flush=True)
    old, new = runs["old"], runs["new"]

    def kv(r: dict[str, Any]) -> str:
        k = r["kv"]
        return f"{k['kv_budget_tokens']:,} {k['kv_dtype']}, {k['kv_high_water_tokens']:,} written"

    def reuse(r: dict[str, Any]) -> str:
        return f"{r['prefix'].get('token_hit_rate', 0):.0%} / {r['prefix'].get('turn_hit_rate', 0):.0%}"

    return [
        (f"clawbridge up, SmolLM2 + LoRA, {load.concurrency} streams, {load.sessions} sessions x {load.turns} "
         f"turns x {load.max_tokens} tok, rewarded: tree peak RSS (old KV settings / defaults)",
         f"{old['peak_mib']:.0f} MiB", f"{new['peak_mib']:.0f} MiB", "<= 2048 MiB"),
        ("  KV positions: budget, dtype, written at the end", kv(old), kv(new), ""),
        ("  prefix cache: share of prompt tokens / of turns reused", reuse(old), reuse(new), "reused"),
        ("  turns, training steps, errors", f"{old['turns']}, {old['steps']}, {old['n_errors']}",
         f"{new['turns']}, {new['steps']}, {new['n_errors']}", ""),
        ("  load average at the end of each run", old["load_avg"], new["load_avg"], ""),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 streams x 16 tokens, 200 requests")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3, help="serve+train runs per engine (peak: min/median/max)")
    ap.add_argument("--only-serve", action="store_true", help="only the object-level serve+train peak rows")
    ap.add_argument("--only-up", action="store_true", help="only the `clawbridge up` rows")
    ap.add_argument("--only-kv-dtype", action="store_true", help="only the bf16 against fp32 KV rows")
    ap.add_argument("--up-sessions", type=int, default=64, help="clawbridge up rows: sessions")
    ap.add_argument("--up-turns", type=int, default=3, help="clawbridge up rows: turns per session")
    ap.add_argument("--up-drain", type=float, default=900.0, help="clawbridge up rows: seconds to finish training")
    ap.add_argument("--only-speed", action="store_true", help="only the decode speed rows")
    ap.add_argument("--speed-repeat", type=int, default=1,
                    help="runs per engine of each decode speed row (median [min-max]; engines alternate first)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps({k: v for k, v in child(args).items() if k != "lps"}))
        return
    if args.quick:
        args.streams, args.tokens, args.requests, args.up_sessions, args.up_turns = 4, 16, 200, 8, 2
    from clawbridge_local.trainer.batch import write_batch
    from train_throughput import make_batch

    from clawbridge.devtools.tinymodel import build_tiny_model
    from clawbridge.models import cached_model

    t0 = time.perf_counter()
    smol = cached_model("smollm2-135m-instruct")
    rows: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "smol"
        work.mkdir()
        os.symlink(smol, work / "model")
        write_batch(work / "batch.json", make_batch(work / "model", 4, 64, 32))
        tiny = build_tiny_model(Path(tmp) / "tiny" / "model")
        if args.only_speed:
            rows += speed_rows(work / "model", args)
        elif args.only_kv_dtype:
            rows += kv_dtype_rows(work / "model", args)
        else:
            if not args.only_serve:
                rows += up_rows(work / "model", args)
            if not args.only_up:
                rows += serve_rows(work / "model", args)
            if not args.only_serve and not args.only_up:
                rows += other_rows(work / "model", tiny, args)
    widths = [max(len(r[i]) for r in [*rows, ("measurement", "old engine", "KV-pool engine", "target")])
              for i in range(4)]
    print(f"OMP_NUM_THREADS=1, one process per measurement; {time.perf_counter() - t0:.0f} s in all")
    for r in [("measurement", "old engine", "KV-pool engine", "target"), *rows]:
        print("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
