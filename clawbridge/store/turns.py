"""A recorded turn: what the proxy writes (`TurnRecord`) and the one decoder of a `turns` row.

Invariants:
- Token ids and logprobs come back exactly as recorded (`clawbridge.store.codec`), bit for bit.
- Every reader of turns (the session view, the reward worker's transcript, the trainer's datums,
  exports) decodes rows here, from `SELECT * FROM turns`, so a turn reads the same everywhere.
- Decoding never raises on what a client sent: a stored request that is not a JSON object reads
  as `{}` (the store keeps what clients send; a reader must not fail on it).
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from clawbridge.store.codec import decode_floats, decode_ids


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class TurnRecord:
    """Everything recorded about one model call."""

    session_id: str
    turn_type: str
    status: str
    model: str
    prompt_token_ids: Sequence[int]
    completion_token_ids: Sequence[int]
    completion_logprobs: Sequence[float]
    policy_version: int
    finish_reason: str | None
    request_json: str
    """The request body as the client sent it, less unknown top-level fields
    (`clawbridge.proxy.request.stored_request`)."""
    response_json: str | None
    created_at: float
    completed_at: float
    first_token_at: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    turn_id: str = field(default_factory=lambda: new_id("turn"))
    user_id: str | None = None
    """The caller's user: recorded on the session when this turn creates it."""
    caller: str | None = None
    """Whose call it was (also for a session key: its session's user), for the tombstone check."""
    epoch: int | None = None
    """The forget epoch when the call began (`clawbridge.store.tombstones`; None: now)."""
    train_prompt_token_ids: Sequence[int] | None = None
    """The prompt this turn trains on when it differs from what the model saw (a call that carried
    its user's notes: the same call without them, `clawbridge.rewards.notes`); None: the same."""


@dataclass(frozen=True)
class StoredTurn:
    """One recorded turn, decoded."""

    turn_id: str
    session_id: str
    seq: int
    """The turn's position in its session."""
    turn_type: str
    """main | side"""
    status: str
    """ok | error | cancelled"""
    model: str
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    policy_version: int
    """The version that sampled the turn."""
    finish_reason: str | None
    request: dict[str, Any]
    """The request body exactly as the client sent it (OpenAI or Anthropic shape, see `api`)."""
    response: dict[str, Any] | None
    meta: dict[str, Any]
    created_at: float
    first_token_at: float | None
    completed_at: float
    train_prompt_ids: list[int] | None = None
    """The prompt training uses instead of `prompt_ids` (a noted call without its notes), or None."""

    @property
    def trained_prompt_ids(self) -> list[int]:
        """The prompt this turn trains on: `train_prompt_ids` when recorded, else what the model saw."""
        return self.train_prompt_ids if self.train_prompt_ids is not None else self.prompt_ids

    @property
    def api(self) -> str:
        """'openai' or 'anthropic' (from the turn's meta)."""
        return str(self.meta.get("api", "openai"))

    def view(self, reward: float | None) -> dict[str, Any]:
        """The `clawbridge sessions show --json` turn shape, with timing and the latest reward."""
        return {
            "turn_id": self.turn_id,
            "seq": self.seq,
            "turn_type": self.turn_type,
            "status": self.status,
            "model": self.model,
            "prompt_token_ids": self.prompt_ids,
            "completion_token_ids": self.completion_ids,
            "completion_logprobs": self.completion_logprobs,
            "policy_version": self.policy_version,
            "finish_reason": self.finish_reason,
            "reward": reward,
            "request": self.request,
            "response": self.response,
            "meta": self.meta,
            "created_at": self.created_at,
            "first_token_at": self.first_token_at,
            "completed_at": self.completed_at,
            "latency_ms": round((self.completed_at - self.created_at) * 1000.0, 3),
        }


def decode_turn(row: sqlite3.Row) -> StoredTurn:
    """A `SELECT * FROM turns` row as a `StoredTurn`."""
    try:
        request = json.loads(row["request_json"])
    except ValueError:
        request = {}
    return StoredTurn(
        turn_id=str(row["turn_id"]),
        session_id=str(row["session_id"]),
        seq=int(row["seq"]),
        turn_type=str(row["turn_type"]),
        status=str(row["status"]),
        model=str(row["model"]),
        prompt_ids=decode_ids(row["prompt_token_ids"]),
        completion_ids=decode_ids(row["completion_token_ids"]),
        completion_logprobs=decode_floats(row["completion_logprobs"]),
        policy_version=int(row["policy_version"]),
        finish_reason=row["finish_reason"],
        request=request if isinstance(request, dict) else {},
        response=json.loads(row["response_json"]) if row["response_json"] else None,
        meta=json.loads(row["meta_json"]) if row["meta_json"] else {},
        created_at=float(row["created_at"]),
        first_token_at=row["first_token_at"],
        completed_at=float(row["completed_at"]),
        train_prompt_ids=decode_ids(row["train_prompt_token_ids"]) if row["train_prompt_token_ids"] else None,
    )
