"""Several optimizer updates on one batch (`updates_per_step`), on real torch: what bounds them.

The trainer loop calls `train_step` on the same datums `updates_per_step` times (the loop's side
is tested on the fake backend in tests/test_trainer_loop.py). Each update after the first sees the
recorded sampler logprobs as stale ones. Measured here on the tiny model through the local backend,
one rewarded answer, the mean ratio of its tokens after each update: under `ppo` each later
update moves it less than the one before (a token past the clip stops pushing), under `cispo` it
keeps growing (the clip caps a token's weight, not its push). The setting's description says so.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("clawbridge_local")

from clawbridge_local.backend import LocalBackend

from clawbridge.backend import Datum, LossConfig
from clawbridge.config import Settings
from tests.test_lora_serving import PROMPT, SCORED, run


def lora_backend(model: Path, state: Path) -> LocalBackend:
    """The local torch backend on CPU with a rank-4 LoRA and a rate that moves in a few updates."""
    settings = Settings.model_validate({"model": str(model), "state_dir": str(state), "lora_rank": 4,
                                        "learning_rate": 0.002,
                                        "backends": {"local": {"engine": "torch", "device": "cpu"}}})
    return LocalBackend(settings, progress=False)


def ratios_after_each_update(model: Path, state: Path, loss: str, updates: int) -> list[float]:
    """The batch's mean token ratio (new / sampler) reported by each update, updates 2..n."""
    backend = lora_backend(model, state)

    async def go() -> list[float]:
        await backend.start()
        try:
            ids, lps, _ = await run(backend.sampler(), SCORED)
            datum = Datum.from_turn(PROMPT, ids, lps, [1.0] * len(ids), policy_version=0, turn_id="t0")
            seen = [(await backend.train_step([datum], LossConfig(loss))).metrics for _ in range(updates)]
        finally:
            await backend.close()
        assert seen[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-3)  # the first update is on-policy
        return [m["ratio_mean"] for m in seen[1:]]

    return asyncio.run(go())


def test_ppo_bounds_the_pull_of_several_updates_and_cispo_does_not(tiny_model_dir: Path, tmp_path: Path) -> None:
    ppo = ratios_after_each_update(tiny_model_dir, tmp_path / "ppo", "ppo", 4)
    cispo = ratios_after_each_update(tiny_model_dir, tmp_path / "cispo", "cispo", 4)
    assert ppo[0] == pytest.approx(cispo[0], rel=1e-3)  # the same first update
    ppo_steps = [b - a for a, b in itertools.pairwise(ppo)]
    cispo_steps = [b - a for a, b in itertools.pairwise(cispo)]
    assert all(s > 0 for s in ppo_steps) and ppo_steps[1] < ppo_steps[0]  # still learning, less each time
    assert cispo_steps[1] > cispo_steps[0] > ppo_steps[0]  # cispo's push grows
