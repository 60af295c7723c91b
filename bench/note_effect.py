"""Does a note move the model? Each persona's correction as a note, through a running `clawbridge up`.

    python bench/note_effect.py                          # SmolLM2, the 4 personas, both places, seeds 0,1
    python bench/note_effect.py --place system --persona brief --samples 4
    python bench/note_effect.py --place user --persona lead --text 'Use this layout:\nThe short answer.\nThe details.'
    python bench/note_effect.py --place user --notes instruction --best-of 1,4   # one sample against best of 4

Notes from talk (`clawbridge.rewards.notes`) only help at once if the model follows them. For each
place a call can carry a note (`notes_place`: `system`, a line in the system message; `user`,
appended to the last user message as OPD's teacher sees a hint), this starts one `clawbridge up
--backend local` (no training, no judge), makes each persona a user, writes the note by hand through
`/rl/notes` (the text the judge's hint would be: one of the persona's own corrections), and asks
the persona's held-out questions (`clawbridge.devtools.personas.HELD_OUT_QUESTIONS`, sampled at
temperature 1 with fixed seeds, the system prompt an OpenClaw agent carries) through the `openai`
SDK twice: with the note and with `X-Clawbridge-Notes: off`. Same seeds, same server, same run:
the difference is the note's alone.

`--best-of` starts one server per value of `notes_best_of` (`clawbridge.serving.best_of`: a noted
call samples that many answers and serves the one the note explains best), so one sample and best
of n are compared on the same notes, questions and seeds.

Prints one row per (place, best of, persona, note): the preference rate without -> with the note,
over `--samples` x 8 questions x seeds, the seconds per noted answer, and the wall time of the run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import exit_on_sigterm, set_threads_from_argv

set_threads_from_argv(1)

INSTRUCTIONS = {
    "brief": "Answer in under 30 words.",
    "name": "Call the user Sam in every answer.",
    "lead": "Start with a one-line answer, then give the details on the next lines.",
    "plain": "Write plain sentences, with no lists and no bold text.",
}
"""`--notes instruction`: each preference as a capable judge would write its hint (an instruction)."""


def run_place(model: str, place: str, personas: list[str], seeds: list[int], samples: int, notes: str,
              out: Path, texts_given: tuple[str, ...] = (), best_of: int = 1) -> list[tuple[str, str, float, float, float]]:
    """(persona, note, rate without, rate with, seconds per noted answer) for each persona and note,
    on one server."""
    from clawbridge.devtools.demo import free_port, launch_proxy, stop_proxy, wait_healthy
    from clawbridge.devtools.personas import PERSONAS
    from clawbridge.devtools.talk import Proxy, TalkConfig, preference_rate

    state = out / f"{place}-best{best_of}"
    state.mkdir(parents=True, exist_ok=True)
    env = {"CLAWBRIDGE_NOTES_PLACE": place, "CLAWBRIDGE_PROMOTION_MODE": "off", "CLAWBRIDGE_JUDGE": "off",
           "CLAWBRIDGE_NOTES_BEST_OF": str(best_of)}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = launch_proxy(Path(model), state, port, env, served_name="talk")
    rows = []
    try:
        wait_healthy(base, proc, timeout_s=900)
        proxy = Proxy(base, (state / "admin_key").read_text().strip(), (state / "client_key").read_text().strip())
        admin = {"Authorization": f"Bearer {proxy.admin}"}
        for key in personas:
            persona = PERSONAS[key]
            texts = texts_given or {"all": persona.complaints, "first": persona.complaints[:1],
                                    "instruction": (INSTRUCTIONS[key],)}[notes]
            for k, text in enumerate(texts):
                user = f"{key}-{k}"
                api_key = proxy.add_user(user)
                httpx.post(f"{base}/rl/notes", json={"user": user, "text": text}, headers=admin,
                           timeout=60).raise_for_status()
                off = on = noted_s = 0.0
                for seed in seeds:
                    cfg = TalkConfig(personas=(key,), seed=seed, held_out_samples=samples)
                    off += preference_rate(proxy, api_key, persona, cfg, notes=False) / len(seeds)
                    t0 = time.monotonic()
                    on += preference_rate(proxy, api_key, persona, cfg, notes=True) / len(seeds)
                    noted_s += (time.monotonic() - t0) / (len(seeds) * samples * 8)
                print(f"{place:6} best of {best_of} {key:6} {off:.2f} -> {on:.2f} ({noted_s:.1f} s per noted answer)"
                      f"  note {text!r}", flush=True)
                rows.append((key, text, off, on, noted_s))
    finally:
        stop_proxy(proc)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (the real model) or a model folder")
    ap.add_argument("--persona", default="brief,name,lead,plain", help="comma-separated (clawbridge.devtools.personas)")
    ap.add_argument("--place", default="system,user", help="comma-separated: system, user (notes_place)")
    ap.add_argument("--notes", choices=("first", "all", "instruction"), default="first",
                    help="the note: each persona's first correction (what the rule-based judge's hint is), each "
                    "of them in turn, or the preference as an instruction (INSTRUCTIONS)")
    ap.add_argument("--text", action="append", default=[], metavar="NOTE",
                    help="a note of your own (repeatable; '\\n' writes a line break), asked instead of --notes")
    ap.add_argument("--best-of", default="1", help="comma-separated notes_best_of values, one server each "
                    "(1: one sample per noted call)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--samples", type=int, default=2, help="samples per held-out question and seed")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    exit_on_sigterm()
    from clawbridge.models import cached_model

    model = str(cached_model("smollm2-135m-instruct")) if args.model == "smollm2" else args.model
    out = args.out or Path(tempfile.mkdtemp(prefix="clawbridge-note-effect-"))
    personas = [p.strip() for p in args.persona.split(",") if p.strip()]
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"note effect: {args.model}, personas {', '.join(personas)}, seeds {args.seeds}, {args.samples} samples "
          f"x 8 questions, load {os.getloadavg()[0]:.1f}; runs under {out}", flush=True)
    print("place  best of  persona without -> with the note", flush=True)
    table = []
    t0 = time.monotonic()
    given = tuple(t.replace("\\n", "\n") for t in args.text)
    for place in args.place.split(","):
        for n in (int(v) for v in args.best_of.split(",")):
            for key, text, off, on, secs in run_place(model, place.strip(), personas, seeds, args.samples, args.notes,
                                                      out, given, n):
                table.append((place, n, key, text, off, on, secs))
    print("\n| place | best of | persona | note | without | with | s per noted answer |\n|---|---|---|---|---|---|---|")
    for place, n, key, text, off, on, secs in table:
        shown = text.replace("\n", "\\n")  # one table row per note
        print(f"| {place} | {n} | {key} | {shown} | {off:.2f} | {on:.2f} | {secs:.1f} |")
    print(f"\nwall {time.monotonic() - t0:.0f} s, load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
