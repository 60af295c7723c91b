"""What the gate's likelihood guards see in every saved version of `bench/learn_from_talk.py` runs.

    python bench/learn_from_talk.py --together --pace 2 --seeds 0 --out runs/default
    python bench/learn_from_talk.py --together --pace 2 --seeds 0 --set CLAWBRIDGE_LEARNING_RATE=1.3e-3 --out runs/fast
    python bench/everyday_guard.py runs/default runs/fast          # every version each run kept
    python bench/everyday_guard.py runs/fast --versions 0,10,20,30 --threads 2

For each version whose checkpoint a run kept, through the product's own code (the local torch
engine loads the checkpoint's LoRA adapter as `clawbridge up` does; `clawbridge.promotion.runner`
writes the base's reference answers and scores versions on them, exactly as the gate does), it
prints:
- `facts` the likelihood guard's figure (`capability_probe_nats`): nats per token against the
  base's correct answers to the capability probe;
- `everyday` the everyday guard's (`everyday_guard_nats`): against the base's answers to the 12
  everyday questions (`clawbridge.promotion.everyday`), and whether the default bar admits it;
- `in context` the same guard's figure on the same questions asked as an agent serves a noted call
  (a profile and a note: `in_context_set`), and whether the bar admits it;
- `echoed` how many of the version's answers to those in-context questions, sampled at temperature
  1, echo the note (`clawbridge.rewards.notes.echoes_note`: what fell apart at the 13x rate);
- `gate` what the run's own gate decided for it then (that run's code and settings);
- `sampled` the base's mean logprob per token of the version's answers to the 12 questions sampled
  at temperature 1 (fixed seeds): what neither guard reads (a version can keep the base's greedy
  answers likely while what it samples turns to salad); the base's own row is the baseline;
- the first of those answers, so a reader sees what a figure stands for.
The base (v0) is the baseline of every run: 0 nats on both by construction.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sqlite3
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import set_threads_from_argv

set_threads_from_argv(2)

CHECKPOINT = re.compile(r"^v(\d+)-(base|step)$")


def checkpoints(run: Path) -> dict[int, Path]:
    """Every version whose checkpoint `run` (a --out folder, or one run in it) kept."""
    found: dict[int, Path] = {}
    for folder in sorted(run.glob("**/state/checkpoints/local/v*")):
        m = CHECKPOINT.match(folder.name)
        if m:
            found[int(m.group(1))] = folder
    return found


def gate_verdicts(run: Path) -> dict[int, str]:
    """What the run's gate decided per version (read-only)."""
    out: dict[int, str] = {}
    for db in run.glob("**/state/clawbridge.db"):
        c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            for version, verdict in c.execute("SELECT version, verdict FROM promotion_decisions "
                                              "WHERE source != 'admin'"):
                out[int(version)] = str(verdict)
        finally:
            c.close()
    return out


class Router:
    """`VersionRouter.sampler_for` for a run's checkpoints: v0 is the engine, others its LoRA copies."""

    def __init__(self, engine: Any, found: dict[int, Path], scale: float) -> None:
        self.engine, self.found, self.scale = engine, found, scale
        self.loaded: tuple[int, Any] | None = None

    async def sampler_for(self, version: int, by: object = None, use: str = "evaluate") -> Any:
        from clawbridge_local.lora_serving import LoraAdapter

        if version == 0:
            return self.engine
        if self.loaded is None or self.loaded[0] != version:
            path = self.found[version] / "model.safetensors"
            adapter = await asyncio.to_thread(LoraAdapter.from_safetensors, path, self.scale, str(path))
            self.loaded = (version, await self.engine.load_version(adapter, version))
        return self.loaded[1]


