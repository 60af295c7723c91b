"""Ready samples -> a batch of `Datum`s with advantages (pure given the store reads).

Invariants:
- One datum per trainable turn (an ok main turn of an ended, rewarded session); side turns never
  become datums (they are not samples), though a reward on one is credited per `advantages`.
- A datum is `Datum.from_turn(prompt ids, completion ids, sampler logprobs, advantages)` from the
  turn exactly as recorded: the loss is on completion positions only (mask 1), prompt positions
  have mask 0, advantage 0 and logprob 0. Every completion token of a datum carries the same
  advantage (the turn's), times the batch's normalization factor (`advantages.token_scales`).
- Batches never split a session, and with a group baseline never split a group that is ready:
  a batch is the first `batch_size` ready samples, extended by the other ready samples of the
  same sessions (and groups), so it can hold more than `batch_size` datums.
- Staleness = (the policy version serving now) - (the version that sampled the turn), i.e. how
  many publishes behind the datum is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from clawbridge.backend import Datum
from clawbridge.store.training import PendingSample, TrainingStore
from clawbridge.trainer.advantages import (
    AdvantageItem,
    BaselineRule,
    NormalizationRule,
    RunningMeans,
    apply_baseline,
    baseline_key,
    immediate_rewards,
    session_returns,
    token_scales,
)


@dataclass(frozen=True)
class Screened:
    """Ready samples sorted into usable ones and ones to drop (with the reason)."""

    usable: list[PendingSample]
    stale: list[PendingSample] = field(default_factory=list)
    empty: list[PendingSample] = field(default_factory=list)
    """Turns with no completion token (nothing to train on)."""


def screen(
    ready: Sequence[PendingSample], current_version: int, max_off_policy_steps: int, drop_stale: bool
) -> Screened:
    """Separate stale (when `drop_stale`) and empty samples from the usable ones."""
    usable: list[PendingSample] = []
    stale: list[PendingSample] = []
    empty: list[PendingSample] = []
    for s in ready:
        if s.completion_tokens == 0:
            empty.append(s)
        elif drop_stale and current_version - s.policy_version > max_off_policy_steps:
            stale.append(s)
        else:
            usable.append(s)
    return Screened(usable, stale, empty)


def select_batch(ready: Sequence[PendingSample], batch_size: int, whole_groups: bool) -> list[PendingSample]:
    """The first `batch_size` samples plus the rest of their sessions (and task groups when
    `whole_groups`); empty when fewer than `batch_size` are ready."""
    if len(ready) < batch_size:
        return []
    head = ready[:batch_size]
    sessions = {s.session_id for s in head}
    groups = {s.task_id for s in head if s.task_id} if whole_groups else set()
    return [s for s in ready if s.session_id in sessions or (s.task_id is not None and s.task_id in groups)]


@dataclass(frozen=True)
class PreparedBatch:
    """What one training step sends, and what the loop keeps if it commits."""

    datums: list[Datum]
    turn_ids: list[str]
    running: RunningMeans
    """The running means including this batch (adopted only when the step commits)."""
    metrics: dict[str, float]
    """reward_mean (per session, total of its immediate rewards), return_mean, advantage_mean,
    advantage_abs_mean, tokens, datums, sessions, staleness_mean, staleness_max."""


def prepare_batch(
    tstore: TrainingStore,
    batch: Sequence[PendingSample],
    *,
    gamma: float,
    baseline: BaselineRule,
    normalization: NormalizationRule,
    running: RunningMeans,
    current_version: int,
) -> PreparedBatch:
    """Read the traces and tokens of `batch` and build its datums (see the module invariants)."""
    traces = tstore.session_traces(s.session_id for s in batch)
    returns: dict[str, float] = {}
    session_totals: list[float] = []
    for trace in traces.values():
        returns.update(session_returns(trace, gamma))
        session_totals.append(sum(immediate_rewards(trace).values()))
    items = [AdvantageItem(returns[s.turn_id], s.task_id, baseline_key(s.task_id, s.source)) for s in batch]
    advantages, new_running = apply_baseline(items, baseline, running)
    tokens = tstore.turn_tokens([s.turn_id for s in batch])
    lengths = [len(tokens[s.turn_id].completion_ids) for s in batch]
    scales = token_scales(lengths, normalization)
    datums: list[Datum] = []
    for s, adv, scale, n in zip(batch, advantages, scales, lengths, strict=True):
        t = tokens[s.turn_id]
        datums.append(
            Datum.from_turn(
                t.prompt_ids,
                t.completion_ids,
                t.completion_logprobs,
                [adv * scale] * n,
                t.policy_version,
                turn_id=s.turn_id,
            )
        )
    staleness = [current_version - s.policy_version for s in batch]
    n_datums = len(batch)
    metrics = {
        "reward_mean": sum(session_totals) / len(session_totals) if session_totals else 0.0,
        "return_mean": sum(i.ret for i in items) / n_datums,
        "advantage_mean": sum(advantages) / n_datums,
        "advantage_abs_mean": sum(abs(a) for a in advantages) / n_datums,
        "tokens": float(sum(lengths)),
        "datums": float(n_datums),
        "sessions": float(len(traces)),
        "staleness_mean": sum(staleness) / n_datums,
        "staleness_max": float(max(staleness)),
    }
    return PreparedBatch(datums, [s.turn_id for s in batch], new_running, metrics)
