"""Does training collapse? The tiny demo through `clawbridge up`, per training setting and seed (issue 15).

Each run is `clawbridge demo` shortened to `--sessions` (default 240: the CI test's length): the
tiny model, LoRA r8, the reward mode `--reward` (judge: the scripted user and the rule-based
judge, the only rewards; api: the token-share reward set through the API). A run LEARNED, with
api rewards, when its last-20% mean reward beats its first-20% by more than `--margin` (0.15);
with judge rewards, when at least `LEARNED_ACCEPTANCE` (0.9) of its last-20% first answers were accepted by the user,
more than `--accept-margin` (0.1) above its first 20% (the CI test, on seed 0, whose first 20% are
accepted 0.58-0.65 of the time, asks 0.2; seed 2 starts at 0.81). The judge teaches acceptance:
once every answer of a group is accepted its verdicts carry no signal, and the share stops wherever
it stands (0.72 to 0.92 over six runs of seed 0). A run COLLAPSED when its last 20% fell below `--floor`
(0.05: the policy answers with tokens the reward never pays and, with every answer failed, a
group baseline has nothing left to learn from).

`--parallel N` runs N demos at once: each is then one of N trainers and N servers on the same
cores, the loaded condition under which staleness grows (ratios drift further from 1) and the
collapses were seen. The machine's load average is printed with each run.

Settings are compared in the same invocation: the first `--config` is the baseline, each later
one is printed with its difference in learned/collapsed counts. A config is NAME=VAR=VALUE,...
with CLAWBRIDGE_ names shortened (LOSS=ppo means CLAWBRIDGE_LOSS=ppo); `default` is the shipped
defaults.

Usage: python bench/stability.py --config default --config is=LOSS=importance_sampling \
          --seeds 0,1,2,3 --parallel 2 [--reward judge] [--sessions 240]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from clawbridge.devtools.demo import LEARNED_ACCEPTANCE, DemoConfig, run_demo


@dataclass(frozen=True)
class Outcome:
    config: str
    seed: int
    first: float
    last: float
    seconds: float
    load: float
    accepted: tuple[float, float] | None = None
    """judge rewards: the share of first answers accepted, first and last 20%."""

    def learned(self, margin: float, accept_margin: float = 0.1) -> bool:
        if self.accepted is not None:
            return self.accepted[1] >= LEARNED_ACCEPTANCE and self.accepted[1] - self.accepted[0] > accept_margin
        return self.last - self.first > margin

    def collapsed(self, floor: float) -> bool:
        return self.last < floor


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    """NAME or NAME=VAR=VALUE,VAR=VALUE (VAR without its CLAWBRIDGE_ prefix)."""
    name, _, rest = text.partition("=")
    env: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        var, eq, value = part.partition("=")
        if not eq:
            raise SystemExit(f"--config {text!r}: {part!r} is not VAR=VALUE")
        env[var if var.startswith("CLAWBRIDGE_") else f"CLAWBRIDGE_{var.upper()}"] = value
    return name, env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=[], help="NAME[=VAR=VALUE,...]; the first is the baseline")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--reward", choices=["judge", "api"], default="judge")
    ap.add_argument("--sessions", type=int, default=240)
    ap.add_argument("--margin", type=float, default=0.15)
    ap.add_argument("--accept-margin", type=float, default=0.1)
    ap.add_argument("--floor", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=None, help="keep every run's folder here (default: a temp dir)")
    args = ap.parse_args()
    configs = [parse_config(c) for c in (args.config or ["default"])]
    seeds = [int(s) for s in args.seeds.split(",")]
    out = args.out or Path(tempfile.mkdtemp(prefix="clawbridge-stability-"))
    jobs = [(name, env, seed) for seed in seeds for name, env in configs]
    print(f"{len(jobs)} runs, {args.parallel} at a time, reward={args.reward}, sessions={args.sessions}; in {out}",
          flush=True)

    def one(job: tuple[str, dict[str, str], int]) -> Outcome:
        name, env, seed = job
        cfg = DemoConfig(sessions=args.sessions, reward=args.reward, seed=seed, settings=env)
        result = run_demo(cfg, out / f"{name}-seed{seed}")
        first, last = result.head_tail()
        o = Outcome(name, seed, first, last, result.seconds, os.getloadavg()[0], result.acceptance())
        acc = f", accepted {o.accepted[0]:.2f} -> {o.accepted[1]:.2f}" if o.accepted else ""
        print(f"  {name:<14} seed {seed}: {first:.3f} -> {last:.3f}{acc} in {o.seconds:.0f}s (load {o.load:.1f})",
              flush=True)
        return o

    with ThreadPoolExecutor(args.parallel) as pool:
        outcomes = list(pool.map(one, jobs))
    print(f"\n{'config':<14} {'runs':>4} {'learned':>8} {'collapsed':>10} {'mean gain':>10}  settings")
    base: tuple[int, int] | None = None
    for name, env in configs:
        mine = [o for o in outcomes if o.config == name]
        learned = sum(o.learned(args.margin, args.accept_margin) for o in mine)
        collapsed = sum(o.collapsed(args.floor) for o in mine)
        gain = sum(o.last - o.first for o in mine) / len(mine)
        vs = "" if base is None else f"  (vs baseline: learned {learned - base[0]:+d}, collapsed {collapsed - base[1]:+d})"
        base = base or (learned, collapsed)
        shown = ",".join(f"{k.removeprefix('CLAWBRIDGE_')}={v}" for k, v in env.items()) or "(defaults)"
        print(f"{name:<14} {len(mine):>4} {learned:>8} {collapsed:>10} {gain:>+10.3f}  {shown}{vs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
