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
     running sums advance only when a step commits, and are saved with it (a restart goes on
     from the last committed step's sums; see `clawbridge.trainer.loop`).
   - `group_mean`: turns of the batch whose sessions share a task id AND that hold the same place
     among their session's trainable turns (the first with the first, the second with the second)
     form a group (GRPO-style); baseline = the group's mean return. A return is never compared
     with another place's: with gamma > 0 an earlier turn's return sums more rewards, and a later
     turn often has no verdict of its own (a judge has no next state for a session's last turn),
     so a mixed group hands every later turn the same nonzero advantage whatever it sampled: a
     push toward whatever the policy already says, which sharpens it without any signal. Turns
     without a task id use `running_mean`.
   - `group_mean_std`: `group_mean`, then divided by (the group's population std + 1e-6).
4. NORMALIZATION (`NormalizationRule`). Every backend's loss is the plain SUM over masked tokens
   of all datums of the batch (see `clawbridge_local.losses`, Tinker's `loss = -sum`), with no
   division of its own. The trainer folds the averaging into the per-token advantage instead:
   - `token_mean` (default): every loss token's advantage is divided by T, the batch's total
     completion tokens, so the summed loss is the batch's per-token mean (DAPO / Dr.GRPO).
   - `sequence_mean`: turn d's tokens are divided by (len_d * B), B the turns in the batch,
     so each sampled completion weighs the same (GRPO's per-sequence mean).
   - `sum`: no scaling.
   The scale is computed per TURN (T, len_d and B count turns and their completion tokens, never
   datums), so a session merged into one datum (`clawbridge.trainer.merge`) gets the same loss.
   A turn's advantage is the same on each of its completion tokens (then scaled as above);
   prompt positions carry 0 and mask 0 (`Datum.from_turn`).

With rewards from conversation (`clawbridge.rewards`), rule 1 is followed by 1b and 1c, and the
per-token advantage by rule 5 (`combined_rewards`, `promote_best`, `mix_token_advantages`):

1b. EXPLICIT vs JUDGE. Rule 1 gives the explicit part: rewards from `/rl/set_reward`,
    `/rl/set_session_reward` and `clawbridge reward` (every source but `judge`). A trainable turn
    that an explicit reward lands on (directly, credited from a side turn, or the session reward
    on the last turn) is "explicitly rewarded". Per turn, with `explicit_reward_rule`:
    - `override` (default): an explicitly rewarded turn's reward is its explicit reward, and its
      judge verdict is ignored; any other turn's reward is its judge verdict (0 when unjudged).
    - `add`: reward = explicit part + judge verdict.
1c. "AT LEAST ONE" (`judge_promote_best`, off by default). A session with judged turns whose
    verdicts are ALL 0 and no explicit reward gives no learning signal from its rewards. With the
    rule on, its best judged turn (the highest mean vote; the later turn on ties) gets its MEAN
    VOTE as reward, but only when that mean is > 0: e.g. votes (+1, 0, 0) give 1/3, never a
    fabricated +1, and a session with no positive vote is left alone. Effect on the advantage:
    that turn's return rises by the mean vote (and, with gamma = 1, so do the session's earlier
    turns'); under a group baseline the group mean rises with it, so the promoted session gains
    a small positive advantage relative to its group and the others lose as much: the group's
    advantages still sum to 0, and the signal is bounded by the judge's own uncertainty.
5.  METHOD (`method`, weights `w_rl`, `w_opd`, `opd_coef`). Per completion token t of a datum
    with RL advantage A (rules 1-3) and, when the turn has teacher logprobs,
    OPD_t = opd_coef * (teacher_logprob_t - sampler_logprob_t) (a turn served with notes: its
    plain-prompt reference in place of the sampler, `clawbridge.rewards.opd`):
    - `rl`: A;   `opd`: OPD_t (0 for turns without a teacher score);
    - `combine` (default): w_rl * A + w_opd * OPD_t; a turn without a teacher score gets
      w_rl * A only, a turn whose reward is 0 still gets its OPD part.
    Rule 4's scale then multiplies the whole per-token value.
6.  REWRITES (`rewrite_coef`). A trainable turn in the batch whose judge verdict came with a
    scored rewrite (`clawbridge.rewards.rewrites`) adds one more sequence: its trained prompt +
    the rewrite's ids, each with advantage `rewrite_coef`, its logprobs the base model's. Rule 4
    counts its tokens with the batch's (as one more turn), so a demonstration weighs what a
    sampled answer of its length does. The turn itself trains unchanged.

The trainer (`clawbridge.trainer.datums`) and the exports (`clawbridge.export.records`) apply these
rules through the same two functions, so an exported advantage is the one the trainer would use:
`session_rewards` (rules 1, 1b, 1c and 2 for one session) and `token_advantages` (rule 5 for one
turn); rule 3 is `apply_baseline` over their `AdvantageItem`s (`advantage_item`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from clawbridge.config import (
    BaselineRule,
    ExplicitRule,
    NormalizationRule,
    RewardMethod,
    Settings,
    default_of,
)
from clawbridge.rewards.opd import opd_advantages
from clawbridge.store.rewards import TurnSignal
from clawbridge.store.training import SessionTrace

GROUP_BASELINES: frozenset[str] = frozenset({"group_mean", "group_mean_std"})
"""The baseline rules that compare turns within a group (a task id and a place, rule 3)."""

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


def turn_positions(trace: SessionTrace) -> dict[str, int]:
    """Each trainable turn's place among its session's trainable turns (0: the first), by turn id."""
    return {t.turn_id: i for i, t in enumerate(t for t in trace.turns if t.trainable)}


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
    position: int = 0
    """The turn's place among its session's trainable turns (0: the first); group_* baselines
    compare only turns of the same task at the same place (rule 3)."""


def apply_baseline(
    items: Sequence[AdvantageItem], rule: BaselineRule, running: RunningMeans
) -> tuple[list[float], RunningMeans]:
    """Rule 3. Returns the advantages and the running means to keep once the step commits."""
    fallback = running.plus([i.key for i in items], [i.ret for i in items])
    if rule == "none":
        return [i.ret for i in items], fallback
    if rule == "running_mean":
        return [i.ret - fallback.mean(i.key) for i in items], fallback
    groups: dict[tuple[str, int], list[float]] = {}
    for i in items:
        if i.group_id is not None:
            groups.setdefault((i.group_id, i.position), []).append(i.ret)
    out: list[float] = []
    for i in items:
        if i.group_id is None:
            out.append(i.ret - fallback.mean(i.key))
            continue
        values = groups[(i.group_id, i.position)]
        mean = sum(values) / len(values)
        adv = i.ret - mean
        if rule == "group_mean_std":
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            adv /= std + STD_EPS
        out.append(adv)
    return out, fallback


def token_scales(lengths: Sequence[int], rule: NormalizationRule) -> list[float]:
    """Rule 4: the factor each turn's per-token advantage is multiplied by, given the
    completion lengths of the batch's turns."""
    if rule == "sum":
        return [1.0] * len(lengths)
    if rule == "token_mean":
        total = sum(lengths)
        return [1.0 / total if total else 0.0] * len(lengths)
    n = len(lengths)
    return [1.0 / (length * n) if length else 0.0 for length in lengths]


# ------------------------------------------------------------------ rewards from conversation



def explicit_targets(trace: SessionTrace) -> set[str]:
    """Rule 1b: the trainable turns an explicit reward lands on (per rule 1's crediting)."""
    trainable = [t for t in trace.turns if t.trainable]
    out: set[str] = set()
    if not trainable:
        return out
    for turn in trace.turns:
        if turn.reward is None:
            continue
        if turn.trainable:
            out.add(turn.turn_id)
            continue
        before = [t for t in trainable if t.seq < turn.seq]
        out.add((before[-1] if before else next(t for t in trainable if t.seq > turn.seq)).turn_id)
    if trace.session_reward is not None:
        out.add(trainable[-1].turn_id)
    return out


def promote_best(judged: Mapping[str, float], mean_votes: Mapping[str, float], order: Sequence[str]) -> dict[str, float]:
    """Rule 1c: `{turn_id: mean_vote}` for the promoted turn, or {} (see the module docstring).

    `judged`: verdicts of the session's judged turns; `order`: trainable turn ids in seq order."""
    if not judged or any(v != 0 for v in judged.values()):
        return {}
    best: str | None = None
    for tid in order:
        m = mean_votes.get(tid)
        if tid in judged and m is not None and m > 0 and (best is None or m >= mean_votes[best]):
            best = tid
    return {} if best is None else {best: float(mean_votes[best])}


def combined_rewards(
    trace: SessionTrace,
    judge: Mapping[str, float],
    rule: ExplicitRule,
    mean_votes: Mapping[str, float] | None = None,
    promote: bool = False,
) -> dict[str, float]:
    """Rules 1 + 1b + 1c: each trainable turn's immediate reward, by turn id."""
    explicit = immediate_rewards(trace)
    targets = explicit_targets(trace)
    order = [t.turn_id for t in trace.turns if t.trainable]
    out: dict[str, float] = {}
    for tid in order:
        j = judge.get(tid, 0.0)
        out[tid] = explicit[tid] if (rule == "override" and tid in targets) else explicit[tid] + j
    if promote and not targets:
        judged = {tid: judge[tid] for tid in order if tid in judge}
        out.update(promote_best(judged, mean_votes or {}, order))
    return out


def mix_token_advantages(
    rl_advantage: float, opd: Sequence[float] | None, n_tokens: int, method: RewardMethod,
    w_rl: float, w_opd: float,
) -> list[float]:
    """Rule 5 (before rule 4's scale): the per-token advantages of one datum."""
    rl = {"rl": 1.0, "opd": 0.0, "combine": w_rl}[method] * rl_advantage
    w = {"rl": 0.0, "opd": 1.0, "combine": w_opd}[method]
    if opd is None or w == 0.0:
        return [rl] * n_tokens
    if len(opd) != n_tokens:
        raise ValueError(f"OPD advantages have {len(opd)} entries for {n_tokens} tokens")
    return [rl + w * o for o in opd]


@dataclass(frozen=True)
class RewardMix:
    """How explicit rewards, judge verdicts and OPD combine (rules 1b, 1c and 5)."""

    method: RewardMethod = default_of("method")
    w_rl: float = default_of("w_rl")
    w_opd: float = default_of("w_opd")
    opd_coef: float = default_of("opd_coef")
    explicit_rule: ExplicitRule = default_of("explicit_reward_rule")
    promote_best: bool = default_of("judge_promote_best")
    rewrite_coef: float = default_of("rewrite_coef")
    """Rule 6: the advantage of each token of a judge's rewrite (0: rewrites do not train)."""

    @classmethod
    def from_settings(cls, s: Settings) -> RewardMix:
        """The mix the settings ask for (`method`, `w_rl`, `w_opd`, `opd_coef`,
        `explicit_reward_rule`, `judge_promote_best`)."""
        return cls(method=s.method, w_rl=s.w_rl, w_opd=s.w_opd, opd_coef=s.opd_coef,
                   explicit_rule=s.explicit_reward_rule, promote_best=s.judge_promote_best,
                   rewrite_coef=s.rewrite_coef)


@dataclass(frozen=True)
class SessionRewards:
    """Rules 1, 1b, 1c and 2 for one session's trainable turns, by turn id."""

    rewards: dict[str, float]
    """The immediate reward of each trainable turn (explicit and judge, by `RewardMix`)."""
    returns: dict[str, float]
    """Each trainable turn's discounted return (rule 2)."""
    positions: dict[str, int]
    """Each trainable turn's place among its session's trainable turns (rule 3's groups)."""


def session_rewards(trace: SessionTrace, signals: Mapping[str, TurnSignal], mix: RewardMix,
                    gamma: float) -> SessionRewards:
    """The rewards, returns and places of `trace`'s trainable turns, given the judge's `signals`."""
    judge = {k: v.judge_score for k, v in signals.items() if v.judge_score is not None}
    votes = {k: v.mean_vote for k, v in signals.items() if v.mean_vote is not None}
    rewards = combined_rewards(trace, judge, mix.explicit_rule, votes, mix.promote_best)
    ids = [t.turn_id for t in trace.turns if t.trainable]
    returns = dict(zip(ids, discounted_returns([rewards[i] for i in ids], gamma), strict=True))
    return SessionRewards(rewards, returns, turn_positions(trace))


def advantage_item(ret: float, task_id: str | None, source: str, position: int) -> AdvantageItem:
    """A turn's inputs to rule 3 (`apply_baseline`)."""
    return AdvantageItem(ret, task_id, baseline_key(task_id, source), position)


def token_advantages(advantage: float, teacher: Sequence[float] | None, sampler: Sequence[float],
                     mix: RewardMix, reference: Sequence[float] | None = None,
                     ) -> tuple[list[float], list[float] | None]:
    """Rule 5 for one turn: its per-token advantages (before rule 4's scale) and its OPD part
    (None without teacher logprobs). `reference`: a turn served with notes, its plain-prompt
    reference (`clawbridge.rewards.opd`). Teacher or reference logprobs of another length than the
    completion (`sampler`, its sampled logprobs) raise `ValueError`."""
    opd = None if teacher is None else opd_advantages(teacher, sampler, mix.opd_coef, reference)
    return mix_token_advantages(advantage, opd, len(sampler), mix.method, mix.w_rl, mix.w_opd), opd
