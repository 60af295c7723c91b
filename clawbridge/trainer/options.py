"""`TrainerConfig`: the trainer loop's options, one field per setting of `Settings`' trainer
section (`from_settings`), each defaulting to that setting's default (`default_of`), so a loop
built without settings (tests, benches) behaves as a default server does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clawbridge.backend import LossConfig
from clawbridge.config import BaselineRule, NormalizationRule, Settings, StalePolicy, default_of
from clawbridge.trainer.advantages import RewardMix


@dataclass(frozen=True)
class TrainerConfig:
    """The trainer loop's options (`Settings`' "trainer loop" section, see `from_settings`)."""

    batch_size: int = default_of("batch_size")
    """Ready turns (samples) needed before a step runs (a batch may hold more: whole
    sessions/groups); merged turns count one each."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Loss name, clip thresholds and KL coefficient sent with every step."""
    updates_per_step: int = default_of("updates_per_step")
    """`train_step` calls on each batch before its one publish (module invariants)."""
    gamma: float = default_of("gamma")
    """Turn discount (advantages rule 2)."""
    baseline: BaselineRule = default_of("baseline")
    """Advantages rule 3."""
    normalization: NormalizationRule = default_of("advantage_normalization")
    """Advantages rule 4."""
    max_off_policy_steps: int = default_of("max_off_policy_steps")
    """Datums sampled more than this many versions before the serving one are stale."""
    stale_policy: StalePolicy = default_of("stale_policy")
    drop_stale_after: int = default_of("drop_stale_after")
    """importance_weight: still drop samples more than this many versions behind (0: never)."""
    max_batch_tokens: int = default_of("max_batch_tokens")
    """A backlog trains in steps of up to this many sampled tokens (0: exactly batch_size)."""
    capacity_mode: bool = default_of("capacity_mode")
    """Refuse new sessions (429) while the backlog is at its bound."""
    max_backlog: int = default_of("max_backlog")
    """The capacity bound in datums; 0: batch_size * (max_off_policy_steps + 1)."""
    reward_wait_s: float = default_of("reward_wait_s")
    """Samples of sessions ended this long ago without any reward are dropped (`no_reward`)."""
    batch_wait_s: float = default_of("batch_wait_s")
    """Fewer than batch_size samples ready this long train as a short batch (0: wait for a full one)."""
    poll_interval_s: float = default_of("trainer_poll_interval_s")
    """How often the loop looks for a ready batch when idle."""
    mix: RewardMix = field(default_factory=RewardMix)
    """Explicit vs judge rewards, the "at least one" rule and the method (advantages rules 1b-5)."""
    wait_for_judge: bool = default_of("judge") != "off"
    """A judge is configured: train a session only after the judge finished it."""
    merge_turns: bool = default_of("merge_session_turns")
    """Train a session's turns as one datum where each prompt extends the previous turn's."""
    rehearsal_coef: float = default_of("rehearsal_coef")
    """Advantage of each rehearsed token (`clawbridge.promotion.rehearsal`; 0: off)."""
    rehearsal_items: int = default_of("rehearsal_items")
    """Rehearsed answers per step."""

    @classmethod
    def from_settings(cls, s: Settings) -> TrainerConfig:
        return cls(
            batch_size=s.batch_size,
            loss=LossConfig(name=s.loss, clip_low=s.clip_low, clip_high=s.clip_high, kl_coef=s.kl_coef),
            updates_per_step=s.updates_per_step,
            gamma=s.gamma,
            baseline=s.baseline,
            normalization=s.advantage_normalization,
            max_off_policy_steps=s.max_off_policy_steps,
            stale_policy=s.stale_policy,
            drop_stale_after=s.drop_stale_after,
            max_batch_tokens=s.max_batch_tokens,
            capacity_mode=s.capacity_mode,
            max_backlog=s.max_backlog,
            reward_wait_s=s.reward_wait_s,
            batch_wait_s=s.batch_wait_s,
            poll_interval_s=s.trainer_poll_interval_s,
            mix=RewardMix.from_settings(s),
            wait_for_judge=s.judge != "off",
            merge_turns=s.merge_session_turns,
            rehearsal_coef=s.rehearsal_coef,
            rehearsal_items=s.rehearsal_items,
        )

    @property
    def backlog_bound(self) -> int:
        return self.max_backlog or self.batch_size * (self.max_off_policy_steps + 1)