async def one_run(run: Path, keep: set[int] | None, model: str, settings: Any) -> list[dict[str, Any]]:
    from clawbridge_local.engine import TorchEngine

    from clawbridge.chat.render import Renderer
    from clawbridge.promotion.capability import capability_probe
    from clawbridge.promotion.everyday import AGENT_NOTE, EVERYDAY_MAX_TOKENS, everyday_set, in_context_set
    from clawbridge.promotion.likelihood import EVERYDAY, FACTS, IN_CONTEXT, nats_of, reference_set
    from clawbridge.promotion.runner import Evaluator
    from clawbridge.rewards.notes import echoes_note
    from clawbridge.serving.sampler import SamplingParams

    found = checkpoints(run)
    verdicts = gate_verdicts(run)
    engine = TorchEngine.load(model, device="cpu", max_running=8, max_queued=64, progress=False)
    renderer = Renderer.from_pretrained(model)
    router = Router(engine, found, float(settings.lora_alpha) / settings.lora_rank)
    ev = Evaluator(router, renderer)  # type: ignore[arg-type]
    probe, everyday, noted = capability_probe(settings.capability_probe_max_tokens), everyday_set(), in_context_set()
    facts_items = await ev.references(0, probe, settings.capability_probe_max_tokens)
    everyday_items = await ev.references(0, everyday, EVERYDAY_MAX_TOKENS)
    noted_items = await ev.references(0, noted, EVERYDAY_MAX_TOKENS)
    assert facts_items and everyday_items and noted_items, "the base must answer: it is SmolLM2 the runs used"
    facts_refs = reference_set(FACTS, 0, probe, facts_items)
    everyday_refs = reference_set(EVERYDAY, 0, everyday, everyday_items)
    noted_refs = reference_set(IN_CONTEXT, 0, noted, noted_items)
    questions = [renderer.render(list(item.chat)) for item in everyday.items]
    noted_questions = [renderer.render(list(item.chat)) for item in noted.items]
    stops = tuple(renderer.stop_token_ids)
    bar = settings.everyday_guard_nats

    async def sampled_answers(sampler: Any, prompts: list[list[int]]) -> list[list[int]]:
        out = []
        for i, prompt in enumerate(prompts):  # temperature 1, as a person's agent samples; fixed seeds
            params = SamplingParams(max_tokens=EVERYDAY_MAX_TOKENS, temperature=1.0, seed=7 + i, stop_token_ids=stops)
            out.append([t.token_id async for t in await sampler.sample(prompt, params)])
        return out

    rows = []
    try:
        for version in sorted(v for v in found if keep is None or v in keep):
            facts = nats_of((await ev.evaluate(version, facts_refs)).score)
            daily = nats_of((await ev.evaluate(version, everyday_refs)).score)
            in_context = nats_of((await ev.evaluate(version, noted_refs)).score)
            sampler = await router.sampler_for(version)
            answers = await sampled_answers(sampler, questions)
            base_lps = [lp for q, a in zip(questions, answers, strict=True) for lp in await engine.score(q, a)]
            sampled = sum(base_lps) / max(1, len(base_lps))
            echoed = sum(echoes_note(renderer.decode([i for i in a if i not in stops]), AGENT_NOTE)
                         for a in await sampled_answers(sampler, noted_questions))
            said = renderer.decode([i for i in answers[0] if i not in stops])
            row = {"run": str(run), "version": version, "facts_nats": facts, "everyday_nats": daily,
                   "in_context_nats": in_context, "admitted": min(daily, in_context) >= -bar,
                   "gate": verdicts.get(version, "-"), "sampled_base_logprob": sampled, "echoed": echoed,
                   "echo_asked": len(noted_questions),
                   "sample": " ".join(str(said).split())[:90]}
            print(f"{'/'.join(run.parts[-2:]):>12} v{version:<3} facts {facts:+.3f}  everyday {daily:+.3f}  in context "
                  f"{in_context:+.3f} ({'within' if row['admitted'] else 'beyond'} -{bar:g})  sampled {sampled:+.2f}  "
                  f"echoed {echoed}/{len(noted_questions)}  gate then: {row['gate']:<8}  {row['sample']!r}", flush=True)
            rows.append(row)
    finally:
        engine.shutdown()
    return rows


SweepOne = Callable[[Path, "set[int] | None", str, Any], Awaitable[list[dict[str, Any]]]]
"""`one_run(run, versions kept or None for all, model folder, Settings)`: one row per version read."""


def sweep(doc: str, one: SweepOne, versions_help: str = "comma-separated versions (default: every kept checkpoint)"
          ) -> tuple[list[Path], list[dict[str, Any]]]:
    """The command line every sweep over a run's kept versions shares (this one, bench/content_check.py):
    parse it, run `one` on each run folder; (the run folders, every row)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="--out folders of bench/learn_from_talk.py")
    ap.add_argument("--versions", default="", help=versions_help)
    ap.add_argument("--model", default="smollm2", help="smollm2 (what the runs used) or a model folder")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (read before torch loads)")
    args = ap.parse_args()
    from clawbridge.config import Settings
    from clawbridge.models import cached_model

    model = str(cached_model("smollm2-135m-instruct")) if args.model == "smollm2" else args.model
    keep = {int(v) for v in args.versions.split(",") if v.strip()} or None
    settings = Settings()
    table: list[dict[str, Any]] = []
    for run in args.runs:
        table += asyncio.run(one(run, keep, model, settings))
    return list(args.runs), table


def by_run(runs: list[Path], table: list[dict[str, Any]]) -> Iterator[tuple[Path, list[dict[str, Any]]]]:
    """(run folder, its rows) for each run that has rows, in the order given (a sweep's summary)."""
    for run in runs:
        rows = [r for r in table if r["run"] == str(run)]
        if rows:
            yield run, rows


def main() -> None:
    runs, table = sweep(__doc__ or "", one_run)
    print("\nrun | versions | everyday figure: worst (version) | in context: worst (version) | beyond the bar | "
          "facts figure: worst | sampled: worst (version) | echoed in context: most (version)")
    for run, rows in by_run(runs, table):
        worst = min(rows, key=lambda r: r["everyday_nats"])
        noted = min(rows, key=lambda r: r["in_context_nats"])
        low = min(rows, key=lambda r: r["sampled_base_logprob"])
        most = max(rows, key=lambda r: r["echoed"])
        beyond = [f"v{r['version']}" for r in rows if not r["admitted"]]
        print(f"{run} | {len(rows)} | {worst['everyday_nats']:+.3f} (v{worst['version']}) | "
              f"{noted['in_context_nats']:+.3f} (v{noted['version']}) | "
              f"{len(beyond)}: {', '.join(beyond[:8]) or '-'} | {min(r['facts_nats'] for r in rows):+.3f} | "
              f"{low['sampled_base_logprob']:+.2f} (v{low['version']}) | {most['echoed']}/{most['echo_asked']} (v{most['version']})")


if __name__ == "__main__":
    main()
