"""TorchEngine (backends/local): token-exact sampling, concurrency, overload, cancellation, swaps.

Runs on CPU with the tiny Qwen3 model from `clawbridge.devtools.tinymodel`; each test starts its own engine
(a worker thread) and shuts it down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("clawbridge_local")

from clawbridge_local.engine import TorchEngine, TorchSampleStream  # noqa: E402

from clawbridge.devtools.tinymodel import build_tiny_model  # noqa: E402
from clawbridge.serving.sampler import (  # noqa: E402
    PromptTooLong,
    SampledToken,
    Sampler,
    SamplerOverloaded,
    SamplerUnavailable,
    SampleStream,
    SamplingParams,
)

T = TypeVar("T")
PROMPT = [11, 42, 7, 300, 5, 99, 1000, 3]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_engine"))


@pytest.fixture
def engine(model_dir: Path) -> Iterator[TorchEngine]:
    eng = TorchEngine.load(str(model_dir), device="cpu", max_running=8, max_queued=8, progress=False)
    yield eng
    eng.shutdown()


@pytest.fixture
def make_engine(model_dir: Path) -> Iterator[Any]:
    made: list[TorchEngine] = []

    def make(**kw: Any) -> TorchEngine:
        eng = TorchEngine.load(str(model_dir), device="cpu", progress=False, **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.shutdown()


async def collect(
    eng: TorchEngine, prompt: list[int], params: SamplingParams
) -> tuple[list[SampledToken], str]:
    stream = await eng.sample(prompt, params)
    toks = [t async for t in stream]
    assert stream.finish_reason is not None
    return toks, stream.finish_reason


def full_forward_logprobs(eng: TorchEngine, ids: list[int], temperature: float) -> Any:
    """log_softmax over the whole sequence in one forward pass, no KV cache (float32)."""
    model = eng._current.model
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)


# ------------------------------------------------------------------------------ token exactness


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0.7, seed=3, top_logprobs=3),
        SamplingParams(max_tokens=24, temperature=1.3, top_p=0.9, top_k=50, seed=4),
        SamplingParams(max_tokens=24, temperature=0.0, top_logprobs=2),
    ],
    ids=["t0.7", "t1.3-topk-topp", "greedy"],
)
def test_logprobs_match_full_forward(engine: TorchEngine, params: SamplingParams) -> None:
    toks, reason = run(collect(engine, PROMPT, params))
    assert reason == "length" and len(toks) == 24
    ids = PROMPT + [t.token_id for t in toks]
    ref = full_forward_logprobs(engine, ids, params.temperature)
    for i, tok in enumerate(toks):
        pos = len(PROMPT) - 1 + i
        assert tok.logprob == pytest.approx(ref[pos, tok.token_id].item(), abs=1e-4)
        if params.temperature == 0:
            assert tok.token_id == int(torch.argmax(ref[pos]))
        if params.top_logprobs:
            vals, best = torch.topk(ref[pos], params.top_logprobs)
            assert [t for t, _ in tok.top_logprobs] == best.tolist()
            assert [lp for _, lp in tok.top_logprobs] == pytest.approx(vals.tolist(), abs=1e-4)
        else:
            assert tok.top_logprobs == ()


def test_greedy_is_deterministic_and_top_k_1_equals_greedy(engine: TorchEngine) -> None:
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    a, _ = run(collect(engine, PROMPT, greedy))
    b, _ = run(collect(engine, PROMPT, greedy))
    assert [t.token_id for t in a] == [t.token_id for t in b]
    k1, _ = run(collect(engine, PROMPT, SamplingParams(max_tokens=16, temperature=1.0, top_k=1, seed=9)))
    assert [t.token_id for t in k1] == [t.token_id for t in a]


def test_seed_determinism_alone_and_under_concurrency(make_engine: Any) -> None:
    """Unbatched decoding (`batch_decode=False`): a seeded request's tokens do not depend on its
    neighbours at all. (Batched: see test_batched_decoding_matches_the_full_forward.)"""
    engine = make_engine(max_running=8, max_queued=8, batch_decode=False)
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234)

    async def with_neighbours() -> list[int]:
        others = [
            collect(engine, [i + 1, 2, 3], SamplingParams(max_tokens=30, temperature=1.0, seed=None))
            for i in range(7)
        ]
        results = await asyncio.gather(collect(engine, PROMPT, params), *others)
        return [t.token_id for t in results[0][0]]

    alone = [t.token_id for t in run(collect(engine, PROMPT, params))[0]]
    assert run(with_neighbours()) == alone
    other_seed = [t.token_id for t in run(collect(engine, PROMPT, SamplingParams(20, seed=4321)))[0]]
    assert other_seed != alone


def test_batched_decoding_matches_the_full_forward(engine: TorchEngine) -> None:
    """Eight concurrent requests of different prompt lengths decode as batches (left-padded
    caches): every token's logprob still equals a full forward pass of its own sequence, alone."""
    assert engine.batch_decode
    prompts = [[i + 1, *PROMPT[: 3 + i]] for i in range(8)]
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=50 + i, top_logprobs=2) for i in range(8)]

    async def go() -> list[tuple[list[SampledToken], str]]:
        return list(await asyncio.gather(*(collect(engine, p, q) for p, q in zip(prompts, params, strict=True))))

    batched_steps_before = engine.batched_steps
    results = run(go())
    assert engine.batched_steps > batched_steps_before  # the batched path really ran
    for prompt, q, (toks, _) in zip(prompts, params, results, strict=True):
        ref = full_forward_logprobs(engine, prompt + [t.token_id for t in toks], q.temperature)
        for i, tok in enumerate(toks):
            assert tok.logprob == pytest.approx(ref[len(prompt) - 1 + i, tok.token_id].item(), abs=1e-4)
            vals, _ = torch.topk(ref[len(prompt) - 1 + i], 2)
            assert [lp for _, lp in tok.top_logprobs] == pytest.approx(vals.tolist(), abs=1e-4)


