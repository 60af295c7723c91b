"""Each default and each allowed-value list is written once, in `clawbridge.config.Settings`: the
component configs built from it (`TrainerConfig`, `LossConfig`, `RewardMix`, `WorkerConfig`,
`VoteConfig`) built directly equal those built from default settings, so code (a test, a
benchmark, an embedding) that builds one directly trains as production does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import get_args, get_type_hints

import pytest

from clawbridge.backend import LossConfig
from clawbridge.config import Settings
from clawbridge.rewards.judge import VoteConfig
from clawbridge.rewards.worker import WorkerConfig
from clawbridge.trainer.advantages import RewardMix
from clawbridge.trainer.loop import TrainerConfig


@pytest.fixture
def defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in [n for n in os.environ if n.startswith("CLAWBRIDGE_")]:
        monkeypatch.delenv(name)
    return Settings(state_dir=tmp_path)


def test_component_configs_built_directly_equal_those_from_default_settings(defaults: Settings) -> None:
    built = TrainerConfig.from_settings(defaults)
    assert TrainerConfig() == built
    assert LossConfig() == built.loss and built.loss.name == defaults.loss == "cispo"
    assert RewardMix() == built.mix == RewardMix.from_settings(defaults)
    assert (built.stale_policy, built.max_batch_tokens, built.batch_wait_s) == (
        defaults.stale_policy, defaults.max_batch_tokens, defaults.batch_wait_s)
    worker = WorkerConfig.from_settings(defaults)
    assert WorkerConfig() == worker
    assert VoteConfig(backoff_s=worker.votes.backoff_s) == worker.votes


def test_allowed_values_are_the_settings_own() -> None:
    """A component's field takes exactly the values the option takes (one Literal, in config)."""
    fields = Settings.model_fields
    pairs = [("loss", LossConfig, "name"), ("baseline", TrainerConfig, "baseline"),
             ("advantage_normalization", TrainerConfig, "normalization"),
             ("stale_policy", TrainerConfig, "stale_policy"), ("method", RewardMix, "method"),
             ("explicit_reward_rule", RewardMix, "explicit_rule")]
    for option, component, field in pairs:
        assert get_args(get_type_hints(component)[field]) == get_args(fields[option].annotation), option
