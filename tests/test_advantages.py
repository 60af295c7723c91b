"""The advantage rules of clawbridge.trainer.advantages on hand-computed examples."""

from __future__ import annotations

import math

import pytest

from clawbridge.store.training import SessionTrace, TraceTurn
from clawbridge.trainer.advantages import (
    AdvantageItem,
    RunningMeans,
    apply_baseline,
    discounted_returns,
    immediate_rewards,
    session_returns,
    token_scales,
)


def trace(turns: list[tuple[str, bool, float | None]], session_reward: float | None = None) -> SessionTrace:
    return SessionTrace(
        "s",
        None,
        "header",
        tuple(TraceTurn(tid, i, main, r) for i, (tid, main, r) in enumerate(turns)),
        session_reward,
    )


def test_backward_discount_rule() -> None:
    # r[i] += gamma * r[i+1], last first: [1, 0, 2] with gamma 0.5 -> [1 + 0.5*1, 0 + 0.5*2, 2].
    assert discounted_returns([1.0, 0.0, 2.0], 0.5) == [1.5, 1.0, 2.0]
    assert discounted_returns([0.0, 0.0, 1.0], 0.9) == pytest.approx([0.81, 0.9, 1.0])
    assert discounted_returns([1.0, 2.0, 3.0], 0.0) == [1.0, 2.0, 3.0]  # per-turn only
    assert discounted_returns([1.0, 2.0, 3.0], 1.0) == [6.0, 5.0, 3.0]  # reward-to-go
    assert discounted_returns([], 0.5) == []


def test_session_reward_is_spread_over_turns_by_gamma() -> None:
    t = trace([("a", True, None), ("b", True, None), ("c", True, None)], session_reward=2.0)
    assert session_returns(t, 1.0) == {"a": 2.0, "b": 2.0, "c": 2.0}
    assert session_returns(t, 0.5) == {"a": 0.5, "b": 1.0, "c": 2.0}


def test_side_turn_rewards_are_credited_to_the_main_turn_before() -> None:
    t = trace(
        [("s0", False, 1.0), ("m1", True, 1.0), ("s2", False, 0.5), ("m3", True, None), ("s4", False, 2.0)],
        session_reward=3.0,
    )
    # s0 has no main turn before it -> first main after (m1); s2 -> m1; s4 -> m3; session reward -> m3.
    assert immediate_rewards(t) == {"m1": 2.5, "m3": 5.0}
    assert session_returns(t, 0.5) == {"m1": 2.5 + 0.5 * 5.0, "m3": 5.0}
    assert immediate_rewards(trace([("s0", False, 1.0)])) == {}


def test_running_mean_baseline_includes_the_batch_and_carries_over() -> None:
    items = [
        AdvantageItem(1.0, None, "source:header"),
        AdvantageItem(3.0, None, "source:header"),
        AdvantageItem(10.0, None, "source:implicit"),
    ]
    adv, running = apply_baseline(items, "running_mean", RunningMeans())
    assert adv == [-1.0, 1.0, 0.0]
    # Next batch: mean over everything seen under the key, this batch included: (1 + 3 + 5) / 3 = 3.
    adv2, running2 = apply_baseline([AdvantageItem(5.0, None, "source:header")], "running_mean", running)
    assert adv2 == [2.0]
    assert running2.counts["source:header"] == 3 and running2.mean("source:header") == 3.0
    # "none" leaves returns alone but still keeps the running sums.
    adv3, _ = apply_baseline(items, "none", RunningMeans())
    assert adv3 == [1.0, 3.0, 10.0]


def test_group_baselines_grpo_style() -> None:
    items = [AdvantageItem(r, "t1", "task:t1") for r in (1.0, 0.0, 0.0, 1.0)]
    items += [AdvantageItem(3.0, "t2", "task:t2")]  # a group of one: nothing to compare with
    items += [AdvantageItem(4.0, None, "source:header")]  # no group: falls back to the running mean
    start = RunningMeans({"source:header": 2.0}, {"source:header": 2})
    adv, _ = apply_baseline(items, "group_mean", start)
    assert adv == [0.5, -0.5, -0.5, 0.5, 0.0, 4.0 - (2.0 + 4.0) / 3]
    adv_std, _ = apply_baseline(items, "group_mean_std", start)
    # population std of [1, 0, 0, 1] is 0.5
    k = 0.5 / (0.5 + 1e-6)
    assert adv_std[:4] == pytest.approx([k, -k, -k, k])
    assert adv_std[:4] == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert adv_std[4] == 0.0
    # Identical returns: zero advantages, never NaN.
    same, _ = apply_baseline([AdvantageItem(1.0, "g", "k")] * 3, "group_mean_std", RunningMeans())
    assert same == [0.0, 0.0, 0.0] and not any(math.isnan(a) for a in same)


def test_group_baseline_compares_a_turn_only_with_the_same_place_of_its_task() -> None:
    # Two-turn sessions of one task, as in the judge demo: the first turns were judged (+1 / -1),
    # the last turns have no next state and no verdict (0). Mixed into one group the last turns
    # would all get +0.5 - whatever they sampled; by place they get 0, the first turns +-1.
    firsts = [AdvantageItem(r, "t1", "task:t1", 0) for r in (1.0, -1.0, -1.0, -1.0)]
    lasts = [AdvantageItem(0.0, "t1", "task:t1", 1) for _ in range(4)]
    adv, _ = apply_baseline(firsts + lasts, "group_mean", RunningMeans())
    assert adv == [1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    std, _ = apply_baseline(firsts + lasts, "group_mean_std", RunningMeans())
    assert std[4:] == [0.0] * 4 and sum(std[:4]) == pytest.approx(0.0)


def test_token_sum_normalization_rules() -> None:
    assert token_scales([2, 3], "token_mean") == [0.2, 0.2]
    assert token_scales([2, 3], "sequence_mean") == [1 / 4, 1 / 6]
    assert token_scales([2, 3], "sum") == [1.0, 1.0]
    # token_mean: a token-sum loss over the batch with advantages A*scale is the per-token mean.
    lengths, advs = [2, 3], [1.0, -2.0]
    scales = token_scales(lengths, "token_mean")
    summed = sum(a * s * n for a, s, n in zip(advs, scales, lengths, strict=True))
    assert summed == pytest.approx((1.0 * 2 - 2.0 * 3) / 5)