# ------------------------------------------------------------------------------ finish reasons


def test_stop_token_is_yielded_last_with_finish_stop(engine: TorchEngine) -> None:
    greedy, _ = run(collect(engine, PROMPT, SamplingParams(max_tokens=16, temperature=0.0)))
    ids = [t.token_id for t in greedy]
    cut = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    stop = ids[cut]
    params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(stop, 999_999))
    toks, reason = run(collect(engine, PROMPT, params))
    assert reason == "stop"
    assert [t.token_id for t in toks] == ids[: cut + 1]


def test_max_tokens_gives_length(engine: TorchEngine) -> None:
    toks, reason = run(collect(engine, PROMPT, SamplingParams(max_tokens=7, seed=1)))
    assert (len(toks), reason) == (7, "length")


def test_prompt_too_long_and_clamp() -> None:
    cfg = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, intermediate_size=128, max_position_embeddings=24, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    eng = TorchEngine(transformers.Qwen3ForCausalLM(cfg), max_running=2, max_queued=0)
    try:
        assert eng.context_window == 24
        with pytest.raises(PromptTooLong):
            run(eng.sample(list(range(24)), SamplingParams(max_tokens=1)))
        toks, reason = run(collect(eng, list(range(20)), SamplingParams(max_tokens=100, seed=0)))
        assert (len(toks), reason) == (4, "length")
        toks, reason = run(collect(eng, list(range(23)), SamplingParams(max_tokens=100, seed=0)))
        assert (len(toks), reason) == (1, "length")
        with pytest.raises(ValueError):
            run(eng.sample([1, 512], SamplingParams(max_tokens=1)))
        assert eng.in_flight == 0
    finally:
        eng.shutdown()


# ------------------------------------------------------------------------------ concurrency


def test_protocols(engine: TorchEngine) -> None:
    async def go() -> None:
        stream = await engine.sample(PROMPT, SamplingParams(max_tokens=2))
        assert isinstance(stream, SampleStream) and isinstance(stream, TorchSampleStream)
        await stream.aclose()

    assert isinstance(engine, Sampler)
    run(go())


def test_eight_concurrent_requests_interleave(engine: TorchEngine) -> None:
    async def timed(i: int) -> list[float]:
        stream = await engine.sample([i + 1, *PROMPT], SamplingParams(max_tokens=30, seed=i))
        return [time.perf_counter() async for _ in stream]

    async def go() -> list[list[float]]:
        return await asyncio.gather(*(timed(i) for i in range(8)))

    stamps = run(go())
    assert all(len(s) == 30 for s in stamps)
    # Every request got its first token before any request got its last one.
    assert max(s[0] for s in stamps) < min(s[-1] for s in stamps)
    assert engine.in_flight == 0


def test_overload_and_aclose_frees_the_slot(make_engine: Any) -> None:
    eng: TorchEngine = make_engine(max_running=1, max_queued=1)

    async def go() -> None:
        long = SamplingParams(max_tokens=100_000, seed=0)
        first = await eng.sample(PROMPT, long)
        it = first.__aiter__()
        await it.__anext__()
        second = await eng.sample(PROMPT, SamplingParams(max_tokens=5, seed=1))
        with pytest.raises(SamplerOverloaded) as exc:
            await eng.sample(PROMPT, SamplingParams(max_tokens=5))
        assert exc.value.retry_after_s > 0
        await first.aclose()
        at_cancel = first._req.generated
        await first.aclose()  # idempotent
        assert first.finish_reason == "cancelled"
        assert [t async for t in it] == []
        # The queued request can only run if the worker dropped the cancelled one (max_running=1) ...
        toks = [t async for t in second]
        assert (len(toks), second.finish_reason) == (5, "length")
        # ... which took at most the step already running when it was cancelled (the engine's invariant),
        generated = first._req.generated
        assert at_cancel <= generated <= at_cancel + 1 < 100
        third_toks, reason = await asyncio.wait_for(collect(eng, PROMPT, SamplingParams(max_tokens=3)), 30)
        assert (len(third_toks), reason) == (3, "length")
        assert first._req.generated == generated  # and no further tokens, whatever the worker ran since

    run(go())
    assert eng.in_flight == 0


