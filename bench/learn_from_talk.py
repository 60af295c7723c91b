"""Train it by talking: simulated people teach a running `clawbridge up` their preference in words.

    python bench/learn_from_talk.py                                   # SmolLM2, the 4 personas alone, seeds 0-2, defaults
    python bench/learn_from_talk.py --persona brief,name --seeds 0 --method rl --notes off
    python bench/learn_from_talk.py --together                        # the personas at once, each its own user
    python bench/learn_from_talk.py --baseline                        # what the defaults were before: no notes, no gate
    python bench/learn_from_talk.py --pace 2                          # the trainer catches up after every 2 sessions
    python bench/learn_from_talk.py --table runs/s0 runs/s1 runs/s2   # one table of medians over runs made apart
    python bench/learn_from_talk.py --rescore runs/s0                 # their first answers under today's rules

Each (persona, method, seed) is one `clawbridge up --backend local` (LoRA, the settings' defaults
except what the flags name) with the rule-based judge as an endpoint (it reads only what the
person said next; it never sees the persona's rule; its hint is the correction written as an
instruction, as the judge prompt asks a capable judge to: `--judge-hints words` passes the person's
words through, as runs before 2026-11-29 did) and the person talking in OpenClaw-style
sessions through the `openai` SDK (`clawbridge.devtools.talk` says what is measured and how).
Prints one row per run as it ends and a table of medians over seeds per persona x method, and
writes each run's JSON (every session, every served version's capability) under --out.

Columns: `3-in-a-row` sessions talked until three first answers in a row met the preference (-:
never); `held-out` the preference rate on held-out questions before -> after as the person gets it
(notes included) [from the weights alone]; `capability` the fact check (12 facts the gate never
sees) of the base -> the final serving version (the lowest of every served version), greedy and
sampled (8 answers per fact at temperature 1: a greedy answer of a small model flips on near-ties);
`on topic`
the share of held-out answers that share a content word with their question before -> after
[weights alone], and of the first answers that met the preference (`topic.on_topic`: the
preference's check reads the form only, so this says whether meeting it still answered); `steps`,
versions promoted/rejected by the gate; `notes` made/retired; `gap` mean teacher-minus-sampler
logprob on hinted turns (minus the plain-prompt reference on turns served with notes); `wait` the
mean seconds a person waited for a first answer (timed at the client) made from one sample / the
best of a noted call's first candidates / with a second round (`talk.answer_kinds`; each run's line
gives counts and maxima); `wall`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import exit_on_sigterm, set_threads_from_argv

if TYPE_CHECKING:
    from clawbridge.devtools.judge_server import HintStyle

set_threads_from_argv(1)

METHODS = ("combine", "rl", "opd")
HINTS_WORDS = ", the judge's hints in the person's words"


def run_one(model: str, personas: tuple[str, ...], method: str, notes: bool, gate: bool, seed: int, sessions: int,
            out: Path, extra: dict[str, str], pace: int = 0, hints: HintStyle = "instruction") -> dict[str, Any]:
    from clawbridge.devtools.demo import free_port, launch_proxy, stop_proxy, wait_healthy
    from clawbridge.devtools.judge_server import JudgeServer, rule_based
    from clawbridge.devtools.talk import Proxy, TalkConfig, run_talk, save

    out.mkdir(parents=True, exist_ok=True)
    state = out / "state"
    state.mkdir(exist_ok=True)
    env = {"CLAWBRIDGE_JUDGE": "endpoint", "CLAWBRIDGE_JUDGE_MODEL": "rule-based",
           "CLAWBRIDGE_METHOD": method, "CLAWBRIDGE_NOTES": "true" if notes else "false",
           "CLAWBRIDGE_TRAIN_LAUNCHER": "torchrun", "CLAWBRIDGE_JUDGE_POLL_INTERVAL_S": "0.5",
           # every served version stays loadable for the capability check after the run (retention
           # changes nothing the run learns; at the default of 3, `default@1` was pruned by the end)
           "CLAWBRIDGE_KEEP_CHECKPOINTS": "1000"}
    if not gate:
        env["CLAWBRIDGE_PROMOTION_MODE"] = "off"
    env.update(extra)
    with JudgeServer(rule_based(hints), model="rule-based") as judge:
        env["CLAWBRIDGE_JUDGE_BASE_URL"] = judge.base_url
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = launch_proxy(Path(model), state, port, env, served_name="talk")
        try:
            wait_healthy(base, proc, timeout_s=900)
            proxy = Proxy(base, (state / "admin_key").read_text().strip(), (state / "client_key").read_text().strip())
            cfg = TalkConfig(personas=personas, sessions=sessions, seed=seed, pace_every=pace)
            result = run_talk(proxy, state, cfg, say=lambda line: print(f"  [{'+'.join(personas)} {method} "
                                                                         f"s{seed}] {line}", flush=True))
        finally:
            stop_proxy(proc)
    save(result, out / "result.json")
    return result.as_json()


def row(r: dict[str, Any], persona: str) -> dict[str, Any]:
    p = r["personas"][persona]
    return {"stable": p["stable_after"], "before": p["before_rate"], "served": p["after_served"],
            "weights": p["after_weights"], "cap0": r["capability_before"],
            "cap": r["capability_by_version"].get(str(r["final_version"]), r["capability_by_version"].get(
                r["final_version"], r["capability_before"])), "capmin": r["capability_min"], "steps": r["steps"],
            "sampled": r.get("sampled_capability", {}), **sampled_row(r),
            "promoted": r["promoted"], "rejected": r["rejected"],
            "notes": sum(1 for n in r["notes"] if (n.get("user") or persona) in (persona, None)),
            "retired": sum(1 for n in r["notes"] if n.get("status") == "retired"),
            "gap": r["teacher_gap"], "wall": r["seconds"], "paced": p.get("paced_s", 0.0),
            "noted": r.get("noted_answers", 0), "echoed": r.get("echoed_answers", 0),
            "wait": r.get("first_answer_wait", {}), **on_topic_row(p)}


def on_topic_row(p: dict[str, Any]) -> dict[str, float | None]:
    """A persona's on-topic shares (`topic.on_topic`) from its result JSON: held-out answers
    before, served after and from the weights alone after (None for a run that kept none), and of
    the first answers that met the preference (None when none met), read back as `talk` keeps them."""
    from clawbridge.devtools.talk import HeldOutAnswer, on_topic_share

    def share(items: list[dict[str, Any]]) -> float | None:
        return on_topic_share([HeldOutAnswer(i["question"], i["answer"], bool(i["met"])) for i in items])

    held = p.get("held_out") or {}
    return {"topic0": share(held.get("before", [])), "topic": share(held.get("served", [])),
            "topicw": share(held.get("weights", [])), "topicmet": share([s for s in p["sessions"] if s["met"]])}


def waits(w: dict[str, dict[str, float]]) -> str:
    """One run's first-answer waits by kind, as a person reads them."""
    from clawbridge.devtools.talk import ANSWER_KINDS

    kinds = [k for k in ANSWER_KINDS if k in w] + sorted(set(w) - set(ANSWER_KINDS))
    return ", ".join(f"{k} {w[k]['n']:g} x {w[k]['mean_s']:.1f} s (max {w[k]['max_s']:.1f})" for k in kinds) or "-"


