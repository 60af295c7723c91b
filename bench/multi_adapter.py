"""Many users' adapters over one base: through `clawbridge up` (issue 32 §2), and in the engine alone.

`--via up` (the default): one `clawbridge up --backend local --model M` with per-user adapters
(`per_user_adapters`, LoRA at its defaults, `max_user_adapters` at its default unless
`--max-user-adapters`), driven over HTTP with the real `openai` SDK:
1. `--users` users each run one rewarded session (sampled, `--concurrency` at a time), and each
   user's lane trains one step on it (`batch_size` 1), so every user has a trained adapter;
2. latency: `--calls` greedy streamed calls one at a time, each from a random user or (one in
   four) the shared client key (the base, no adapter); a user's call is "resident" when no adapter
   was loaded during it and "loaded" when its version was loaded from its checkpoint (the server's
   log says which); the added latency is the call's time to first token less the median of the
   base calls' in the same run (p50 / p99);
3. mixing: `--calls` greedy calls of random users, `--concurrency` at a time;
4. after the server stopped, every user turn of 2-3 is checked against the answer its version's
   adapter gives loaded alone (its checkpoint in a fresh engine, one request at a time, keys and
   values in the dtype the server used): tokens equal, or where they differ, the margin between the
   reference's two best tokens at the first difference (a near tie of batched arithmetic, not the
   wrong adapter, which differs at once and by far).
Memory: the RSS of the `up` process tree (psutil) after loading, its peak, and after the calls.

`--via engine`: the engine alone, in one process, OMP_NUM_THREADS=1, on SmolLM2-135M-Instruct fp32:
- memory: the engine's RSS after loading, then after each of `--adapters` LoRA versions (rank
  `--rank` on the default target modules: every attention and MLP projection and lm_head, random
  weights) is loaded beside the published one (`TorchEngine.load_version`); the growth per adapter
  against the adapter's own tensor bytes (`LoraAdapter.nbytes`).
- decode: `--streams` concurrent streams of `--tokens` tokens (sampled, seeded), wall time from
  the first request to the last token, three ways in the same run, interleaved over `--rounds`:
  the base alone (no adapter), every stream on the same adapter (the baseline: one version per
  batch), and every stream on its own adapter (one decode forward whose rows add different
  adapters, `lora_serving.AdapterHooks`). Median of the rounds.

Run:
    python bench/multi_adapter.py --model tiny                     # 64 users through up (minutes)
    nice -n 10 python bench/multi_adapter.py --model smollm2       # the same on SmolLM2 (long)
    python bench/multi_adapter.py --via engine                     # the engine alone (2-3 minutes)
    python bench/multi_adapter.py --via engine --model tiny --rounds 1      # quick
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from bench_common import exit_on_sigterm, model_folder, rss_mib  # noqa: E402
from clawbridge_local.engine import TorchEngine  # noqa: E402
from clawbridge_local.lora_serving import LoraAdapter  # noqa: E402
from up_load import TreeRss, UpServer, load_average, median  # noqa: E402

from clawbridge.config import LORA_TARGET_MODULES  # noqa: E402
from clawbridge.devtools.demo import PROMPTS  # noqa: E402
from clawbridge.serving.sampler import Sampler, SamplingParams  # noqa: E402


def random_adapter(model: torch.nn.Module, seed: int, rank: int, targets: list[str]) -> LoraAdapter:
    """A LoRA adapter of `rank` on every linear module whose name ends with one of `targets`."""
    return LoraAdapter.from_peft(random_peft_tensors(model, seed, rank, targets), 2.0, f"random adapter {seed}")


def random_peft_tensors(model: torch.nn.Module, seed: int, rank: int, targets: list[str]) -> dict[str, torch.Tensor]:
    """`random_adapter`'s tensors, peft-named as an adapter export or a checkpoint holds them."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules():
        weight = getattr(mod, "weight", None)
        if name.split(".")[-1] not in targets or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        out_f, in_f = weight.shape
        tensors[f"base_model.model.{name}.lora_A.default.weight"] = torch.randn(rank, in_f, generator=gen) * 0.02
        tensors[f"base_model.model.{name}.lora_B.default.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
    return tensors


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


# ------------------------------------------------------------------------------ through clawbridge up


@dataclass
class Call:
    """One greedy call through the proxy."""

    user: str | None
    """None: the shared client key (the base)."""
    first_token_s: float
    total_s: float
    turn_id: str
    loaded: bool = False
    """An adapter was loaded from its checkpoint while it ran."""


def greedy_call(server: UpServer, key: str, user: str | None, prompt: str, max_tokens: int) -> Call:
    import openai

    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key=key, max_retries=0, timeout=600)
    t0 = time.monotonic()
    first: float | None = None
    turn_id = ""
    stream = client.chat.completions.create(model="model", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0.0, stream=True)
    for chunk in stream:
        turn_id = chunk.id.replace("chatcmpl-", "turn_")
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - t0
    total = time.monotonic() - t0
    return Call(user, total if first is None else first, total, turn_id)


