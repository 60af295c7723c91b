"""`clawbridge demo --model smollm2`: the real-model demo's console output (`clawbridge.devtools.realdemo` runs it)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from clawbridge.cli.common import table

CAPABILITY_BOUND = 0.25
"""The capability check fails if the share of fact questions answered with the right entity falls
by more than this (3 of 12 questions)."""


def run(out_dir: Path, lora_rank: int | None, learning_rate: float | None, seed: int, rounds: int | None,
        console: Console, err: Console, promotion: str = "off", tolerance: float | None = None) -> None:
    from clawbridge.devtools.realdemo import (
        COMPLAINT,
        THANKS,
        TRAIN_ANSWERS,
        TRAIN_PROMPTS,
        WRONG,
        RealDemoConfig,
        run_real_demo,
        samples,
    )
    from clawbridge.models import ModelFetchError

    base = RealDemoConfig()
    cfg = RealDemoConfig(lora_rank=base.lora_rank if lora_rank is None else lora_rank,
                         learning_rate=learning_rate or base.learning_rate, seed=seed, rounds=rounds or base.rounds,
                         promotion=promotion, tolerance=base.tolerance if tolerance is None else tolerance)
    console.print(f"demo: SmolLM2-135M-Instruct, local backend, LoRA rank {cfg.lora_rank} (0: full fine-tuning), "
                  f"learning rate {cfg.learning_rate:g}, {cfg.sessions} sessions over {len(TRAIN_PROMPTS)} "
                  f"questions, promotion {cfg.promotion}"
                  + (f" (tolerance {cfg.tolerance:g})" if cfg.promotion == "eval" else "") + f"; output in {out_dir}")
    console.print(f"the scripted user says {COMPLAINT!r} to an answer that does not end within {cfg.short_tokens} "
                  f"tokens, {WRONG!r} to a short one that misses the known answer ({len(TRAIN_ANSWERS)} of the "
                  f"questions have one), and {THANKS!r} to the others; a RULE-BASED judge (keyword rules, not a "
                  "language model) reads that reply (the next state) and gives +1 / -1; nothing else is rewarded")

    def say(line: str) -> None:
        console.print(line, highlight=False, soft_wrap=True)

    try:
        result = run_real_demo(cfg, out_dir, say=say)
    except ModelFetchError as exc:
        err.print(f"[red]could not get the model:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from None
    except Exception as exc:
        err.print(f"[red]demo failed:[/red] {exc}; see {out_dir / 'state' / 'proxy.log'}", highlight=False)
        raise typer.Exit(1) from None
    b, a = result.before, result.after
    assert b is not None and a is not None
    measures = table("held-out measure", f"before (v{b.policy_version})", f"after (v{a.policy_version})")
    measures.add_row(f"preference rate (answer ends within {cfg.short_tokens} tokens)",
                     f"{b.preference_rate:.2f}", f"{a.preference_rate:.2f}")
    measures.add_row("mean answer tokens", f"{b.mean_tokens:.1f}", f"{a.mean_tokens:.1f}")
    measures.add_row(f"capability ({len(b.facts)} facts named)", f"{b.capability:.2f}", f"{a.capability:.2f}")
    console.print(measures)
    for q, before, after in samples(result, 3):
        console.print(f"[bold]{q}[/bold]\n  before: {before!r}\n  after:  {after!r}", highlight=False, soft_wrap=True)
    if result.promotion and result.promotion.get("mode") != "off":
        decisions = [d for d in result.promotion.get("decisions") or [] if d.get("source") != "admin"]
        verdicts = [d.get("verdict") for d in decisions]
        console.print(f"promotion (eval on the {len(b.facts)} facts): {verdicts.count('promoted')} version(s) promoted, "
                      f"{verdicts.count('rejected')} rejected; serving v{result.promotion.get('serving_version')} "
                      "(the 'after' column)")
        for d in reversed(decisions):
            console.print(f"  v{d.get('version')} {d.get('verdict')}: {d.get('reason')}", highlight=False, soft_wrap=True)
    ok = a.capability >= b.capability - CAPABILITY_BOUND
    console.print(f"capability check (may fall by at most {CAPABILITY_BOUND:.2f}): {'held' if ok else 'FAILED'}")
    console.print(f"{result.steps} training steps; {result.judge_calls} judge calls; {result.seconds:.0f}s in all")
    if result.plot:
        console.print(f"plot: {result.plot}")
