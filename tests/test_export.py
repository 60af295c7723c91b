"""`clawbridge sessions export --format ...` on a store a real proxy recorded and trained on; each
format is read back by the library that consumes it (datasets, pyarrow, a chat template)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from clawbridge.cli.main import app
from clawbridge.store import Store
from tests.dashboard_support import ANSWER, start_trained_proxy

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never ask a hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install -e '.[dev]')")

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a city up.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def state_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """dash-0..3 (rewards 0, 1, 0.5, 1; two steps trained them) and tools-s: a main turn with tools
    (reward -1) and a side turn, still active."""
    path = tmp_path_factory.mktemp("export-state")
    t = start_trained_proxy(tiny_model_dir, path)
    try:
        c = openai.OpenAI(base_url=t.base + "/v1", api_key=t.client_key, max_retries=0)
        for turn_type in ("main", "side"):
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"{turn_type} call"}],
                                      tools=TOOLS,  # type: ignore[arg-type]
                                      extra_headers={"X-Session-Id": "tools-s", "X-Turn-Type": turn_type})
        r = httpx.post(t.base + "/rl/set_reward", json={"reward": -1.0, "session_id": "tools-s",
                                                         "interaction_id": None},
                       headers={"Authorization": f"Bearer {t.admin}"})
        assert r.status_code == 200, r.text  # lands on the last ok turn: the side turn, credited to main
    finally:
        t.proxy.stop()
    yield path


def export(state_dir: Path, out: Path | str, *args: str, code: int = 0) -> Any:
    result = CliRunner().invoke(app, ["sessions", "export", str(out), "--state-dir", str(state_dir), *args])
    assert result.exit_code == code, result.output
    return result


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tokens_jsonl_and_parquet_keep_the_recorded_tokens_and_the_trainers_rewards(
    state_dir: Path, tmp_path: Path
) -> None:
    export(state_dir, tmp_path / "t.jsonl", "--format", "tokens")
    rows = jsonl(tmp_path / "t.jsonl")
    assert [(r["session_id"], r["turn_type"]) for r in rows] == [
        ("dash-0", "main"), ("dash-1", "main"), ("dash-2", "main"), ("dash-3", "main"),
        ("tools-s", "main"), ("tools-s", "side")]
    store = Store.open(state_dir)
    try:
        for r in rows:
            (turn,) = [t for t in store.session_turns(r["session_id"]) if t["turn_id"] == r["turn_id"]]
            assert r["prompt_ids"] == turn["prompt_token_ids"] and r["completion_ids"] == turn["completion_token_ids"]
            assert r["logprobs"] == turn["completion_logprobs"]  # bit for bit through JSON
    finally:
        store.close()
    # rule 1 credits the side turn's -1 to the main turn; baseline group_mean falls back to the
    # running mean of the exported returns (no task ids): mean(0, 1, .5, 1, -1) = 0.3
    assert [r["reward"] for r in rows] == [0.0, 1.0, 0.5, 1.0, -1.0, None]
    assert [r["advantage"] for r in rows[:5]] == pytest.approx([-0.3, 0.7, 0.2, 0.7, -1.3])
    assert rows[5]["advantage"] is None and rows[5]["advantages"] is None
    assert rows[2]["advantages"] == pytest.approx([0.2] * len(rows[2]["completion_ids"]))
    assert [r["policy_version"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert [r["trained_step"] for r in rows[:4]] == [1, 1, 2, 2] and rows[4]["trained_step"] is None

    export(state_dir, tmp_path / "t.parquet", "--format", "parquet")
    table = pq.read_table(tmp_path / "t.parquet")
    assert str(table.schema.field("prompt_ids").type) == "list<element: int32>"
    assert table.to_pylist() == rows

    loaded = datasets.load_dataset("json", data_files=str(tmp_path / "t.jsonl"), split="train",
                                   cache_dir=str(tmp_path / "hf-cache"))
    assert loaded["completion_ids"] == [r["completion_ids"] for r in rows]


def test_chat_jsonl_loads_with_datasets_and_renders_with_the_chat_template(
    state_dir: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    export(state_dir, tmp_path / "chat.jsonl", "--format", "chat", "--turn-type", "main")
    rows = jsonl(tmp_path / "chat.jsonl")
    assert len(rows) == 5
    first = rows[0]
    assert first["messages"] == [{"role": "user", "content": "Question 0: what is the capital of France?"},
                                 {"role": "assistant", "content": ANSWER}]
    assert "tools" not in first and rows[4]["tools"] == TOOLS and rows[4]["reward"] == -1.0
    loaded = datasets.load_dataset("json", data_files=str(tmp_path / "chat.jsonl"), split="train",
                                   cache_dir=str(tmp_path / "hf-cache"))
    assert [[m["content"] for m in row] for row in loaded["messages"]] == [
        [m["content"] for m in r["messages"]] for r in rows]
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = tok.apply_chat_template(rows[4]["messages"], tools=rows[4]["tools"], tokenize=False)
    assert "main call" in text and "lookup" in text and ANSWER in text


def test_hf_folder_loads_with_load_dataset(state_dir: Path, tmp_path: Path) -> None:
    export(state_dir, tmp_path / "ds", "--format", "hf", "--min-reward", "0.5")
    ds = datasets.load_dataset(str(tmp_path / "ds"), split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert ds["session_id"] == ["dash-1", "dash-2", "dash-3"] and ds["reward"] == [1.0, 0.5, 1.0]
    assert json.loads(ds["messages_json"][0])[-1] == {"role": "assistant", "content": ANSWER}
    assert ds.features["logprobs"].feature.dtype == "float64"


def test_filters(state_dir: Path, tmp_path: Path) -> None:
    def ids(*args: str) -> list[str]:
        out = tmp_path / "f.jsonl"
        export(state_dir, out, "--format", "tokens", *args)
        return [f"{r['session_id']}/{r['turn_type']}" for r in jsonl(out)]

    assert ids("--turn-type", "side") == ["tools-s/side"]
    assert ids("--status", "active") == ["tools-s/main", "tools-s/side"]
    assert ids("--max-reward", "0") == ["dash-0/main", "tools-s/main"]
    assert ids("--since", "2999-01-01") == []
    assert ids("--until", "1000") == []
    assert len(ids("--since", "0")) == 6
    sessions = tmp_path / "s.jsonl"
    export(state_dir, sessions, "--status", "ended")  # the original format stays the default
    assert [d["session_id"] for d in jsonl(sessions)] == ["dash-3", "dash-2", "dash-1", "dash-0"]


def test_bad_export_options_exit_2_with_a_reason(state_dir: Path, tmp_path: Path) -> None:
    assert "--format must be one of" in export(state_dir, tmp_path / "x", "--format", "csv", code=2).output
    assert "neither seconds" in export(state_dir, tmp_path / "x", "--format", "tokens", "--since", "yesterday",
                                       code=2).output
    assert "--turn-type" in export(state_dir, tmp_path / "x", "--format", "tokens", "--turn-type", "tool",
                                   code=2).output
    assert "folder" in export(state_dir, "-", "--format", "hf", code=2).output


def test_sessions_list_has_rewards_and_show_prints_what_the_model_said(state_dir: Path) -> None:
    runner = CliRunner()
    listed = runner.invoke(app, ["sessions", "list", "--state-dir", str(state_dir)])
    assert listed.exit_code == 0, listed.output
    row = next(line for line in listed.output.splitlines() if "dash-2" in line)
    assert "0.5 (1)" in row
    shown = runner.invoke(app, ["sessions", "show", "dash-2", "--state-dir", str(state_dir)])
    assert shown.exit_code == 0 and f"#0 answer: {ANSWER}" in shown.output