def test_cancelling_the_consumer_task_stops_generation(make_engine: Any) -> None:
    eng: TorchEngine = make_engine(max_running=1, max_queued=0)

    async def go() -> None:
        stream = await eng.sample(PROMPT, SamplingParams(max_tokens=100_000, seed=0))
        got = asyncio.Event()

        async def consume() -> None:
            async for _ in stream:
                got.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert stream.finish_reason == "cancelled"
        assert eng.in_flight == 0
        at_cancel = stream._req.generated
        toks, reason = await asyncio.wait_for(collect(eng, PROMPT, SamplingParams(max_tokens=3)), 30)
        assert (len(toks), reason) == (3, "length")
        # That request ran only after the worker dropped the cancelled one (max_running=1), which took
        # at most the step already running when it was cancelled (the engine's invariant) ...
        generated = stream._req.generated
        assert at_cancel <= generated <= at_cancel + 1
        toks, _ = await asyncio.wait_for(collect(eng, PROMPT, SamplingParams(max_tokens=3)), 30)
        assert stream._req.generated == generated  # ... and never again, whatever the worker runs since

    run(go())


# ------------------------------------------------------------------------------ weights, shutdown


def test_swap_weights_new_streams_only(engine: TorchEngine) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    before = [t.token_id for t in run(collect(engine, PROMPT, greedy))[0]]
    model: Any = engine._current.model
    lm_head = model.get_output_embeddings().weight
    torch.manual_seed(1)
    new_head = torch.randn_like(lm_head)

    async def go() -> tuple[list[int], list[int], int]:
        old = await engine.sample(PROMPT, greedy)
        it = old.__aiter__()
        first = (await it.__anext__()).token_id
        assert await engine.swap_weights({"lm_head.weight": new_head}, 1) == 1
        assert engine.policy_version == 1
        new_toks, _ = await collect(engine, PROMPT, greedy)
        old_rest = [t.token_id async for t in it]
        with pytest.raises(ValueError):
            await engine.swap_weights({"lm_head.weight": new_head}, 1)
        with pytest.raises(ValueError):
            await engine.swap_weights({"nope.weight": new_head}, 2)
        assert engine.policy_version == 1
        return [first, *old_rest], [t.token_id for t in new_toks], old.policy_version

    old_ids, new_ids, old_version = run(go())
    assert old_version == 0 and old_ids == before  # the old stream finished on its own weights
    assert new_ids != before
    # Idle swap (in place): back to the original head as version 2.
    run(engine.swap_weights({"lm_head.weight": lm_head.detach().clone()}, 2))
    again, _ = run(collect(engine, PROMPT, greedy))
    assert [t.token_id for t in again] == before
    assert run(engine.sample(PROMPT, SamplingParams(max_tokens=1))).policy_version == 2


def test_shutdown_ends_streams_and_refuses_new_ones(make_engine: Any) -> None:
    eng: TorchEngine = make_engine(max_running=1, max_queued=1)

    async def go() -> None:
        running = await eng.sample(PROMPT, SamplingParams(max_tokens=100_000))
        it = running.__aiter__()
        await it.__anext__()
        await asyncio.to_thread(eng.shutdown)
        with pytest.raises(SamplerUnavailable):
            async for _ in it:
                pass
        with pytest.raises(SamplerUnavailable):
            await eng.sample(PROMPT, SamplingParams(max_tokens=1))

    run(go())
    assert not eng._worker.is_alive()


def test_score_equals_the_sampled_logprobs(engine: TorchEngine) -> None:
    """`SequenceScorer.score`: the untempered logprobs of given tokens, the numbers sampling at
    temperature 1 reported for them (one forward, no pool region kept)."""
    from clawbridge.serving.sampler import SequenceScorer

    assert isinstance(engine, SequenceScorer)
    toks, _ = run(collect(engine, PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=5)))
    scored = run(engine.score(PROMPT, [t.token_id for t in toks]))
    assert scored == pytest.approx([t.logprob for t in toks], abs=1e-4)
    assert run(engine.score(PROMPT, [])) == []
    with pytest.raises(ValueError):
        run(engine.score(PROMPT, [engine.vocab_size]))
    assert engine.engine_status()["kv_used_tokens"] == 0
