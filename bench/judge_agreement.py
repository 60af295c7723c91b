"""Judge agreement on the labeled set: how often a judge's verdict equals the human label.

    python bench/judge_agreement.py --base-url http://127.0.0.1:8000/v1 --model NAME [--api-key KEY]
    python bench/judge_agreement.py --rule-based      # the keyword judge (not a language model)
    python bench/judge_agreement.py --hf-model DIR    # a local model folder, greedy, batched in-process

`--hf-model` runs the model with transformers' batched `generate` (greedy, one vote per case) in
this process: on a busy CPU the proxy's one-request-at-a-time engine needs minutes per judge
prompt, a batch needs seconds per case. Each case's answer is the model's greedy output for
exactly the judge messages the worker would send, parsed the same way.

The labeled set (`clawbridge/rewards/labeled_set.json`, >= 60 cases) covers acceptance,
correction, tool error, tool success, silence and mixed signals; each case is (task, assistant
turn, next state, expected score in {-1, 0, 1}). Every case is judged exactly as the worker judges
a turn (`judge_messages` + `judge_turn`: m votes, majority, ties and failed votes 0). Prints
agreement overall, per category, the confusion matrix, and the disagreements. The key can also
come from $JUDGE_API_KEY (it is never printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from clawbridge.rewards.judge import (
    JudgementFailed,
    JudgeModel,
    OpenAIJudge,
    VoteConfig,
    judge_messages,
    judge_turn,
)

LABELED_SET = Path(__file__).resolve().parent.parent / "clawbridge" / "rewards" / "labeled_set.json"


def case_messages(case: dict[str, Any]) -> list[dict[str, Any]]:
    """The judge prompt of a labeled case (its tool calls in OpenAI shape)."""
    ans = case["answer"]
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
             for i, c in enumerate(ans.get("tool_calls") or [])]
    answer = {"role": "assistant", "content": ans.get("content", ""), **({"tool_calls": calls} if calls else {})}
    return judge_messages(case["task"], answer, case["next_state"])


async def evaluate(judge: JudgeModel, cases: list[dict[str, Any]], cfg: VoteConfig, concurrency: int) -> dict[str, Any]:
    """Judge every case; returns agreement figures and per-case verdicts."""
    slots = asyncio.Semaphore(concurrency)

    async def one(case: dict[str, Any]) -> int | None:
        try:
            return (await judge_turn(judge, case_messages(case), cfg, slots)).score
        except JudgementFailed:
            return None

    got = await asyncio.gather(*(one(c) for c in cases))
    per_cat: dict[str, list[bool]] = defaultdict(list)
    confusion: Counter[tuple[int, str]] = Counter()
    wrong = []
    for case, score in zip(cases, got, strict=True):
        ok = score == case["expected"]
        per_cat[case["category"]].append(ok)
        confusion[(case["expected"], "failed" if score is None else str(score))] += 1
        if not ok:
            wrong.append({"id": case["id"], "expected": case["expected"], "got": score})
    n_ok = sum(ok for v in per_cat.values() for ok in v)
    # The baseline in the same run: a judge that always answers the set's most common label.
    label, count = Counter(c["expected"] for c in cases).most_common(1)[0]
    return {
        "cases": len(cases),
        "agreement": n_ok / len(cases),
        "baseline": {"always": label, "agreement": count / len(cases)},
        "per_category": {k: sum(v) / len(v) for k, v in sorted(per_cat.items())},
        "confusion": {f"{e}->{g}": n for (e, g), n in sorted(confusion.items())},
        "failed": sum(1 for s in got if s is None),
        "disagreements": wrong,
    }


def hf_answers(model_dir: str, prompts: list[list[dict[str, Any]]], max_tokens: int,
               batch: int = 8) -> list[str]:
    """Greedy answers of a local causal LM to chat `prompts`, batched (left padding)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
    out: list[str] = []
    for i in range(0, len(texts), batch):
        enc = tok(texts[i:i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        out += tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"  judged {len(out)}/{len(texts)}", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", help="OpenAI-compatible base URL (…/v1)")
    ap.add_argument("--model", default="", help="model name at that endpoint")
    ap.add_argument("--api-key", default=os.environ.get("JUDGE_API_KEY"), help="key (default $JUDGE_API_KEY)")
    ap.add_argument("--rule-based", action="store_true", help="start and use the built-in rule-based judge")
    ap.add_argument("--hf-model", help="a local model folder run in-process (greedy, batched, one vote)")
    ap.add_argument("--votes", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--labeled-set", type=Path, default=LABELED_SET)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    cases = json.loads(args.labeled_set.read_text())
    cfg = VoteConfig(votes=args.votes, temperature=args.temperature, max_tokens=args.max_tokens)
    server = None
    if args.rule_based:
        from clawbridge.devtools.judge_server import JudgeServer

        server = JudgeServer().start()
        base_url, model, label = server.base_url, "rule-based", "rule-based judge (keyword rules, not a model)"
    elif args.hf_model:
        import time

        from clawbridge.rewards.judge import ScriptedJudge

        t0 = time.monotonic()
        prompts = [case_messages(c) for c in cases]
        answers = dict(zip([json.dumps(p) for p in prompts], hf_answers(args.hf_model, prompts, args.max_tokens),
                           strict=True))
        label = f"{args.hf_model} (transformers, greedy, {time.monotonic() - t0:.0f}s)"
        cfg = VoteConfig(votes=1, temperature=0.0, max_tokens=args.max_tokens)
        args.votes = 1
        report = asyncio.run(evaluate(ScriptedJudge(lambda m: answers[json.dumps(m)], name=label), cases, cfg,
                                      args.concurrency))
        return _print(report, label, args)
    elif args.base_url:
        base_url, model, label = args.base_url, args.model, f"{args.model} at {args.base_url}"
    else:
        ap.error("give --base-url and --model, or --rule-based")

    async def run() -> dict[str, Any]:
        judge = OpenAIJudge(base_url, model, args.api_key)
        try:
            return await evaluate(judge, cases, cfg, args.concurrency)
        finally:
            await judge.aclose()

    try:
        report = asyncio.run(run())
    finally:
        if server is not None:
            server.stop()
    return _print(report, label, args)


def _print(report: dict[str, Any], label: str, args: argparse.Namespace) -> int:
    report["judge"] = label
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"judge: {label}; {args.votes} vote(s) per case")
    print(f"agreement: {report['agreement']:.3f} on {report['cases']} cases ({report['failed']} failed)")
    base = report["baseline"]
    print(f"baseline (always {base['always']:+d}): {base['agreement']:.3f}; "
          f"judge - baseline: {report['agreement'] - base['agreement']:+.3f}")
    for cat, acc in report["per_category"].items():
        print(f"  {cat:<13} {acc:.3f}")
    print("confusion (expected->got): " + ", ".join(f"{k}: {v}" for k, v in report["confusion"].items()))
    for w in report["disagreements"]:
        print(f"  disagree {w['id']}: expected {w['expected']}, got {w['got']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
