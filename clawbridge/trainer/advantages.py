"""Rewards -> advantages -> per-token loss weights: every rule named, documented and pure.

The rules, applied in this order and identically whatever the backend:

1. IMMEDIATE REWARD per trainable turn (an ok main turn), `immediate_rewards`:
   - a turn-level reward on a trainable turn is that turn's reward (the latest one wins);
   - a turn-level reward on a turn that is not trainable (a side turn) is credited to the nearest
     trainable turn BEFORE it, or, when there is none, the first one after it;
   - a session-level reward (`/rl/set_session_reward`, latest wins) is ADDED to the session's
     last trainable turn;
   - a trainable turn with none of these gets 0.
2. TURN DISCOUNT, `discounted_returns` (AReaL's backward rule): over a session's trainable turns,
   last first, `r[i] += gamma * r[i + 1]`. gamma = 1: a turn's return is its reward plus all later
   rewards (a session reward reaches every turn); gamma = 0: per-turn rewards only.
3. BASELINE, `advantage = return - baseline` (`BaselineRule`):
   - `none`: baseline 0.
   - `running_mean`: the mean of every return seen so far under the datum's key (`task:<task_id>`
     when the session has a task id, else `source:<source>`), the current batch included. The
     running sums advance only when a step commits, and live in memory (reset at restart).
   - `group_mean`: datums of the batch whose sessions share a task id form a group (GRPO-style);
     baseline = the group's mean return. Datums without a task id use `running_mean`.
   - `group_mean_std`: `group_mean`, then divided by (the group's population std + 1e-6).
4. NORMALIZATION (`NormalizationRule`). Every backend's loss is the plain SUM over masked tokens
   of all datums of the batch (see `clawbridge_local.losses`, Tinker's `loss = -sum`), with no
   division of its own. The trainer folds the averaging into the per-token advantage instead:
   - `token_mean` (default): every loss token's advantage is divided by T, the batch's total
     completion tokens, so the summed loss is the batch's per-token mean (DAPO / Dr.GRPO).
   - `sequence_mean`: datum d's tokens are divided by (len_d * B), B the datums in the batch,
     so each sequence weighs the same (GRPO's per-sequence mean).
   - `sum`: no scaling.
   A datum's advantage is the same on each of its completion tokens (then scaled as above);
   prompt positions carry 0 and mask 0 (`Datum.from_turn`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from clawbridge.store.training import SessionTrace

BaselineRule = Literal["none", "running_mean", "group_mean", "group_mean_std"]
NormalizationRule = Literal["token_mean", "sequence_mean", "sum"]

STD_EPS = 1e-6
"""Added to the group std before dividing (group_mean_std)."""


def immediate_rewards(trace: SessionTrace) -> dict[str, float]:
    """Rule 1: the immediate reward of each trainable turn of `trace`, by turn id."""
    trainable = [t for t in trace.turns if t.trainable]
    out = {t.turn_id: 0.0 for t in trainable}
    if not trainable:
        return out
    for turn in trace.turns:
        if turn.reward is None:
            continue
        if turn.trainable:
            out[turn.turn_id] += turn.reward
            continue
        before = [t for t in trainable if t.seq < turn.seq]
        target = before[-1] if before else next(t for t in trainable if t.seq > turn.seq)
        out[target.turn_id] += turn.reward
    if trace.session_reward is not None:
        out[trainable[-1].turn_id] += trace.session_reward
    return out


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """Rule 2: AReaL's backward rule, `r[i] += gamma * r[i + 1]`, last turn first."""
    out = [float(r) for r in rewards]
    for i in range(len(out) - 2, -1, -1):
        out[i] += gamma * out[i + 1]
    return out


def session_returns(trace: SessionTrace, gamma: float) -> dict[str, float]:
    """Rules 1 + 2 for one session: each trainable turn's return, by turn id."""
    immediate = immediate_rewards(trace)
    ids = [t.turn_id for t in trace.turns if t.trainable]
    return dict(zip(ids, discounted_returns([immediate[i] for i in ids], gamma), strict=True))


def baseline_key(task_id: str | None, source: str) -> str:
    """The running-mean key: the task when there is one, else how the session was resolved."""
    return f"task:{task_id}" if task_id else f"source:{source}"


@dataclass(frozen=True)
class RunningMeans:
    """Per-key sums and counts of returns seen so far (immutable: `plus` returns a new one)."""

    sums: Mapping[str, float] = field(default_factory=dict)
    counts: Mapping[str, int] = field(default_factory=dict)

    def plus(self, keys: Sequence[str], values: Sequence[float]) -> RunningMeans:
        sums, counts = dict(self.sums), dict(self.counts)
        for k, v in zip(keys, values, strict=True):
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1
        return RunningMeans(sums, counts)

    def mean(self, key: str) -> float:
        n = self.counts.get(key, 0)
        return self.sums.get(key, 0.0) / n if n else 0.0


@dataclass(frozen=True)
class AdvantageItem:
    """One datum's inputs to rule 3."""

    ret: float
    """The turn's return (rules 1 + 2)."""
    group_id: str | None
    """The session's task id (None: no group)."""
    key: str
    """`baseline_key(...)` for running means."""


def apply_baseline(
    items: Sequence[AdvantageItem], rule: BaselineRule, running: RunningMeans
) -> tuple[list[float], RunningMeans]:
    """Rule 3. Returns the advantages and the running means to keep once the step commits."""
    fallback = running.plus([i.key for i in items], [i.ret for i in items])
    if rule == "none":
        return [i.ret for i in items], fallback
    if rule == "running_mean":
        return [i.ret - fallback.mean(i.key) for i in items], fallback
    groups: dict[str, list[float]] = {}
    for i in items:
        if i.group_id is not None:
            groups.setdefault(i.group_id, []).append(i.ret)
    out: list[float] = []
    for i in items:
        if i.group_id is None:
            out.append(i.ret - fallback.mean(i.key))
            continue
        values = groups[i.group_id]
        mean = sum(values) / len(values)
        adv = i.ret - mean
        if rule == "group_mean_std":
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            adv /= std + STD_EPS
        out.append(adv)
    return out, fallback


def token_scales(lengths: Sequence[int], rule: NormalizationRule) -> list[float]:
    """Rule 4: the factor each datum's per-token advantage is multiplied by, given the
    completion lengths of the batch's datums."""
    if rule == "sum":
        return [1.0] * len(lengths)
    if rule == "token_mean":
        total = sum(lengths)
        return [1.0 / total if total else 0.0] * len(lengths)
    n = len(lengths)
    return [1.0 / (length * n) if length else 0.0 for length in lengths]
