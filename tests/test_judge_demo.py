"""The labeled set, the agreement script against rule-based and scripted judge endpoints, and the
demo's `--reward judge` mode, shortened."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from clawbridge.devtools.judge_server import JudgeServer, rule_based_answer

ROOT = Path(__file__).resolve().parent.parent
LABELED = ROOT / "clawbridge" / "rewards" / "labeled_set.json"


def agreement(base_url: str, *extra: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "judge_agreement.py"), "--base-url", base_url, "--model", "m",
         "--json", *extra],
        capture_output=True, text=True, timeout=120, check=True)
    return dict(json.loads(out.stdout))


def test_labeled_set_covers_every_kind() -> None:
    cases = json.loads(LABELED.read_text())
    assert len(cases) >= 60 and len({c["id"] for c in cases}) == len(cases)
    cats = Counter(c["category"] for c in cases)
    assert set(cats) == {"acceptance", "correction", "tool_error", "tool_success", "silence", "mixed"}
    assert min(cats.values()) >= 10 and {c["expected"] for c in cases} == {-1, 0, 1}


def test_agreement_script_rule_based_and_scripted() -> None:
    cases = json.loads(LABELED.read_text())
    with JudgeServer(rule_based_answer) as rule:
        report = agreement(rule.base_url)
    assert report["cases"] == len(cases) and report["failed"] == 0
    assert report["agreement"] >= 0.8, report  # a bound, not today's misjudgements: a better judge passes
    assert report["agreement"] > report["baseline"]["agreement"], report  # better than always one label
    # The report is consistent: every case it did not agree on is listed, each with what it got.
    assert len(report["disagreements"]) == round((1.0 - report["agreement"]) * len(cases)), report
    assert {w["id"] for w in report["disagreements"]} <= {c["id"] for c in cases}
    with JudgeServer(lambda body: "SCORE: 0") as zero:  # a judge that always says "unclear"
        report = agreement(zero.base_url, "--votes", "1")
    assert report["agreement"] == sum(c["expected"] == 0 for c in cases) / len(cases)
    with JudgeServer(lambda body: "SCORE: 1", api_key="k" * 20) as keyed:  # the key is sent
        assert agreement(keyed.base_url, "--api-key", "k" * 20, "--votes", "1")["failed"] == 0
        assert agreement(keyed.base_url, "--api-key", "wrong", "--votes", "1")["failed"] == len(cases)


def test_demo_with_judge_rewards_rises(tmp_path: Path) -> None:
    """What the judge's verdicts teach is to be accepted: the scripted user thanks a first answer
    whose share of tokens with the letter reaches 0.4. Once every answer of a group is thanked, its
    verdicts are all alike and carry no signal (the no-signal rule skips them), so training stops
    wherever the token share then stands: over six runs of seed 0 (2026-12-07; four alone, two
    beside another demo) the share went 0.38-0.40 -> 0.72-0.92 and the acceptance 0.58-0.65 -> 1.00
    in every run, the last version serving 91-159 of the 240 sessions alone; seeds 1-3 beside each
    other 0.56, 0.81, 0.54 -> 1.00, 0.98, 1.00 (`bench/stability.py`). CI once failed this test's earlier assertion on the
    share (0.398 -> 0.469, +0.15 wanted), as a plateau just above the user's bar would. Before the
    no-signal rule CI failed it twice more: collapsed to one repeated token under unclipped importance
    sampling (0.392 -> 0.000), and drifted under cispo through 9 zero-advantage optimizer steps (0.387
    -> 0.057) (`bench/stability.py`, docs/training.md, "Stale data is trained")."""
    from clawbridge.devtools.demo import LEARNED_ACCEPTANCE, DemoConfig, run_demo

    # Capacity mode: a session starts only while the training backlog is under two batches, so the
    # sessions a version answers do not depend on how fast this machine trains. Without it, at load
    # average 6 on 2 cores the trainer reached v10 where a quiet run reaches v15 in the same 240
    # sessions (0.38 -> 0.50 instead of 0.39 -> 0.97: the same curve, cut short). Paced, at load
    # average 5-7: seed 0 0.396 -> 0.998, seeds 1-3 +0.50, +0.46, +0.29.
    pace = {"CLAWBRIDGE_CAPACITY_MODE": "true", "CLAWBRIDGE_MAX_BACKLOG": "16"}
    result = run_demo(DemoConfig(sessions=240, reward="judge", settings=pace), tmp_path)
    assert len(result.episodes) == 240
    assert "rule-based" in (tmp_path / "judge.txt").read_text()
    assert result.judge_calls >= 3 * 230  # every first turn judged (3 votes), nothing set by hand
    first, last = result.head_tail()
    accepted = result.acceptance()
    assert accepted is not None
    print(f"demo --reward judge: share first 20% {first:.3f} -> last 20% {last:.3f}, accepted "
          f"{accepted[0]:.2f} -> {accepted[1]:.2f} in {result.seconds:.0f}s")
    assert accepted[1] >= LEARNED_ACCEPTANCE and accepted[1] - accepted[0] > 0.2, f"not learned: accepted {accepted}"
    assert last > first, f"the share fell: {first:.3f} -> {last:.3f}"  # a collapse fails both


def test_agreement_script_runs_a_local_model_in_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    cases = json.loads(LABELED.read_text())[:6]
    subset = tmp_path / "subset.json"
    subset.write_text(json.dumps(cases))
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "judge_agreement.py"), "--hf-model", str(tiny_model_dir),
         "--max-tokens", "4", "--labeled-set", str(subset), "--json"],
        capture_output=True, text=True, timeout=300, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    report = json.loads(out.stdout)
    # The random tiny model never writes a SCORE line: every case is an unparsed vote, counted as 0.
    assert report["cases"] == 6 and str(tiny_model_dir) in report["judge"]
    assert report["agreement"] == sum(c["expected"] == 0 for c in cases) / 6