def train_users(server: UpServer, keys: dict[str, str], concurrency: int) -> None:
    """One rewarded, ended session per user (sampled), so each user's lane trains one step."""
    import httpx
    import openai

    def one(i: int) -> None:
        user = list(keys)[i]
        h = {"Authorization": f"Bearer {keys[user]}"}
        started = httpx.post(f"{server.base}/rl/start_session", json={}, headers=h, timeout=600)
        started.raise_for_status()
        key = started.json()["api_key"]
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key=key, max_retries=3, timeout=600)
        client.chat.completions.create(model="model", messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                       max_tokens=16, temperature=1.0, seed=i)
        kh = {"Authorization": f"Bearer {key}"}
        httpx.post(f"{server.base}/rl/set_reward", json={"reward": float(i % 2)}, headers=kh, timeout=600).raise_for_status()
        httpx.post(f"{server.base}/rl/end_session", json={}, headers=kh, timeout=600).raise_for_status()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(keys))))


def check_alone(model_dir: str, state: Path, calls: list[Call], kv_dtype: str) -> dict[str, Any]:
    """Each user call's recorded answer against its version's adapter loaded alone (module docstring)."""
    import sqlite3

    from safetensors.torch import load_file

    from clawbridge.config import Settings
    from clawbridge.serving.sampler import SamplingParams
    from clawbridge.store import DB_FILENAME
    from clawbridge.store.codec import decode_ids

    conn = sqlite3.connect(f"file:{state / DB_FILENAME}?mode=ro", uri=True)
    ckpt = {int(v): (str(lane), str(c)) for v, lane, c in conn.execute(
        "SELECT version, lane, checkpoint FROM policy_versions WHERE status='committed' AND lane != ''")}
    turns = {t: (decode_ids(p), decode_ids(c), int(v)) for t, p, c, v in conn.execute(
        "SELECT turn_id, prompt_token_ids, completion_token_ids, policy_version FROM turns")}
    conn.close()
    s = Settings()
    scale = float(s.lora_alpha) / s.lora_rank
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[kv_dtype]
    engine = TorchEngine.load(model_dir, device="cpu", dtype="float32", progress=False, kv_dtype=dtype)
    alone: dict[int, Any] = {}
    out: dict[str, Any] = {"checked": 0, "equal": 0, "own_version": 0, "differ": []}

    async def go() -> None:
        for call in calls:
            if call.user is None:
                continue
            prompt, got, version = turns[call.turn_id]
            out["checked"] += 1
            out["own_version"] += ckpt.get(version, ("", ""))[0] == call.user
            if version not in alone:
                path = Path(ckpt[version][1])
                alone[version] = await engine.load_version(
                    LoraAdapter.from_peft(load_file(str(path / "model.safetensors")), scale, str(path)), version)
            stream = await alone[version].sample(prompt, SamplingParams(max_tokens=len(got), temperature=0.0,
                                                                        top_logprobs=2, stop_token_ids=()))
            ref = [t async for t in stream]
            ids = [t.token_id for t in ref]
            if ids == got:
                out["equal"] += 1
                continue
            k = next(i for i, (a, b) in enumerate(zip(ids, got, strict=False)) if a != b)
            tops = ref[k].top_logprobs
            out["differ"].append({"user": call.user, "at": k, "margin": tops[0][1] - tops[1][1]})

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()
    return out


def pct(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))] if ys else float("nan")


