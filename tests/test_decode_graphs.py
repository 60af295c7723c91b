"""The torch engine's fixed-shape steps (issue 36 §2) on CPU: what CUDA graphs replay and packed
prefills run, without capture (`graphs="static"`), against the eager steps.

Real torch, the tiny Qwen3 model, float32: a padded static decode step gives every row its
unbatched eager logits to 1e-4 and leaves the pool as the eager steps do (padding rows change
nothing); the engine with static steps and packed prefills gives the same tokens and logprobs as
the eager engine, prefix reuse included, and a repeated prompt is still bit-identical; batched
sampling draws exactly what `choose` draws row by row. The CUDA capture itself runs in the GPU kit
(bench/gpu/kit.py, part `graphs`), which compares replayed logprobs with eager ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from clawbridge_local.decode_graphs import BATCH_BUCKETS, LENGTH_BUCKETS, StaticDecode, bucket  # noqa: E402
from clawbridge_local.engine import TorchEngine  # noqa: E402
from clawbridge_local.kvpool import KVPool, Row, install  # noqa: E402
from clawbridge_local.loading import load_causal_lm  # noqa: E402
from clawbridge_local.sampling import choose, choose_rows, make_generator  # noqa: E402

from clawbridge.devtools.tinymodel import build_tiny_model  # noqa: E402
from clawbridge.serving.sampler import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_graphs"))


@pytest.fixture
def make_engine(model_dir: Path) -> Iterator[Any]:
    made: list[TorchEngine] = []

    def make(**kw: Any) -> TorchEngine:
        eng = TorchEngine.load(str(model_dir), device="cpu", progress=False, max_running=8, **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.shutdown()


def test_buckets_pad_up_and_stop_at_the_largest() -> None:
    assert [bucket(n, BATCH_BUCKETS) for n in (1, 2, 3, 5, 32, 33, 256)] == [1, 2, 4, 8, 32, 64, 256]
    assert bucket(257, BATCH_BUCKETS) is None
    assert bucket(1, LENGTH_BUCKETS) == 256 and bucket(257, LENGTH_BUCKETS) == 512
    assert bucket(LENGTH_BUCKETS[-1] + 1, LENGTH_BUCKETS) is None


def test_choose_rows_draws_exactly_what_choose_draws_row_by_row() -> None:
    vocab = 500
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(3)) * 4
    params = [SamplingParams(max_tokens=1, temperature=0.0), SamplingParams(max_tokens=1, temperature=1.0, seed=1),
              SamplingParams(max_tokens=1, temperature=0.7, seed=2), SamplingParams(max_tokens=1, temperature=1.3),
              SamplingParams(max_tokens=1, temperature=0.9, top_k=20, seed=4),
              SamplingParams(max_tokens=1, temperature=1.0, top_p=0.8, seed=5),
              SamplingParams(max_tokens=1, temperature=1.0, top_logprobs=3, seed=6)]
    seeds = [p.seed if p.seed is not None else 100 + i for i, p in enumerate(params)]
    together = [make_generator(s, torch.device("cpu")) for s in seeds]
    alone = [make_generator(s, torch.device("cpu")) for s in seeds]
    for step in range(4):  # the generators move on alike
        x = logits.roll(step, dims=1)
        got = choose_rows(x, params, together)
        want = [choose(x[i], p, alone[i]) for i, p in enumerate(params)]
        assert got == want


def _pool_pair(model_dir: Path) -> tuple[Any, KVPool, KVPool, list[Row], list[list[int]]]:
    """The tiny model and two pools holding the same prefills of three prompts (one region at 0)."""
    model = load_causal_lm(str(model_dir), torch.device("cpu"), torch.float32, progress=False)
    install(model)
    pools = [KVPool.for_model(model, 256) for _ in range(2)]
    prompts = [[5, 17, 40, 2, 9], [300, 301, 7, 8, 9, 10, 11, 12, 13], [44, 45]]
    starts = [0, 40, 120]
    rows = []
    with torch.inference_mode():
        for pool in pools:
            for p, s in zip(prompts, starts, strict=True):
                pool.forward(model, [p], [Row(s, 0, len(p))])
        rows = [Row(s, len(p), 1) for p, s in zip(prompts, starts, strict=True)]
    return model, pools[0], pools[1], rows, prompts


def test_a_padded_static_step_equals_each_row_alone_and_padding_writes_nothing(model_dir: Path) -> None:
    model, fixed, eager, rows, _ = _pool_pair(model_dir)
    tokens = [3, 1000, 77]
    before = [k.clone() for k in fixed.keys]
    with torch.inference_mode():
        static = StaticDecode(fixed, capture=False)
        got = static.forward(model, tokens, rows)  # 3 rows padded to a batch of 4
        assert got is not None and got.shape[0] == 3 and static.eager_runs == 1
        got = got.clone()
        want = torch.cat([eager.forward(model, [[t]], [r]) for t, r in zip(tokens, rows, strict=True)])
    assert (got - want).abs().max().item() <= 1e-4
    written = {r.start + r.cached for r in rows}
    for layer, (a, b, old) in enumerate(zip(fixed.keys, eager.keys, before, strict=True)):
        for r in rows:
            span = slice(r.start, r.start + r.cached + 1)
            assert (a[:, span] - b[:, span]).abs().max().item() <= 1e-5, layer
        untouched = [i for i in range(fixed.budget_tokens) if i not in written]
        bits = a[:, untouched].view(torch.int32), old[:, untouched].view(torch.int32)  # unwritten memory: NaN too
        assert torch.equal(*bits), layer  # position 0 (the padding rows' target) too


def test_static_steps_and_packed_prefills_give_the_eager_engine_tokens(make_engine: Any) -> None:
    """Five seeded requests at once, then five more whose prompts extend the first answers (their
    prefills reuse cached prefixes): same tokens, logprobs to 1e-4, against the eager engine with
    unbatched decode steps."""
    fixed: TorchEngine = make_engine(graphs="static")
    eager: TorchEngine = make_engine(graphs="off", batch_decode=False)
    assert fixed.static is not None and eager.static is None

    async def wave(eng: TorchEngine, prompts: list[list[int]], tokens: int) -> list[list[tuple[int, float]]]:
        async def one(i: int) -> list[tuple[int, float]]:
            stream = await eng.sample(prompts[i], SamplingParams(max_tokens=tokens, temperature=1.0, seed=i))
            return [(t.token_id, t.logprob) async for t in stream]
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

    async def both(eng: TorchEngine) -> list[list[tuple[int, float]]]:
        first = [[7 + i, 40, 3 * i + 1, *range(50, 50 + 4 * i)] for i in range(5)]
        out = await wave(eng, first, 12)
        second = [p + [t for t, _ in o] + [9, 9] for p, o in zip(first, out, strict=True)]
        return out + await wave(eng, second, 6)

    got, want = asyncio.run(both(fixed)), asyncio.run(both(eager))
    compared = 0
    for g, w in zip(got, want, strict=True):
        for (tg, lg), (tw, lw) in zip(g, w, strict=True):
            if tg != tw:  # a draw within float distance of a boundary: the rest may differ
                break
            assert abs(lg - lw) <= 1e-4
            compared += 1
    assert compared >= 0.9 * sum(len(w) for w in want)
    assert fixed.static.eager_runs > 0 and fixed.packed_prefills >= 2
    assert fixed.pool.stats().prefix_hits >= 5  # the second wave reused the first's keys


def test_a_prompt_prefilled_in_a_pack_repeats_bit_identically(make_engine: Any) -> None:
    eng: TorchEngine = make_engine(graphs="static")
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = [[11, 12, 13, 14], [200, 201], [5, 6, 7, 8, 9, 10, 11]]

    async def first_logprob(prompt: list[int]) -> float:
        stream = await eng.sample(prompt, greedy)
        return [t.logprob async for t in stream][0]  # noqa: RUF015 - the one token

    async def go() -> tuple[list[float], float]:
        packed = list(await asyncio.gather(*(first_logprob(p) for p in prompts)))
        return packed, await first_logprob(prompts[2])

    packed, again = asyncio.run(go())
    assert eng.packed_prefills == 1
    assert again == packed[2]  # served from the kept end: no forward, the same computation


def test_a_fixed_shape_step_that_raises_falls_back_to_eager_steps(make_engine: Any, monkeypatch: Any) -> None:
    """A fixed-shape step that breaks (a model or torch it does not fit) never fails a request:
    that step and every later one run eagerly, with the eager engine's tokens."""
    fixed: TorchEngine = make_engine(graphs="static")
    eager: TorchEngine = make_engine(graphs="off")
    assert fixed.static is not None

    def broken(*_: Any) -> Any:
        raise RuntimeError("this model cannot run fixed shapes")

    monkeypatch.setattr(fixed.static, "_run", broken)
    params = SamplingParams(max_tokens=6, temperature=0.0)

    async def go(eng: TorchEngine) -> list[list[tuple[int, float]]]:
        async def one(p: list[int]) -> list[tuple[int, float]]:
            stream = await eng.sample(p, params)
            return [(t.token_id, t.logprob) async for t in stream]
        return list(await asyncio.gather(one([1, 2, 3]), one([4, 5, 6, 7])))

    got, want = asyncio.run(go(fixed)), asyncio.run(go(eager))
    assert [[t for t, _ in g] for g in got] == [[t for t, _ in w] for w in want]
    assert all(abs(a - b) <= 1e-4 for g, w in zip(got, want, strict=True) for (_, a), (_, b) in zip(g, w, strict=True))
    assert fixed.static.broken is not None and "cannot run fixed shapes" in fixed.static.broken
