"""`bench/learn_from_talk.py --table`: seeds run apart (separate processes side by side, as a 2-core
box makes them) give one table of medians, read back from each run's `result.json` as `talk.save`
writes it; runs of different lengths or settings never share a row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from clawbridge.devtools.talk import HELD_OUT_WHEN, HeldOutAnswer, PersonaResult, SessionLog, TalkResult, save

ROOT = Path(__file__).resolve().parent.parent


def _run(folder: Path, persona: str, met: str, served: float, cap_min: float, sessions: int,
         topical: tuple[int, int, int] | None = None) -> None:
    """One run's result.json: `met` the first answers in order (M met, . missed; every met one is
    on topic, every missed one not); `topical` how many of 4 held-out answers talk about their
    question before, served after and from the weights alone after (None: a run that kept none)."""
    p = PersonaResult(persona, "w", [SessionLog(persona, i, "Why is the sky blue?", "The sky scatters blue light."
                                                if m == "M" else "Bits:", m == "M", i) for i, m in enumerate(met)],
                      before_rate=0.0, after_served=served, after_weights=served / 2)
    if topical is not None:
        for when, n in zip(HELD_OUT_WHEN, topical, strict=True):
            p.held_out[when] = [HeldOutAnswer("How do I bake bread at home?", "Bake the bread hot." if i < n else
                                              "Tip: High Fries", False) for i in range(4)]
    r = TalkResult({"personas": [persona], "sessions": sessions, "seed": 0}, {persona: p},
                   capability_before=0.75, capability_by_version={0: 0.75, 3: cap_min, 5: 1.0}, final_version=5,
                   steps=5, promoted=4, rejected=1, seconds=100.0)
    folder.mkdir(parents=True)
    save(r, folder / "result.json")


def _table(*folders: Path) -> list[str]:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "learn_from_talk.py"), "--table", *map(str, folders)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, check=True).stdout
    return [line for line in out.splitlines() if line.startswith("| lead") or line.startswith("| name")]


def test_runs_made_apart_give_one_row_of_medians_per_persona_setting_and_length(tmp_path: Path) -> None:
    _run(tmp_path / "a" / "lead-combine-notes-gate-pace1-s0", "lead", ".MMM" + "M" * 28, 0.75, 0.75, 32)
    _run(tmp_path / "b" / "lead-combine-notes-gate-pace1-s1", "lead", "..M.MMM" + "M" * 25, 0.88, 0.67, 32, (4, 2, 3))
    _run(tmp_path / "b" / "lead-combine-notes-gate-pace1-s2", "lead", "M.M.M.M.M.M.M.M.M.M.M.M.M.M.M.M.", 0.94, 0.83, 32,
         (3, 1, 1))
    _run(tmp_path / "b" / "lead-combine-notes-gate-pace1-s3", "lead", "MMM" + "." * 13, 0.5, 0.75, 16)
    _run(tmp_path / "c" / "lead-rl-plain-nogate-words-s0", "lead", "....MMM", 0.25, 0.5, 32)
    rows = _table(tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "a")  # a folder twice counts once
    assert rows == [
        "| lead | combine, notes, gate, paced every 1, 16 sessions | 1 | 3 (3) | 0.00 -> 0.50 [0.25] | "
        "0.75 -> 1.00 (0.75) | - -> - (-) | 5 | 4/1 | - -> - [-]; 1.00 | 0/0 | - | -/-/- s | 100 s |",
        # on topic: medians over the two runs that kept held-out answers (1.00 and 0.75 before, ...)
        "| lead | combine, notes, gate, paced every 1, 32 sessions | 3 | 7 (4, 7, -; never: 1) | 0.00 -> 0.88 [0.44] | "
        "0.75 -> 1.00 (0.67) | - -> - (-) | 5 | 4/1 | 0.88 -> 0.38 [0.50]; 1.00 | 0/0 | - | -/-/- s | 100 s |",
        "| lead | rl, no notes, no gate, the judge's hints in the person's words, 32 sessions | 1 | 7 (7) | 0.00 -> 0.25 [0.12] | "
        "0.75 -> 1.00 (0.50) | - -> - (-) | 5 | 4/1 | - -> - [-]; 1.00 | 0/0 | - | -/-/- s | 100 s |",
    ]


def test_a_folder_with_no_runs_is_an_error_not_an_empty_table(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "learn_from_talk.py"), "--table", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1 and "no result.json under" in proc.stderr


def test_rescore_reads_a_runs_answers_again_under_todays_rule(tmp_path: Path) -> None:
    """A run kept before Ana's rule got stricter: 'The answer is:' was met then and is not now."""
    answers = ["The answer is:\nBake it.", "Bread needs flour, water and yeast.\n\nMix them and wait.",
               "Knead it well before it rises.\n\nThen bake it.", "Tip: High Fries for a crust.\n\nLet it cool."]
    p = PersonaResult("lead", "w", [SessionLog("lead", i, "How do I bake bread at home?", a, True, i)
                                    for i, a in enumerate(answers)])
    run = tmp_path / "lead-combine-notes-gate-pace1-s0"
    run.mkdir()
    save(TalkResult({"personas": ["lead"], "sessions": 4, "seed": 0}, {"lead": p}), run / "result.json")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "learn_from_talk.py"), "--rescore", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, check=True).stdout
    assert out.strip() == (f"{run.resolve()} lead: then MMMM (4 of 4, three in a row 3); "
                           "today's rule .MMM (3 of 4, three in a row 4); on topic 2 of those 3")
