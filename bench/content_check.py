"""What the gate's content check sees in every saved version of `bench/learn_from_talk.py` runs.

    python bench/learn_from_talk.py --persona name --pace 1 --seeds 1 --sessions 32 --out runs/sam
    python bench/content_check.py runs/sam                       # every version the run kept
    python bench/content_check.py runs/sam runs/leo --versions 0,8,16,24,32

For each version whose checkpoint a run kept, through the product's own code (the local torch
engine loads the checkpoint's LoRA adapter as `clawbridge up` does; `clawbridge.promotion.content`
reads the run's store for the agent's latest context, its system prompt and its caller's notes, and
builds the set; `clawbridge.promotion.runner` answers it greedily, as the gate does), it prints:
- `own context` how many of the 12 everyday answers, asked in the context of the run's last call,
  talk about their question (`clawbridge.chat.topic.on_topic`): the content check's figure;
- `gate's context` the same questions in the everyday guard's own profile and note
  (`in_context_set`), scored the same way: what a check with a fixed context would read;
- `check` whether the content check would pass the version against the base (v0) with the default
  slack (the serving version is the other bar in a run; this compares with the base only);
- `gate then` what the run's own gate decided for it (that run's code and settings);
- the first answer that is off topic in the own context, so a reader sees what a figure stands for.
The base (v0) is the baseline of every run. The context is the run's LAST one, for every version.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import set_threads_from_argv

set_threads_from_argv(2)

from everyday_guard import Router, by_run, checkpoints, gate_verdicts, sweep  # noqa: E402  (after the thread count is set)


async def one_run(run: Path, keep: set[int] | None, model: str, settings: Any) -> list[dict[str, Any]]:
    from clawbridge_local.engine import TorchEngine

    from clawbridge.chat.render import Renderer
    from clawbridge.promotion.content import agent_context, content_set
    from clawbridge.promotion.evalset import EvalItem, EvalSet
    from clawbridge.promotion.everyday import in_context_set
    from clawbridge.promotion.runner import Evaluator
    from clawbridge.store import Store

    (db,) = run.glob("**/state/clawbridge.db")
    store = Store(db)
    try:
        context = agent_context(store, settings.per_user_adapters, settings.notes)
    finally:
        store.close()
    assert context is not None, f"{run}: no recorded call"
    own = content_set(context, settings.notes_place)
    fixed = in_context_set(settings.notes_place)
    gates = EvalSet(tuple(EvalItem("topic", i.id, i.messages, i.chat, question=q.question)
                          for i, q in zip(fixed.items, own.items, strict=True)), fixed.source, fixed.digest,
                    fixed.max_tokens)
    found, verdicts = checkpoints(run), gate_verdicts(run)
    engine = TorchEngine.load(model, device="cpu", max_running=8, max_queued=64, progress=False)
    renderer = Renderer.from_pretrained(model)
    ev = Evaluator(Router(engine, found, float(settings.lora_alpha) / settings.lora_rank), renderer)  # type: ignore[arg-type]
    print(f"{run}: context of turn {context.turn_id}: system {context.system[:70]!r}, notes {context.notes!r}", flush=True)
    rows: list[dict[str, Any]] = []
    base: int | None = None
    try:
        for version in sorted(v for v in found if keep is None or v in keep or v == 0):
            mine = await ev.evaluate(version, own)
            theirs = await ev.evaluate(version, gates)
            base = mine.passed if version == 0 else base
            passes = base is None or mine.passed >= base - settings.content_check_slack
            off = next((a for a in mine.failed_answers if a), "")
            row = {"run": str(run), "version": version, "own": mine.passed, "gates": theirs.passed, "items": mine.items,
                   "passes": passes, "gate": verdicts.get(version, "-"), "off": " ".join(off.split())[:80]}
            rows.append(row)
            print(f"{'/'.join(run.parts[-2:]):>14} v{version:<3} own context {mine.passed:>2}/{mine.items}  gate's context "
                  f"{theirs.passed:>2}/{theirs.items}  check {'passes' if passes else 'REJECTS'}  gate then: "
                  f"{row['gate']:<8}  off topic: {row['off']!r}", flush=True)
    finally:
        engine.shutdown()
    return rows


def main() -> None:
    runs, table = sweep(__doc__ or "", one_run, "comma-separated versions (default: every kept checkpoint; v0 always)")
    print("\nrun | versions | own context: base -> lowest (version) | gate's context: base -> lowest | "
          "the check would reject | the run's gate rejected (of the versions read)")
    for run, rows in by_run(runs, table):
        low = min(rows[1:] or rows, key=lambda r: r["own"])  # the lowest trained version
        rejects = [f"v{r['version']}" for r in rows if not r["passes"]]
        gated = [f"v{r['version']}" for r in rows if r["gate"] == "rejected"]
        print(f"{run} | {len(rows)} | {rows[0]['own']} -> {low['own']} (v{low['version']}) of {low['items']} | "
              f"{rows[0]['gates']} -> {min(r['gates'] for r in rows[1:] or rows)} | {len(rejects)}: {', '.join(rejects[:10]) or '-'} | "
              f"{len(gated)}: {', '.join(gated[:10]) or '-'}")


if __name__ == "__main__":
    main()
