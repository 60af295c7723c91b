"""Committed versions served beside the published one by the local backend's torch engine.

Runs on CPU with the tiny Qwen3 model (`clawbridge.devtools.tinymodel`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("clawbridge_local")

from clawbridge_local.engine import TorchEngine  # noqa: E402

from clawbridge.sampler import Sampler, SamplingParams  # noqa: E402

PROMPT = [11, 42, 7, 300, 5, 99, 1000, 3]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


async def greedy(sampler: Sampler) -> tuple[list[int], int]:
    stream = await sampler.sample(PROMPT, GREEDY)
    return [t.token_id async for t in stream], stream.policy_version


def test_engine_serves_a_loaded_version_beside_the_current_one(tiny_model_dir: Path) -> None:
    engine = TorchEngine.load(str(tiny_model_dir), device="cpu", progress=False)
    try:
        model: Any = engine._current.model
        base_head = model.get_output_embeddings().weight.detach().clone()
        torch.manual_seed(1)
        other_head = torch.randn_like(base_head)

        async def go() -> None:
            base_ids, v = await greedy(engine)
            assert v == 0
            pinned = await engine.load_version({"lm_head.weight": other_head}, 5)
            assert pinned.policy_version == 5
            pinned_ids, v = await greedy(pinned)
            assert v == 5 and pinned_ids != base_ids
            assert (await greedy(engine))[0] == base_ids  # the current weights are untouched
            # A publish replaces the current weights only; the loaded version keeps its own.
            await engine.swap_weights({"lm_head.weight": other_head * 0.5}, 6)
            assert (await greedy(pinned)) == (pinned_ids, 5)
            back = await engine.load_version({"lm_head.weight": base_head}, 0)
            assert (await greedy(back)) == (base_ids, 0)
            # Both run together on the engine's slots.
            both = await asyncio.gather(greedy(pinned), greedy(back))
            assert both == [(pinned_ids, 5), (base_ids, 0)]
            with pytest.raises(ValueError):
                await engine.load_version({"nope.weight": other_head}, 7)

        asyncio.run(go())
        assert engine.in_flight == 0
    finally:
        engine.shutdown()
