"""The JSON documents the dashboard page polls (`/dashboard/api/*`), built from the store and the
running server's state.

Invariants:
- Read-only: building a document never writes the store.
- Secrets never leave: configuration goes through `masked_config` (SecretStr fields and any
  option whose name ends in key/secret/token/password are replaced by `***`).
- Token ids and logprobs are left out of session documents (counts only): the page shows text;
  `clawbridge sessions export` is the place for token-level data.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from clawbridge.rewards.next_state import text_of, turn_view
from clawbridge.serving.sampler import engine_status
from clawbridge.store.observe import ObserveStore
from clawbridge.store.rewards import RewardStore
from clawbridge.store.users import UserStore
from clawbridge.store.versions import VersionStore

if TYPE_CHECKING:
    from clawbridge.config import Settings
    from clawbridge.proxy.state import ProxyState

_SECRET_NAME = re.compile(r"(key|secret|token|password)$")
_STEP_FIELDS = ("loss", "kl", "clip_fraction", "reward_mean", "datums", "tokens", "loss_tokens", "seconds",
                "train_seconds", "publish_seconds", "dropped_stale", "dropped_no_reward", "dropped_empty")


def masked_config(settings: Settings) -> dict[str, Any]:
    """Every option as resolved (backends' sections included), with anything secret masked
    (`***` when set, None when not)."""
    from clawbridge.plugins import resolved_config

    out, _ = resolved_config(settings)
    for name, value in out.items():
        if _SECRET_NAME.search(name.lower()) and value not in (None, "", "***"):
            out[name] = "***"
    return out


def waiting_for(state: ProxyState, counts: dict[str, int], samples: dict[str, Any]) -> list[str]:
    """Plain sentences saying what the next training step waits for."""
    trainer = state.trainer
    if trainer is None:
        return ["training is off: the backend only serves, or train = false"]
    out: list[str] = []
    status = trainer.status()
    if status.get("in_step"):
        out.append("a training step is running now")
    batch = trainer.config.batch_size
    ready = len(trainer.tstore.ready_samples())
    out.append(f"{ready} of {batch} samples ready for the next step" if ready < batch
               else f"{ready} samples ready: the next step starts at the next poll")
    if counts["pending_without_reward"]:
        out.append(f"{counts['pending_without_reward']} sample(s) of ended sessions wait for a reward "
                   f"(dropped as no_reward after {trainer.config.reward_wait_s:g} s)")
    if counts["active_sessions"]:
        out.append(f"{counts['active_sessions']} session(s) still active: their turns become samples when they end")
    if trainer.config.wait_for_judge and counts["sessions_not_judged"]:
        out.append(f"the judge has {counts['sessions_not_judged']} ended session(s) left to finish")
    held = (status.get("waiting") or {}).get("held_for_group")
    if held:
        out.append(f"{held} ready sample(s) wait for the rest of their task group (a group baseline compares "
                   f"a task's sessions; held up to {trainer.config.batch_wait_s:g} s)")
    if not trainer.running:
        out.append("the trainer loop is not running")
    return out


def overview(state: ProxyState, started_at: float, config: dict[str, Any]) -> dict[str, Any]:
    """Everything on the main page: health, rewards, training, versions, and `config` (the
    resolved configuration, `masked_config`, which the caller reads once)."""
    obs = ObserveStore(state.store)
    points = obs.reward_points()
    steps = obs.steps()
    samples = obs.sample_counts()
    counts = obs.waiting_counts()
    trainer = state.trainer.status() if state.trainer is not None else None
    judge = state.judge.status() if state.judge is not None else None
    versions = obs.versions()
    n_sessions = obs.session_count()
    starts = dict(obs.version_starts())
    for v in versions:  # published but not serving any session yet: its boundary is after the last one
        starts.setdefault(v["policy_version"], n_sessions)
    return {
        "now": state.store.clock.now(),
        "health": {
            "status": "ok",
            "model": state.model_info.name,
            "backend": state.backend.name,
            "serving_policy_version": state.router.serving_version,
            "uptime_s": round(time.time() - started_at, 1),
            "training": "off" if trainer is None else ("running" if trainer["running"] else "stopped"),
            "judge": "off" if judge is None else ("running" if judge["running"] else "stopped"),
            "store": str(state.store.path),
            "sessions": n_sessions,
            "engine": engine_status(state.backend.sampler()),
        },
        "rewards": {
            "points": [{"session": p.session_index, "session_id": p.session_id, "version": p.policy_version,
                        "source": p.source, "value": p.value, "at": p.created_at} for p in points],
            "version_starts": [{"policy_version": v, "session": i} for v, i in sorted(starts.items())],
            "by_version": obs.reward_by_version(),
        },
        "training": {
            "steps": [{**{k: v for k, v in s.items() if k != "metrics"},
                       "metrics": {k: s["metrics"].get(k) for k in _STEP_FIELDS if k in s["metrics"]}}
                      for s in steps],
            "samples": samples,
            "dropped_recent": [d.__dict__ for d in obs.dropped_samples(20)],
            "waiting_for": waiting_for(state, counts, samples),
            "config": None if trainer is None else trainer.get("config"),
        },
        "users": UserStore(state.store).stats(),
        "lanes": state.lanes.status() if state.lanes is not None else None,
        "versions": versions,
        "checkpoints": checkpoints(state),
        "promotion": promotion(state),
        "notes": notes(state),
        "config": config,
    }


def notes(state: ProxyState) -> list[dict[str, Any]] | None:
    """Every note from talk with its columns in words (`clawbridge.rewards.notes_describe`, as
    `clawbridge notes` prints them); None when notes are off (notes = false)."""
    from clawbridge.rewards.notes_describe import described

    if state.notes is None:
        return None
    return [{"note_id": n["note_id"], "status": n["status"], "words": described(n)} for n in state.notes.status()]


def promotion(state: ProxyState) -> dict[str, Any] | None:
    """The `/rl/status` promotion object, the same in words (`clawbridge status`'s lines and its
    "still good?" line), and each evaluated version's figures (newest evaluations first), as
    `clawbridge eval` prints them."""
    from clawbridge.promotion.describe import promotion_lines, still_good_line
    from clawbridge.promotion.report import promotion_status
    from clawbridge.store.promotion import PromotionStore

    if state.promotion is None:
        return None
    status = promotion_status(state.promotion)
    evals = [{"version": v, "digest": d, **{k: f.get(k) for k in (
        "source", "items", "passed", "pass_rate", "ci_low", "ci_high", "score", "mean_judge_score",
        "mean_answer_tokens", "seconds")}} for v, d, f in PromotionStore(state.store).evals(40)]
    return {**status, "lines": promotion_lines(status), "still_good": still_good_line(status), "evals": evals}


def checkpoints(state: ProxyState, limit: int = 20) -> dict[str, Any]:
    """The committed policy versions, newest first, each with the checkpoint it is restored from;
    any kept one can be served from the page (`serve`: promote / rollback, as `clawbridge promote N`)."""
    rows = VersionStore(state.store).listing(limit)
    return {
        "rows": [{"version": r.version, "kind": r.kind, "step": r.step, "source_version": r.source_version,
                  "checkpoint": r.checkpoint, "committed_at": r.committed_at, "pruned": r.pruned_at is not None}
                 for r in rows],
        "rollback": state.promotion is not None,
        "note": "'serve' makes a kept version the one plain requests get, now (recorded as an admin decision; "
                "training goes on from it), like `clawbridge promote N` / `clawbridge rollback N`. Pruned "
                "checkpoints (older than the newest keep_checkpoints) were deleted and cannot be served again.",
    }


def session_list(state: ProxyState, limit: int, offset: int, status: str | None) -> dict[str, Any]:
    obs = ObserveStore(state.store)
    return {"sessions": [s.__dict__ for s in obs.session_summaries(limit, offset, status)],
            "total": obs.session_count(), "now": state.store.clock.now()}


def _message(m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": str(m.get("role", "")), "content": text_of(m.get("content"))}
    if m.get("tool_calls"):
        out["tool_calls"] = [_tool_call(c) for c in m["tool_calls"] if isinstance(c, dict)]
    if m.get("tool_call_id"):
        out["tool_call_id"] = str(m["tool_call_id"])
    return out


def _tool_call(c: dict[str, Any]) -> dict[str, Any]:
    fn = c.get("function") or {}
    return {"id": c.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments")}


def session_detail(state: ProxyState, session_id: str) -> dict[str, Any] | None:
    """One session: each turn's messages, answer, tool calls, next state, judge votes and hint,
    rewards, policy version and latency."""
    view = state.store.session_view(session_id)
    if view is None:
        return None
    rstore = RewardStore(state.store)
    next_states = rstore.next_states(session_id)
    hints = rstore.hints(session_id)
    turn_rewards: dict[str, list[dict[str, Any]]] = {}
    for r in view["rewards"]:
        if r["turn_id"] is not None:
            turn_rewards.setdefault(r["turn_id"], []).append({"value": r["value"], "source": r["source"]})
    turns = []
    for t in view["turns"]:
        tv = turn_view(t["turn_id"], t["seq"], t["turn_type"], t["request"] if isinstance(t["request"], dict) else {},
                       t["response"], str(t["meta"].get("api", "openai")))
        ns = next_states.get(t["turn_id"])
        votes = rstore.votes(t["turn_id"])
        turns.append({
            "turn_id": t["turn_id"], "seq": t["seq"], "turn_type": t["turn_type"], "status": t["status"],
            "policy_version": t["policy_version"], "finish_reason": t["finish_reason"],
            "latency_ms": t["latency_ms"],
            "ttft_ms": None if t["first_token_at"] is None else round((t["first_token_at"] - t["created_at"]) * 1000, 1),
            "prompt_tokens": len(t["prompt_token_ids"]), "completion_tokens": len(t["completion_token_ids"]),
            "messages": [_message(m) for m in tv.messages],
            "answer": {**_message(tv.answer), "reasoning": tv.answer.get("reasoning_content")},
            "next_state": None if ns is None else {"kind": ns[0], "messages": [_message(m) for m in ns[1]]},
            "judge": {"votes": [{"attempt": a, "idx": v.idx, "score": v.score, "hint": v.hint, "error": v.error}
                                for a, v in votes],
                      "hint": hints.get(t["turn_id"])},
            "rewards": turn_rewards.get(t["turn_id"], []),
            "reward": t["reward"],
        })
    return {
        "session_id": view["session_id"], "status": view["status"], "source": view["source"],
        "task_id": view["task_id"], "end_reason": view["end_reason"], "created_at": view["created_at"],
        "ended_at": view["ended_at"], "turns": turns,
        "session_rewards": [{"value": r["value"], "source": r["source"], "created_at": r["created_at"]}
                            for r in view["rewards"] if r["turn_id"] is None],
        "now": state.store.clock.now(),
    }
