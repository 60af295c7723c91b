"""Export formats for `clawbridge sessions export --format ...`, each read back by its consumer.

- `sessions`: one `sessions show --json` document per line (the original export).
- `chat`: JSONL, one line per turn: `{"messages": [... request ..., assistant answer], "tools": [...]}`
  plus metadata (session_id, turn_id, reward, policy_version); the conversational format SFT
  tools read (TRL's SFTTrainer, `datasets.load_dataset("json", ...)`, a chat template).
- `tokens`: JSONL, one line per turn with `TOKEN_SCHEMA`'s columns (prompt ids, completion ids,
  sampler logprobs, per-token advantages, reward, return, advantage, policy version, ...).
- `parquet`: the same columns as one Parquet file (pyarrow, types fixed by `TOKEN_SCHEMA`).
- `hf`: a folder `datasets.load_dataset(folder)` reads: `data/train-00000-of-00001.parquet`
  (the token columns plus `messages_json`, the chat messages as JSON) and a README.md dataset card
  whose YAML names the data files.

Invariant: every list column keeps the recorded values exactly (ids as int32, logprobs float64).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

ExportFormat = Literal["sessions", "chat", "tokens", "parquet", "hf"]
FORMATS: tuple[str, ...] = ("sessions", "chat", "tokens", "parquet", "hf")

TOKEN_SCHEMA = pa.schema([
    ("session_id", pa.string()),
    ("turn_id", pa.string()),
    ("seq", pa.int32()),
    ("turn_type", pa.string()),
    ("status", pa.string()),
    ("session_status", pa.string()),
    ("task_id", pa.string()),
    ("policy_version", pa.int64()),
    ("created_at", pa.float64()),
    ("finish_reason", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("completion_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float64())),
    ("advantages", pa.list_(pa.float64())),
    ("advantage", pa.float64()),
    ("reward", pa.float64()),
    ("return", pa.float64()),
    ("trained_step", pa.int64()),
    ("dropped_reason", pa.string()),
])
"""The token-level columns (tokens JSONL keys, Parquet and HF columns)."""


def chat_row(rec: dict[str, Any]) -> dict[str, Any]:
    """One turn as a conversation: its request messages followed by its answer."""
    answer = {"role": "assistant", "content": rec["answer"].get("content") or ""}
    if rec["answer"].get("tool_calls"):
        answer["tool_calls"] = rec["answer"]["tool_calls"]
    row: dict[str, Any] = {"messages": [*rec["messages"], answer]}
    if rec["tools"]:
        row["tools"] = rec["tools"]
    row.update({"session_id": rec["session_id"], "turn_id": rec["turn_id"], "turn_type": rec["turn_type"],
                "reward": rec["reward"], "policy_version": rec["policy_version"]})
    return row


def token_row(rec: dict[str, Any]) -> dict[str, Any]:
    return {name: rec[name] for name in TOKEN_SCHEMA.names}


def write_jsonl(rows: list[dict[str, Any]], fh: IO[str]) -> None:
    for row in rows:
        fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def token_table(records: list[dict[str, Any]], with_messages: bool = False) -> pa.Table:
    table = pa.Table.from_pylist([token_row(r) for r in records], schema=TOKEN_SCHEMA)
    if with_messages:
        msgs = [json.dumps(chat_row(r)["messages"], ensure_ascii=False) for r in records]
        table = table.append_column("messages_json", pa.array(msgs, type=pa.string()))
    return table


def write_parquet(records: list[dict[str, Any]], path: Path) -> None:
    pq.write_table(token_table(records), str(path))


def write_hf_folder(records: list[dict[str, Any]], folder: Path, model: str) -> Path:
    """The folder layout `datasets.load_dataset(str(folder))` reads, with a dataset card."""
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    path = data / "train-00000-of-00001.parquet"
    pq.write_table(token_table(records, with_messages=True), str(path))
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        "    path: data/train-*.parquet\n---\n\n"
        f"# clawbridge recording of {model}\n\n"
        f"{len(records)} turn(s) exported by `clawbridge sessions export --format hf`. One row per model call:\n"
        "prompt ids as rendered, completion ids and sampler logprobs as sampled, the policy version that\n"
        "sampled them, the reward, return and advantage computed by clawbridge's trainer rules (per-token\n"
        "advantages before batch normalization), and the chat messages as JSON (`messages_json`).\n"
    )
    return path
