"""The demo, shortened: a sign error anywhere in rewards, advantages, loss or publishing fails this."""

from __future__ import annotations

from pathlib import Path

from clawbridge.demo import DemoConfig, run_demo, token_reward


def test_token_reward() -> None:
    assert token_reward(["the", " cat", "<|im_end|>"]) == 0.5
    assert token_reward([]) == 0.0


def test_demo_reward_rises(tmp_path: Path) -> None:
    result = run_demo(DemoConfig(sessions=160), tmp_path)
    assert len(result.episodes) == 160
    versions = {e.policy_version for e in result.episodes}
    assert max(versions) >= 8, f"expected many published versions, got {sorted(versions)}"
    first, last = result.head_tail()
    print(f"demo: first 20% {first:.3f} -> last 20% {last:.3f} in {result.seconds:.0f}s")
    assert last - first > 0.25, f"reward did not rise: {first:.3f} -> {last:.3f}"
    assert result.plot is not None and result.plot.stat().st_size > 10_000
    assert (tmp_path / "episodes.jsonl").read_text().count("\n") == 160
