"""Recorded turns as export records: filtered, with rewards and advantages computed by the
trainer's own rules (`clawbridge.trainer.advantages`), never by a second copy of them.

Per exported session (a session passes the time and status filters when one of its turns does):
- `reward`: rules 1 + 1b + 1c (`combined_rewards`: explicit rewards from every source but the
  judge, judge verdicts, `explicit_reward_rule`, `judge_promote_best`) for each trainable turn (an
  ok main turn); None for side turns and failed turns, which are never trained.
- `return`: rule 2 (`gamma`) over the session's trainable turns.
- `advantage`: rule 3 (`baseline`) over ALL exported trainable turns as one batch (group means
  per task id; the running mean starts empty), and `advantages` per completion token: rule 5
  (`method`, `w_rl`, `w_opd`, teacher logprobs where the judge left a hint). Rule 4 (the batch's
  token normalization) is NOT applied: it depends on which datums share a step; consumers
  normalize their own batches.
Filters (`ExportFilter`) select turns after these are computed, so a filter never changes another
turn's numbers except through the batch baseline of rule 3.

Invariant: token ids and logprobs are exactly as recorded (`TrainingStore.turn_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from clawbridge.config import Settings
from clawbridge.rewards.next_state import turn_view
from clawbridge.store import SessionRow, Store
from clawbridge.store.observe import ObserveStore
from clawbridge.store.rewards import RewardStore, TurnSignal
from clawbridge.store.training import TrainingStore
from clawbridge.trainer.advantages import (
    AdvantageItem,
    RewardMix,
    RunningMeans,
    advantage_item,
    apply_baseline,
    session_rewards,
    token_advantages,
)

TurnType = Literal["main", "side"]


@dataclass(frozen=True)
class ExportFilter:
    """Which turns to export (every bound inclusive; None: no bound)."""

    since: float | None = None
    """Turns created at or after this Unix time."""
    until: float | None = None
    """Turns created at or before this Unix time."""
    min_reward: float | None = None
    """Turns whose `reward` is at least this (turns without a reward are left out)."""
    max_reward: float | None = None
    status: Literal["active", "ended"] | None = None
    """The session's status."""
    turn_type: TurnType | None = None
    include_failed: bool = False
    """Also export cancelled and errored turns (never trained)."""
    user: str | None = None
    """Only this user's sessions (`clawbridge.store.users`)."""

    def keeps(self, rec: dict[str, Any]) -> bool:
        if self.since is not None and rec["created_at"] < self.since:
            return False
        if self.until is not None and rec["created_at"] > self.until:
            return False
        if self.turn_type is not None and rec["turn_type"] != self.turn_type:
            return False
        if not self.include_failed and rec["status"] != "ok":
            return False
        if self.min_reward is not None or self.max_reward is not None:
            r = rec["reward"]
            if r is None:
                return False
            if self.min_reward is not None and r < self.min_reward:
                return False
            if self.max_reward is not None and r > self.max_reward:
                return False
        return True


def _sessions(store: Store, status: str | None, user: str | None = None) -> list[SessionRow]:
    """Every session (with `status`, of `user` when given), oldest first."""
    out: list[SessionRow] = []
    while page := store.list_sessions(limit=500, offset=len(out), status=status, user=user):
        out.extend(page)
    return sorted(out, key=lambda r: (r.created_at, r.session_id))


def export_records(store: Store, settings: Settings, flt: ExportFilter) -> list[dict[str, Any]]:
    """Every turn that passes `flt`, oldest session first, a session's turns in order."""
    tstore, rstore, observe = TrainingStore(store), RewardStore(store), ObserveStore(store)
    mix = RewardMix.from_settings(settings)
    records: list[dict[str, Any]] = []
    items: list[tuple[dict[str, Any], AdvantageItem, TurnSignal | None]] = []
    for session in _sessions(store, flt.status, flt.user):
        sid = session.session_id
        turns = store.session_turns(sid)
        if not turns:
            continue
        trace = tstore.session_traces([sid])[sid]
        trainable = [t.turn_id for t in trace.turns if t.trainable]
        signals = rstore.turn_signals(trainable)
        got = session_rewards(trace, signals, mix, settings.gamma)
        rewards, returns, positions = got.rewards, got.returns, got.positions
        consumed = observe.sample_states(sid)
        for t in turns:
            tid = t["turn_id"]
            view = turn_view(tid, t["seq"], t["turn_type"], t["request"] if isinstance(t["request"], dict) else {},
                             t["response"], str(t["meta"].get("api", "openai")))
            rec: dict[str, Any] = {
                "session_id": sid, "turn_id": tid, "seq": t["seq"], "turn_type": t["turn_type"],
                "status": t["status"], "session_status": session.status, "task_id": session.task_id,
                "user": session.user_id,
                "policy_version": t["policy_version"], "created_at": t["created_at"],
                "finish_reason": t["finish_reason"],
                "messages": view.messages, "answer": view.answer,
                "tools": view.tools,
                "prompt_ids": t["prompt_token_ids"], "completion_ids": t["completion_token_ids"],
                "logprobs": t["completion_logprobs"],
                "reward": rewards.get(tid), "return": returns.get(tid), "advantage": None, "advantages": None,
                "trained_step": consumed.get(tid, (None, None))[0],
                "dropped_reason": consumed.get(tid, (None, None))[1],
            }
            records.append(rec)
            if tid in returns:
                item = advantage_item(returns[tid], session.task_id, session.source, positions[tid])
                sig = signals.get(tid)
                items.append((rec, item, sig))
    advantages, _ = apply_baseline([i for _, i, _ in items], settings.baseline, RunningMeans())
    for (rec, _, sig), adv in zip(items, advantages, strict=True):
        teacher, reference = (None, None) if sig is None else (sig.teacher_logprobs, sig.reference_logprobs)
        n = len(rec["logprobs"])
        if (teacher is not None and len(teacher) != n) or (reference is not None and len(reference) != n):
            teacher = reference = None  # a broken invariant the trainer refuses; an export shows the RL part only
        rec["advantage"] = adv
        rec["advantages"], _ = token_advantages(adv, teacher, rec["logprobs"], mix, reference)
    return [r for r in records if flt.keeps(r)]

