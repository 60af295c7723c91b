"""The torch engine's KV memory (issue 32 §1): the automatic budget sized from the free memory
(`clawbridge_local.kvbudget`) and said in `clawbridge status`, and keys and values kept in bfloat16.

Real torch and the tiny Qwen3 model; the pool's attention is checked against plain SDPA on the
values the pool holds; the budget's rule is a pure function, fed the free memory by the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("clawbridge_local")

import torch.nn.functional as F  # noqa: E402
from clawbridge_local.engine import TorchEngine  # noqa: E402
from clawbridge_local.kvbudget import (  # noqa: E402
    GIB,
    PER_REQUEST,
    MemoryShare,
    choose_budget,
    free_memory,
    resolve_kv_dtype,
    trainer_estimate,
)
from clawbridge_local.kvpool import KVPool, Row, StepPlan, _active, pool_attention  # noqa: E402

from clawbridge.serving.sampler import SamplingParams  # noqa: E402
from tests.test_engine import PROMPT, collect, run  # noqa: E402

SMOL = {"context_window": 8192, "max_running": 8, "bytes_per_token": 23040, "dtype": torch.bfloat16}
"""SmolLM2-135M's shape: 30 layers x 3 key/value heads x 64, keys and values in bfloat16."""


def test_the_automatic_budget_is_a_share_of_the_free_memory_within_its_bounds() -> None:
    # Plenty of memory: the concurrency's ceiling decides, and says what memory would allow.
    big = choose_budget(**SMOL, fraction=0.25, free_bytes=20 * GIB, trainer_bytes=GIB // 2)
    assert big.tokens == 8 * PER_REQUEST
    assert big.describe().startswith("KV budget 16,384 positions (360 MiB, bf16): max_running_requests 8 x 2,048")
    assert "25% of the 19.5 GiB free after weights and trainer" in big.reason and "would allow" in big.reason
    # Little memory: a quarter of what is free after the trainer's share.
    small = choose_budget(**SMOL, fraction=0.25, free_bytes=2 * GIB, trainer_bytes=GIB)
    assert small.tokens == (GIB // 4) // 23040 and small.bytes <= GIB // 4
    assert small.reason.startswith("25% of the 1.0 GiB free after weights and trainer")
    # Too little for one whole context: one context anyway, and the user is told what to change.
    tiny = choose_budget(**SMOL, fraction=0.25, free_bytes=GIB // 4, trainer_bytes=GIB)
    assert tiny.tokens == 8192 and "set kv_budget_tokens" in tiny.reason
    # An explicit budget is taken as it is; an unknown free memory leaves the ceiling.
    assert choose_budget(**SMOL, fraction=0.25, free_bytes=None, trainer_bytes=0, explicit=1000).tokens == 1000
    unknown = choose_budget(**SMOL, fraction=0.25, free_bytes=None, trainer_bytes=0)
    assert unknown.tokens == 16384 and "free memory not known" in unknown.reason
    # A long context: one whole context is the floor of the ceiling.
    assert choose_budget(**{**SMOL, "context_window": 40960}, fraction=0.25, free_bytes=None,
                         trainer_bytes=0).tokens == 40960


def test_trainer_estimate_and_kv_dtype_resolution() -> None:
    assert trainer_estimate(100, lora=True, in_process=True, training=True) == 100
    assert trainer_estimate(100, lora=True, in_process=False, training=True) == 200
    assert trainer_estimate(100, lora=False, in_process=True, training=True) == 400
    assert trainer_estimate(100, lora=True, in_process=True, training=False) == 0
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype("auto", torch.float32, cpu) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float32, cuda) == torch.float32
    assert resolve_kv_dtype("float32", torch.float32, cpu) == torch.float32
    free = free_memory(cpu)
    assert free is not None and free > 0


def test_a_bfloat16_pool_attends_over_exactly_what_it_holds() -> None:
    """Decode, a cold prefill and a prefill after a cached prefix, with a bfloat16 pool: the pool's
    attention equals SDPA in bfloat16 over the keys and values rounded as the pool keeps them."""
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(n_layers=1, kv_heads=2, head_dim=8, budget_tokens=32, dtype=torch.bfloat16,
                  device=torch.device("cpu"))
    layer = torch.nn.Module()
    layer.layer_idx = 0  # type: ignore[assignment]
    keys = torch.randn(1, 2, 12, 8, generator=gen)
    values = torch.randn(1, 2, 12, 8, generator=gen)
    queries = torch.randn(1, 4, 12, 8, generator=gen)  # 4 query heads over 2 key/value heads

    def attend(cached: int, new: int) -> torch.Tensor:
        _active.plan = StepPlan(pool, [Row(4, cached, new)])
        try:
            out, _ = pool_attention(layer, queries[:, :, cached:cached + new], keys[:, :, cached:cached + new],
                                    values[:, :, cached:cached + new], None, scaling=0.5)
        finally:
            _active.plan = None
        return out

    def reference(cached: int, new: int) -> torch.Tensor:
        k = keys[:, :, :cached + new].bfloat16().repeat_interleave(2, 1)
        v = values[:, :, :cached + new].bfloat16().repeat_interleave(2, 1)
        mask = torch.arange(cached + new)[None, :] <= torch.arange(cached, cached + new)[:, None]
        q = queries[:, :, cached:cached + new].bfloat16()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5).float().transpose(1, 2)

    for cached, new in ((0, 6), (6, 1), (7, 5)):
        got = attend(cached, new)
        assert got.dtype == torch.float32
        assert torch.allclose(got, reference(cached, new), atol=2e-2, rtol=0)  # bf16 arithmetic, two orders of sums
    assert torch.equal(pool.keys[0][:, 4:16], keys[0].bfloat16())  # what was written is the rounded keys


@pytest.fixture
def engines(tiny_model_dir: Path) -> Iterator[Any]:
    made: list[TorchEngine] = []

    def make(**kw: Any) -> TorchEngine:
        eng = TorchEngine.load(str(tiny_model_dir), device="cpu", dtype="float32", progress=False, **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.shutdown()


def test_bfloat16_keys_and_values_halve_the_pool_and_stay_repeatable(engines: Any) -> None:
    """The same budget in bfloat16 takes half the bytes; sampled logprobs stay within 0.05 nats of a
    float32 pool's (they are not equal: the keys and values used were rounded), and a prompt sent
    again gets bit-identical logprobs, as in float32."""
    fp32 = engines(kv_budget_tokens=512)
    bf16 = engines(kv_budget_tokens=512, kv_dtype=torch.bfloat16)
    assert bf16.pool.dtype == torch.bfloat16 and fp32.pool.dtype == torch.float32
    assert 2 * bf16.kv_budget.bytes == fp32.kv_budget.bytes
    assert bf16.engine_status()["kv_dtype"] == "bf16"
    greedy = SamplingParams(max_tokens=12, temperature=0.0)

    async def go(eng: TorchEngine) -> list[Any]:
        return (await collect(eng, PROMPT, greedy))[0]

    a, b = run(go(fp32)), run(go(bf16))
    same = [(x.logprob, y.logprob) for x, y in zip(a, b, strict=True) if x.token_id == y.token_id]
    assert same and max(abs(x - y) for x, y in same) < 0.05
    assert any(x != y for x, y in same)
    again = run(go(bf16))
    assert [(t.token_id, t.logprob) for t in again] == [(t.token_id, t.logprob) for t in b]


def test_the_engine_sizes_its_budget_from_the_free_memory(engines: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`MemoryShare`: the free memory read when the engine starts, less the trainer's estimate."""
    import clawbridge_local.kvbudget as kvbudget

    monkeypatch.setattr(kvbudget, "free_memory", lambda device: 64 * 2**20)
    eng = engines(kv_dtype=torch.bfloat16, kv_budget_rule=MemoryShare(0.5, training=True))
    weights = sum(p.numel() * p.element_size() for p in eng._current.model.parameters())
    per = KVPool.bytes_per_token(eng._current.model, torch.bfloat16)
    context = int(eng._current.model.config.max_position_embeddings)
    want = max(context, int(0.5 * (64 * 2**20 - weights)) // per)
    assert eng.kv_budget.tokens == min(want, max(context, 8 * min(context, PER_REQUEST)))
    assert eng.engine_status()["kv_budget"].startswith(f"KV budget {eng.kv_budget.tokens:,} positions")


def test_status_says_what_the_budget_is_and_why() -> None:
    from clawbridge.cli.status import engine_line

    line = engine_line({"kv_budget": "KV budget 16,384 positions (360 MiB, bf16): max_running_requests 8 x 2,048",
                        "kv_used_fraction": 0.25, "kv_used_tokens": 4096, "kv_budget_tokens": 16384,
                        "kv_cached_tokens": 1000, "kv_high_water_tokens": 9000, "running": 2, "waiting": 0,
                        "waited_for_budget": 0})
    assert line.startswith("engine: KV budget 16,384 positions (360 MiB, bf16): max_running_requests 8 x 2,048\n")
    assert "9000 positions written so far" in line

