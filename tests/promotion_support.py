"""Helpers for the promotion tests: the tiny demo's task (the "e" reward) through `clawbridge up`
and the real `openai` SDK, eval sets built from the base model's own greedy answers, and
read-only looks at the promotion tables."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from clawbridge.devtools.demo import PROMPTS, DemoConfig, Episode, _episode, run_episodes
from clawbridge.store import DB_FILENAME
from tests.kill_support import wait_until
from tests.support import ProxyProcess

MAX_TOKENS = 12


def env(mode: str, eval_set: Path | None = None, **extra: str) -> dict[str, str]:
    """The tiny demo's training settings (LoRA r8, lr 0.03, group baseline) with `mode`."""
    out = {"CLAWBRIDGE_LORA_RANK": "8", "CLAWBRIDGE_LEARNING_RATE": "0.03", "CLAWBRIDGE_BATCH_SIZE": "8",
           "CLAWBRIDGE_DEFAULT_MAX_TOKENS": str(MAX_TOKENS), "CLAWBRIDGE_TRAINER_POLL_INTERVAL_S": "0.2",
           "CLAWBRIDGE_EVAL_MAX_TOKENS": str(MAX_TOKENS), "CLAWBRIDGE_BASELINE": "group_mean",
           "CLAWBRIDGE_MAX_OFF_POLICY_STEPS": "4", "CLAWBRIDGE_PROMOTION_MODE": mode}
    if eval_set is not None:
        out["CLAWBRIDGE_EVAL_SET"] = str(eval_set)
    out.update(extra)
    return out


def start(model: Path, state: Path, settings: dict[str, str]) -> ProxyProcess:
    return ProxyProcess(model, state, env=settings, extra_args=("--served-model-name", "tiny")).start(300)


def served_answers(proxy: ProxyProcess) -> list[str]:
    """What the agent gets for each demo prompt now: greedy, plain model name (the serving version)."""
    client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=proxy.key(), max_retries=2, timeout=120)
    out = []
    for prompt in PROMPTS:
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=MAX_TOKENS, temperature=0)
        out.append(r.choices[0].message.content or "")
    return out


def base_answers_set(answers: list[str], path: Path) -> Path:
    """An eval set that expects the base model's own answers (their printable-ASCII start, anchored)."""
    lines = []
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        head = re.match(r"[ -~]*", answer)
        assert head is not None and head.group(0).strip(), answer
        lines.append({"messages": [{"role": "user", "content": prompt}], "expect": "^" + re.escape(head.group(0))})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def contains_e_set(path: Path) -> Path:
    """An eval set that agrees with the reward: each answer must contain the letter e."""
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}], "expect": "e"}) + "\n"
                            for p in PROMPTS))
    return path


def run_sessions(proxy: ProxyProcess, n: int, seed: int) -> list[Episode]:
    """`n` demo sessions (8 at a time, groups of 8 per prompt), each rewarded by its e-share."""
    cfg = DemoConfig(sessions=n, seed=seed)
    episodes: list[Episode] = []
    run_episodes(lambda i: _episode(proxy.base, proxy.admin_key, i, cfg), n, 8, episodes)
    return sorted(episodes, key=lambda e: e.index)


def status(proxy: ProxyProcess) -> dict[str, Any]:
    r = httpx.get(proxy.base + "/rl/status", headers={"Authorization": f"Bearer {proxy.admin_key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_idle(proxy: ProxyProcess, timeout_s: float = 600.0) -> dict[str, Any]:
    """Until no rewarded turn waits, no step runs and nothing is on trial, twice in a row."""
    seen: list[Any] = []

    def idle() -> bool:
        st = status(proxy)
        t, p = st["trainer"], st["promotion"] or {}
        key = (t["steps"]["ok"], len(p.get("decisions", [])))
        quiet = t["waiting"]["ready_datums"] == 0 and not t["in_step"] and not p.get("holding")
        seen.append(key if quiet else None)
        if len(seen) >= 3 and seen[-1] is not None and seen[-1] == seen[-2] == seen[-3]:
            return True
        time.sleep(0.5)
        return False

    wait_until(idle, "the trainer to go idle", timeout_s, proxy=proxy)
    return status(proxy)


@dataclass(frozen=True)
class DecisionRow:
    version: int
    verdict: str
    source: str
    score: float | None
    incumbent_score: float | None
    incumbent_version: int | None
    reason: str


class PromotionView:
    """Read-only queries on a state dir's promotion tables (safe while a server runs)."""

    def __init__(self, state: Path) -> None:
        self.path = state / DB_FILENAME

    def rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30)
        conn.row_factory = sqlite3.Row
        try:
            return conn.execute(sql, args).fetchall()
        finally:
            conn.close()

    def decisions(self) -> list[DecisionRow]:
        return [DecisionRow(int(r["version"]), r["verdict"], r["source"], r["score"], r["incumbent_score"],
                            r["incumbent_version"], r["reason"])
                for r in self.rows("SELECT * FROM promotion_decisions ORDER BY decision_id")]

    def serving(self) -> int | None:
        rows = self.rows("SELECT serving_version FROM promotion_state")
        return rows[0][0] if rows else None

    def step_versions(self) -> list[int]:
        return [int(r[0]) for r in self.rows("SELECT version FROM policy_versions WHERE status='committed' "
                                             "AND kind='step' ORDER BY version")]

    def versions(self) -> list[tuple[int, str, str, int | None]]:
        """(version, status, kind, source_version), oldest first."""
        return [(int(r[0]), str(r[1]), str(r[2]), r[3])
                for r in self.rows("SELECT version, status, kind, source_version FROM policy_versions ORDER BY version")]

    def rejected_samples(self) -> dict[int, int]:
        return {int(r[0]): int(r[1]) for r in self.rows(
            "SELECT rejected_version, COUNT(*) FROM samples WHERE rejected_version IS NOT NULL GROUP BY 1")}