def run_up(model_dir: str, work: Path, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    env = {"CLAWBRIDGE_PER_USER_ADAPTERS": "true", "CLAWBRIDGE_BATCH_SIZE": "1", "CLAWBRIDGE_BASELINE": "none",
           "CLAWBRIDGE_TRAINER_POLL_INTERVAL_S": "0.5", "CLAWBRIDGE_LOCAL_DEVICE": "cpu",
           "CLAWBRIDGE_LOCAL_ENGINE": "torch"}
    if args.max_user_adapters:
        env["CLAWBRIDGE_MAX_USER_ADAPTERS"] = str(args.max_user_adapters)
    if args.kv_dtype != "auto":
        env["CLAWBRIDGE_LOCAL_KV_DTYPE"] = args.kv_dtype
    t0 = time.monotonic()
    server = UpServer.start(Path(model_dir), work / "state", env, log_level="info")
    rss = TreeRss(server.proc.pid)
    loaded_rss = rss.now()
    try:
        keys = {f"user{i:02d}": server.add_user(f"user{i:02d}") for i in range(args.users)}
        train_users(server, keys, args.concurrency)
        st = server.wait_trained(args.drain)
        lanes = st.get("lanes") or {}
        trained = sum(1 for lane in lanes.values() if lane["serving_version"])
        trained_s = time.monotonic() - t0
        after_train = rss.now()
        rng = random.Random(0)
        users = list(keys)
        calls: list[Call] = []
        for i in range(args.calls):  # one at a time: which calls loaded an adapter is known from the log
            user = None if rng.random() < 0.25 else rng.choice(users)
            mark = server.log_size()
            call = greedy_call(server, keys[user] if user else server.client_key, user, PROMPTS[i % len(PROMPTS)],
                               args.tokens)
            call.loaded = "loaded policy version" in server.log_since(mark)
            calls.append(call)
        plan = [rng.choice(users) for _ in range(args.calls)]
        with ThreadPoolExecutor(args.concurrency) as pool:
            mixed = list(pool.map(lambda iu: greedy_call(server, keys[iu[1]], iu[1], PROMPTS[iu[0] % len(PROMPTS)],
                                                         args.tokens), enumerate(plan)))
        final = server.status()
        steady = rss.now()
    finally:
        peak = rss.stop()
        server.stop()
    eng = final.get("engine") or {}
    kv_dtype = eng.get("kv_dtype") or "fp32"
    per_token = eng.get("kv_budget_bytes", 0) / max(1, eng.get("kv_budget_tokens", 1))
    kv_written = eng.get("kv_high_water_tokens", 0) * per_token
    check = check_alone(model_dir, server.state_dir, calls + mixed, kv_dtype)
    base = median([c.first_token_s for c in calls if c.user is None])
    resident = [c.first_token_s - base for c in calls if c.user is not None and not c.loaded]
    loading = [c.first_token_s - base for c in calls if c.user is not None and c.loaded]
    mib = 2**20
    near_ties = [d for d in check["differ"] if d["margin"] < 1e-2]
    return [
        ("users with a trained adapter", f"{trained} of {args.users}", f"{trained_s:.0f} s to train them"),
        ("max_user_adapters / max_loaded_versions / max_lane_trainers",
         f"{args.max_user_adapters or 'default'}", "(defaults 16 / 2 / 2 unless set)"),
        ("up tree RSS: loaded / after training / after the calls / peak",
         f"{loaded_rss / mib:.0f} / {after_train / mib:.0f} / {steady / mib:.0f} / {peak / mib:.0f} MiB", ""),
        ("  of it, the KV pool written so far (resident; bounded by its budget)",
         f"{kv_written / mib:.0f} MiB", f"budget {eng.get('kv_budget_bytes', 0) / mib:.0f} MiB, {kv_dtype}"),
        (f"base calls (shared key): time to first token, median of {sum(c.user is None for c in calls)}",
         f"{base * 1000:.0f} ms", ""),
        (f"added latency, adapter resident: p50 / p99 of {len(resident)}",
         f"{pct(resident, 0.5) * 1000:.0f} / {pct(resident, 0.99) * 1000:.0f} ms", ""),
        (f"added latency, adapter loaded from its checkpoint: p50 / p99 of {len(loading)}",
         f"{pct(loading, 0.5) * 1000:.0f} / {pct(loading, 0.99) * 1000:.0f} ms", ""),
        (f"user calls answered by the caller's own version ({args.concurrency} at a time for half)",
         f"{check['own_version']} of {check['checked']}", ""),
        ("  their tokens equal to the adapter loaded alone", f"{check['equal']} of {check['checked']}",
         f"{len(near_ties)} differ at a near tie (< 0.01 nats), {len(check['differ']) - len(near_ties)} otherwise"
         + "".join(f"; {d['user']} at token {d['at']} (margin {d['margin']:.3f})"
                   for d in check["differ"] if d["margin"] >= 1e-2)),
        ("load average (1, 5, 15 min) at the end", load_average(), ""),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--via", choices=["up", "engine"], default="up")
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--users", type=int, default=64, help="up: users, each with a trained adapter")
    ap.add_argument("--calls", type=int, default=128, help="up: calls in each of the two phases")
    ap.add_argument("--concurrency", type=int, default=8, help="up: sessions or calls at a time")
    ap.add_argument("--max-user-adapters", type=int, default=0, help="up: 0 keeps the default")
    ap.add_argument("--kv-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="up: the engine's kv_dtype (auto: bf16 on the CPU for a float32 model)")
    ap.add_argument("--drain", type=float, default=3600.0, help="up: seconds the lanes get to train")
    ap.add_argument("--adapters", type=int, default=8, help="engine: adapters loaded beside the published one")
    ap.add_argument("--rank", type=int, default=8, help="engine: LoRA rank")
    ap.add_argument("--streams", type=int, default=8, help="engine: concurrent streams")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="engine: rounds")
    args = ap.parse_args()
    exit_on_sigterm()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_folder(args.model, tmp)
        rows = run_up(model_dir, Path(tmp), args) if args.via == "up" else asyncio.run(run(model_dir, args))
    print(f"\nmodel {args.model} via {args.via}, torch {torch.__version__}, OMP_NUM_THREADS=1"
          + (f", {args.rounds} round(s)" if args.via == "engine" else f", {args.users} users"))
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>10}  {note}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