def sampled_row(r: dict[str, Any]) -> dict[str, float | None]:
    """The sampled capability of the base, the final version and the lowest measured (keys may be
    ints, or strings once read back from JSON)."""
    by = {int(v): c for v, c in (r.get("sampled_capability") or {}).items()}
    return {"scap0": by.get(0), "scap": by.get(int(r["final_version"])), "scapmin": min(by.values(), default=None)}


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def median(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def print_table(rows: dict[tuple[str, str], list[dict[str, Any]]]) -> None:
    print("\n| persona | method | seeds | 3-in-a-row (median; each) | held-out before -> after [weights] | "
          "capability base -> final (min served) | sampled capability base -> final (min) | steps | promoted/rejected | "
          "on topic: held-out before -> after [weights]; met first answers | "
          "notes | gap | wait one/best/second | wall |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (persona, method), rs in sorted(rows.items()):
        stable = [r["stable"] for r in rs]
        each = ", ".join("-" if s is None else str(s) for s in stable)
        never = sum(s is None for s in stable)
        med = median([s if s is not None else 10**6 for s in stable])
        med_s = "-" if med is None or med >= 10**6 else f"{med:g}"
        print(f"| {persona} | {method} | {len(rs)} | {med_s} ({each}{'; never: ' + str(never) if never else ''}) | "
              f"{fmt(median([r['before'] for r in rs]))} -> {fmt(median([r['served'] for r in rs]))} "
              f"[{fmt(median([r['weights'] for r in rs]))}] | "
              f"{fmt(median([r['cap0'] for r in rs]))} -> {fmt(median([r['cap'] for r in rs]))} "
              f"({fmt(min(r['capmin'] for r in rs))}) | "
              f"{fmt(median([r['scap0'] for r in rs]))} -> {fmt(median([r['scap'] for r in rs]))} "
              f"({fmt(min((r['scapmin'] for r in rs if r['scapmin'] is not None), default=None))}) | "
              f"{fmt(median([r['steps'] for r in rs]), 'g')} | "
              f"{fmt(median([r['promoted'] for r in rs]), 'g')}/{fmt(median([r['rejected'] for r in rs]), 'g')} | "
              f"{fmt(median([r['topic0'] for r in rs]))} -> {fmt(median([r['topic'] for r in rs]))} "
              f"[{fmt(median([r['topicw'] for r in rs]))}]; {fmt(median([r['topicmet'] for r in rs]))} | "
              f"{fmt(median([r['notes'] for r in rs]), 'g')}/{fmt(median([r['retired'] for r in rs]), 'g')} | "
              f"{fmt(median([r['gap'] for r in rs]), '.3f')} | {wait_medians(rs)} | "
              f"{fmt(median([r['wall'] for r in rs]), '.0f')} s |")


def wait_medians(rs: list[dict[str, Any]]) -> str:
    """Median over runs of the mean first-answer wait per kind (one sample / best of n / second round)."""
    from clawbridge.devtools.talk import ANSWER_KINDS

    return "/".join(fmt(median([r["wait"].get(k, {}).get("mean_s") for r in rs]), ".1f") for k in ANSWER_KINDS) + " s"


def run_label(name: str) -> tuple[tuple[str, ...], str, int]:
    """(personas, "method, label" as the table writes it, seed) of a run folder's name, as `main`
    makes it: `PERSONA[+PERSONA...]-METHOD-notes|plain-gate|nogate[-paceN][-words]-sSEED` (`--set` is
    not in the name: give `--table` the folders of runs made with the same settings)."""
    head, _, seed = name.rpartition("-s")
    group, method, notes, gate, *rest = head.split("-")
    label = ("notes" if notes == "notes" else "no notes") + (", gate" if gate == "gate" else ", no gate")
    for part in rest:
        label += (f", paced every {part.removeprefix('pace')}" if part.startswith("pace") else
                  HINTS_WORDS if part == "words" else f", {part}")
    return tuple(group.split("+")), f"{method}, {label}", int(seed)


def rows_of(runs: list[Path]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The table's rows from runs already made (each `result.json` under the folders given), so
    seeds run apart, side by side, give one table of medians; each run counted once, runs of
    different lengths in rows of their own."""
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in result_files(runs):
        group, label, _ = run_label(path.parent.name)
        r = json.loads(path.read_text())
        label += f", {r['config']['sessions']} sessions"
        for p in group:
            rows.setdefault((p + (" (together)" if len(group) > 1 else ""), label), []).append(row(r, p))
    return rows


def result_files(runs: list[Path]) -> list[Path]:
    """Every run's `result.json` under the folders (or files) given, each once."""
    return sorted({r.resolve() for d in runs for r in ([d] if d.is_file() else d.glob("**/result.json"))})


def print_rescore(runs: list[Path]) -> None:
    """Per run and person: the first answers met, in order, as the person said then and by the
    persona's rule today (`personas.PERSONAS`), and the sessions until three in a row by each: a
    rule made stricter (docs/training.md) re-reads the answers a run kept, without running it again
    (what the model would have learned under it still needs a run). Then how many of the answers
    met by today's rule talk about their question (`topic.on_topic`)."""
    from clawbridge.chat.topic import on_topic
    from clawbridge.devtools.personas import PERSONAS
    from clawbridge.devtools.talk import stable_after

    for path in result_files(runs):
        for key, p in json.loads(path.read_text())["personas"].items():
            sessions = sorted(p["sessions"], key=lambda s: s["index"])
            then = [bool(s["met"]) for s in sessions]
            now = [PERSONAS[key].meets(s["answer"]) for s in sessions]
            topical = sum(m and on_topic(s["question"], s["answer"]) for m, s in zip(now, sessions, strict=True))
            seq = lambda met: "".join("M" if m else "." for m in met)  # noqa: E731
            print(f"{path.parent} {key}: then {seq(then)} ({sum(then)} of {len(then)}, three in a row "
                  f"{fmt(stable_after(then), 'g')}); today's rule {seq(now)} ({sum(now)} of {len(now)}, three in a "
                  f"row {fmt(stable_after(now), 'g')}); on topic {topical} of those {sum(now)}")


def print_echoes(runs: list[Path]) -> None:
    """Per run folder (`--out` of an earlier run, or one run's folder): the answers served with
    notes that echoed the note, in the first and the second half of them (`talk.note_echoes`), and
    how likely the base finds the answers the judge corrected, by quarter of the run
    (`talk.base_logprob_by_quarter`: it falls as the answers fall apart)."""
    from clawbridge.devtools.talk import base_logprob_by_quarter, note_echoes

    for state in sorted({st for d in runs for st in (d.glob("**/state") if d.name != "state" else [d])}):
        echoes = note_echoes(state)
        half = len(echoes) // 2
        first, second = echoes[:half], echoes[half:]
        share = lambda part: f"{sum(e for _, e in part)}/{len(part)}"  # noqa: E731
        print(f"{state.parent}: {sum(e for _, e in echoes)} of {len(echoes)} noted answers echoed the note "
              f"(first half {share(first)}, second half {share(second)}); the base's mean logprob per token of "
              f"the corrected answers, by quarter: {' '.join(fmt(x) for x in base_logprob_by_quarter(state))}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (the real model) or a model folder")
    ap.add_argument("--persona", default="brief,name,lead,plain", help="comma-separated (clawbridge.devtools.personas)")
    ap.add_argument("--method", default="combine", help=f"comma-separated: {', '.join(METHODS)}")
    ap.add_argument("--notes", choices=("on", "off"), default="on", help="notes from talk (the default: on)")
    ap.add_argument("--gate", choices=("on", "off"), default="on", help="the promotion gate (default: on, the probe)")
    ap.add_argument("--baseline", action="store_true", help="the defaults before notes and the probe: notes off, gate off")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--together", action="store_true", help="the personas talk at once in one server, each a user")
    ap.add_argument("--pace", type=int, default=0, metavar="N",
                    help="after every N sessions a person waits until the trainer and the gate have caught up "
                         "(as when their next conversation comes minutes later); 0: back to back (default)")
    ap.add_argument("--judge-hints", choices=("instruction", "words"), default="instruction",
                    help="the rule-based judge's hint: the correction as an instruction to the assistant, as the "
                    "judge prompt asks a capable judge to write it (default), or the person's own words (runs "
                    "before 2026-11-29)")
    ap.add_argument("--set", action="append", default=[], metavar="CLAWBRIDGE_X=V", help="extra settings for up")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--table", type=Path, nargs="+", metavar="RUN_DIR",
                    help="only print the table of medians over runs already made (every result.json under "
                         "the folders given: seeds run apart, side by side)")
    ap.add_argument("--rescore", type=Path, nargs="+", metavar="RUN_DIR",
                    help="only print, for runs already made, each person's first answers met as they said then "
                         "and by today's persona rules (after a rule changed)")
    ap.add_argument("--echoes", type=Path, nargs="+", metavar="RUN_DIR",
                    help="only print, for runs already made, how many noted answers echoed the note and how "
                         "likely the base finds the corrected answers, by quarter of the run")
    args = ap.parse_args()
    exit_on_sigterm()
    if args.echoes:
        print_echoes(args.echoes)
        return 0
    if args.rescore:
        print_rescore(args.rescore)
        return 0
    if args.table:
        made = rows_of(args.table)
        if not made:
            print(f"no result.json under {' '.join(map(str, args.table))}", file=sys.stderr)
            return 1
        print_table(made)
        return 0
    from clawbridge.models import cached_model

    model = str(cached_model("smollm2-135m-instruct")) if args.model == "smollm2" else args.model
    notes, gate = args.notes == "on", args.gate == "on"
    if args.baseline:
        notes, gate = False, False
    extra = dict(kv.split("=", 1) for kv in args.set)
    out = args.out or Path(tempfile.mkdtemp(prefix="clawbridge-talk-"))
    personas = [p.strip() for p in args.persona.split(",") if p.strip()]
    groups = [tuple(personas)] if args.together else [(p,) for p in personas]
    label = ("notes" if notes else "no notes") + (", gate" if gate else ", no gate") + (
        f", paced every {args.pace}" if args.pace else "") + ("" if args.judge_hints == "instruction" else HINTS_WORDS)
    print(f"learn from talk: {args.model}, {args.sessions} sessions per person, {label}, load {os.getloadavg()[0]:.1f}; "
          f"runs under {out}", flush=True)
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for method in args.method.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            for group in groups:
                name = f"{'+'.join(group)}-{method}-{'notes' if notes else 'plain'}-{'gate' if gate else 'nogate'}"
                name += (f"-pace{args.pace}" if args.pace else "") + (
                    f"-{args.judge_hints}" if args.judge_hints != "instruction" else "") + f"-s{seed}"
                t0 = time.monotonic()
                r = run_one(model, group, method, notes, gate, seed, args.sessions, out / name, extra, args.pace,
                           args.judge_hints)
                for p in group:
                    rw = row(r, p)
                    rows.setdefault((p + (" (together)" if args.together else ""), f"{method}, {label}"), []).append(rw)
                    print(f"{name} {p}: 3-in-a-row {rw['stable']}, held-out {rw['before']:.2f} -> {rw['served']:.2f} "
                          f"[{rw['weights']:.2f}], capability {rw['cap0']:.2f} -> {rw['cap']:.2f} (min {rw['capmin']:.2f}), "
                          f"sampled {', '.join(f'v{v} {c:.2f}' for v, c in rw['sampled'].items())}, "
                          f"{rw['steps']} steps, {rw['promoted']}/{rw['rejected']} promoted/rejected, "
                          f"on topic: held-out {fmt(rw['topic0'])} -> {fmt(rw['topic'])} [{fmt(rw['topicw'])}], "
                          f"met first answers {fmt(rw['topicmet'])}, "
                          f"gap {fmt(rw['gap'], '.3f')}, {rw['echoed']} of {rw['noted']} noted answers echoed "
                          f"the note, first answers waited: {waits(rw['wait'])}, "
                          f"{time.monotonic() - t0:.0f} s (waited {rw['paced']:.0f} s for the "
                          f"trainer), load {os.getloadavg()[0]:.1f}",
                          flush=True)
    print_table(rows)
    (out / "table.json").write_text(json.dumps({f"{k[0]}|{k[1]}": v for k, v in rows.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
