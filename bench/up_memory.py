"""Memory of `clawbridge up` itself under an agent's load (issue 32 §1), against the old KV settings.

One run per mode, one at a time, each a fresh `clawbridge up --backend local --model M` (LoRA
training at its defaults: rank 32, batch 8), driven over HTTP by `up_load.run_sessions`: `--sessions`
sessions of `--turns` streamed turns of up to `--tokens` tokens, `--streams` at a time, every turn
rewarded, every session ended, so training steps run meanwhile; then up to `--drain` seconds for the
trainer to finish what is ready. Measured from outside: the peak RSS of the `up` process tree
(psutil, sampled every 50 ms through the run and the drain), the RSS once loaded, and from
`/rl/status`: the KV budget the engine chose (and why), the prefix cache's reuse, and training steps.

Modes (settings only; the same code):
- `old`: as before issue 32: a KV budget of max_running_requests x min(context, 4096) positions,
  float32 keys and values, glibc's allocator as it comes (`malloc_mmap_threshold_kib` 0);
- `glibc`: the defaults but glibc's allocator as it comes;
- `fp32`: the defaults but float32 keys and values;
- `new`: the defaults (the budget sized from memory, keys and values in the default `kv_dtype`,
  allocations of 1 MiB and more given back when freed).

Run (SmolLM2 takes ~10 minutes per mode on 2 shared cores; nice it):
    python bench/up_memory.py                          # SmolLM2, every mode
    python bench/up_memory.py --model tiny --sessions 16 --turns 2 --tokens 24   # quick check
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ["OMP_NUM_THREADS"] = "1"

from bench_common import exit_on_sigterm, model_folder  # noqa: E402
from up_load import SessionLoad, TreeRss, UpServer, load_average, prefix_figures, run_sessions  # noqa: E402

MODES: dict[str, dict[str, str]] = {
    "old": {"CLAWBRIDGE_LOCAL_KV_BUDGET_TOKENS": "old", "CLAWBRIDGE_LOCAL_KV_DTYPE": "float32",
            "CLAWBRIDGE_LOCAL_MALLOC_MMAP_THRESHOLD_KIB": "0"},
    "glibc": {"CLAWBRIDGE_LOCAL_MALLOC_MMAP_THRESHOLD_KIB": "0"},
    "fp32": {"CLAWBRIDGE_LOCAL_KV_DTYPE": "float32"},
    "new": {},
}
"""Settings per mode; "old" as a budget is replaced by the old automatic figure for the model."""


def old_budget(model_dir: Path, max_running: int) -> int:
    """The automatic KV budget before issue 32: max(context, max_running x min(context, 4096))."""
    cfg = json.loads((model_dir / "config.json").read_text())
    context = int(cfg["max_position_embeddings"])
    return max(context, max_running * min(context, 4096))


def measure(model_dir: Path, work: Path, mode: str, load: SessionLoad, drain_s: float,
            extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """One `clawbridge up` run in `mode` under `load`; its figures."""
    env = {"CLAWBRIDGE_LOCAL_DEVICE": "cpu", "CLAWBRIDGE_LOCAL_ENGINE": "torch",
           "CLAWBRIDGE_TRAINER_POLL_INTERVAL_S": "0.5", "CLAWBRIDGE_DEFAULT_MAX_TOKENS": str(load.max_tokens)}
    env.update(extra_env or {})
    for k, v in MODES[mode].items():
        env[k] = str(old_budget(model_dir, 8)) if v == "old" else v
    t0 = time.monotonic()
    server = UpServer.start(model_dir, work / f"state-{mode}", env, served_name=load.model)
    try:
        rss = TreeRss(server.proc.pid)
        loaded = rss.now()
        result = run_sessions(server, load)
        served_peak = rss.peak_bytes
        st = server.wait_trained(drain_s)
        peak = rss.stop()
        engine = st.get("engine") or {}
        figures = {
            "mode": mode, "loaded_mib": loaded / 2**20, "served_peak_mib": served_peak / 2**20,
            "peak_mib": peak / 2**20, "turns": result.turns, "tokens": result.tokens, "errors": result.errors[:3],
            "n_errors": len(result.errors), "wall_s": result.wall_s, "total_s": time.monotonic() - t0,
            "first_token_p50_s": result.p(0.5), "steps": st["trainer"]["steps"]["ok"],
            "kv": {k: engine.get(k) for k in ("kv_budget_tokens", "kv_dtype", "kv_budget_bytes", "kv_budget_reason",
                                             "kv_high_water_tokens")},
            "prefix": prefix_figures(engine, st["store"]),
            "timeline_mib": [(t, round(b / 2**20)) for t, b in rss.timeline[:: max(1, len(rss.timeline) // 40)]],
            "load_avg": load_average(),
        }
    finally:
        server.stop()
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--modes", default="old,new", help="comma-separated, run in this order (old, glibc, fp32, new)")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--drain", type=float, default=600.0, help="seconds the trainer gets after the load")
    args = ap.parse_args()
    exit_on_sigterm()
    load = SessionLoad(args.sessions, args.streams, args.turns, args.tokens)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(model_folder(args.model, tmp))
        for mode in args.modes.split(","):
            runs.append(measure(model_dir, Path(tmp), mode, load, args.drain))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    print(f"clawbridge up, {args.model} + LoRA (defaults), {args.sessions} sessions x {args.turns} turns x <= "
          f"{args.tokens} tokens, {args.streams} at a time, rewarded; OMP_NUM_THREADS=1")
    for r in runs:
        kv = r["kv"]
        print(f"{r['mode']:>5}: tree peak {r['peak_mib']:.0f} MiB (serving {r['served_peak_mib']:.0f}, "
              f"loaded {r['loaded_mib']:.0f}); KV {kv['kv_budget_tokens']} positions {kv['kv_dtype']}, high water "
              f"{kv['kv_high_water_tokens']}; prefix reuse {r['prefix'].get('token_hit_rate')} of prompt tokens, "
              f"{r['prefix'].get('turn_hit_rate')} of turns; {r['turns']} turns, {r['tokens']} tokens, "
              f"{r['steps']} steps, {r['n_errors']} errors; {r['wall_s']:.0f} s load, {r['total_s']:.0f} s all; "
              f"load avg {r['load_avg']}")


if __name__ == "__main__":
    main()
