"""TorchEngine's KV budget (`clawbridge_local.kvpool`): admission when the budget is full, prefix
reuse, accounting back to zero, cancel freeing a region, prefixes dropped on publish.

Real torch, the tiny Qwen3 model; references are plain full forwards of transformers (no cache).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("clawbridge_local")

from clawbridge_local.engine import TorchEngine  # noqa: E402
from clawbridge_local.kvpool import KVPool  # noqa: E402

from clawbridge.devtools.tinymodel import build_tiny_model  # noqa: E402
from clawbridge.serving.sampler import PromptTooLong, SamplingParams  # noqa: E402
from tests.test_engine import PROMPT, collect, full_forward_logprobs, run  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_kvpool"))


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


def assert_logprobs_exact(eng: TorchEngine, prompt: list[int], toks: list[Any], temperature: float) -> None:
    ref = full_forward_logprobs(eng, prompt + [t.token_id for t in toks], temperature)
    for i, tok in enumerate(toks):
        assert tok.logprob == pytest.approx(ref[len(prompt) - 1 + i, tok.token_id].item(), abs=1e-4)


def test_full_budget_queues_requests_which_all_complete(make_engine: Any) -> None:
    """A budget of 64 tokens holds two requests of 8 + 20 tokens at once: six concurrent ones wait
    their turn, all complete with exact logprobs, none is refused, and the pool ends empty."""
    eng: TorchEngine = make_engine(max_running=8, max_queued=8, kv_budget_tokens=64)
    prompts = [[i + 1, *PROMPT] for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=7)
    seen_waiting: list[int] = []

    async def go() -> list[Any]:
        streams = [await eng.sample(p, params) for p in prompts]
        out = []
        for s in streams:
            toks = []
            async for t in s:
                toks.append(t)
                seen_waiting.append(eng.engine_status()["waiting"])
            out.append((toks, s.finish_reason))
        return out

    results = run(go())
    assert [r for _, r in results] == ["length"] * 6
    assert eng.waited >= 1 and max(seen_waiting) >= 1  # the budget, not max_running, held them back
    for prompt, (toks, _) in zip(prompts, results, strict=True):
        assert_logprobs_exact(eng, prompt, toks, params.temperature)
    status = eng.engine_status()
    assert (status["kv_used_tokens"], status["running"], status["waiting"]) == (0, 0, 0)
    eng.pool.check()


def test_prompt_longer_than_the_budget_is_prompt_too_long(make_engine: Any) -> None:
    eng: TorchEngine = make_engine(kv_budget_tokens=16)
    assert eng.context_window == 16
    with pytest.raises(PromptTooLong, match="kv_budget_tokens"):
        run(collect(eng, list(range(1, 17)), SamplingParams(max_tokens=1)))
    toks, reason = run(collect(eng, list(range(1, 9)), SamplingParams(max_tokens=100)))
    assert (len(toks), reason) == (8, "length")  # clamped to what the budget holds


def test_prefix_reuse_gives_the_cold_logprobs(make_engine: Any) -> None:
    """A second call that resends the first call's prompt and answer plus a new turn prefills only
    the new tokens, and its logprobs equal a cold full forward's."""
    eng: TorchEngine = make_engine(max_running=2)
    first, _ = run(collect(eng, PROMPT, SamplingParams(max_tokens=10, temperature=0.0)))
    prompt2 = PROMPT + [t.token_id for t in first] + [17, 23, 5]
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=11, top_logprobs=2)
    toks, _ = run(collect(eng, prompt2, params))
    status = eng.engine_status()
    assert status["prefix_hits"] == 1
    assert status["prefix_tokens_reused"] == len(PROMPT) + 9  # the last answer token was never cached
    assert_logprobs_exact(eng, prompt2, toks, params.temperature)
    # The same prompt on an engine with nothing cached samples the same tokens (same seed).
    cold: TorchEngine = make_engine(max_running=2)
    cold_toks, _ = run(collect(cold, prompt2, params))
    assert [t.token_id for t in cold_toks] == [t.token_id for t in toks]
    assert cold.engine_status()["prefix_hits"] == 0


def count_forwards(eng: TorchEngine) -> list[int]:
    """Record the new tokens of every forward `eng` runs from now on (one entry per forward)."""
    seen: list[int] = []
    real = eng.pool.forward

    def counting(model: Any, tokens: list[list[int]], rows: Any) -> Any:
        seen.append(len(tokens[0]))
        return real(model, tokens, rows)

    eng.pool.forward = counting  # type: ignore[method-assign]
    return seen


def exact(toks: list[Any]) -> list[tuple[int, float, Any]]:
    return [(t.token_id, t.logprob, t.top_logprobs) for t in toks]


def test_a_prompt_sent_again_runs_no_prefill_and_gets_bit_identical_logprobs(make_engine: Any) -> None:
    """A cold prefill is one forward over the prompt. The same prompt again (a retry) takes the
    cached keys/values and the prompt's end: decode steps only, the same tokens and logprobs bit
    for bit, which a cold engine also gives."""
    eng: TorchEngine = make_engine(max_running=2)
    assert eng.one_forward_prefill, "the tiny Qwen3's logits are its output layer's alone"
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=5, top_logprobs=2)
    forwards = count_forwards(eng)
    first, _ = run(collect(eng, PROMPT, params))
    assert forwards == [len(PROMPT)] + [1] * (len(first) - 1), "one prefill forward, then decode"
    forwards.clear()
    again, _ = run(collect(eng, PROMPT, params))
    assert exact(again) == exact(first)
    assert forwards == [1] * (len(first) - 1), "decode steps only: the prompt was not run again"
    status = eng.engine_status()
    assert (status["prefix_hits"], status["prefix_tokens_reused"]) == (1, len(PROMPT))
    assert_logprobs_exact(eng, PROMPT, again, params.temperature)
    cold_toks, _ = run(collect(make_engine(max_running=2), PROMPT, params))
    assert exact(cold_toks) == exact(first)


def test_prompt_ends_survive_the_prompts_that_extend_them(make_engine: Any) -> None:
    """Teacher-forced probes (the prompt plus the first i answer tokens) each take the entry the
    one before left, and carry its prompt ends on: after them the prompt alone is still answered
    bit for bit from the cache with no prefill forward, and every probe sent again gets its first
    logprobs bit for bit."""
    eng: TorchEngine = make_engine(max_running=2)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, top_logprobs=1)
    answer, _ = run(collect(eng, PROMPT, greedy))
    probes = [PROMPT + [t.token_id for t in answer[:i]] for i in range(1, 4)]
    one = SamplingParams(max_tokens=1, temperature=0.0, top_logprobs=1)
    firsts = [exact(run(collect(eng, p, one))[0]) for p in probes]
    forwards = count_forwards(eng)
    assert exact(run(collect(eng, PROMPT, greedy))[0]) == exact(answer)
    assert forwards == [1] * (len(answer) - 1), "decode steps only: the prompt's end was kept"
    assert [exact(run(collect(eng, p, one))[0]) for p in probes] == firsts
    for p, f in zip(probes, firsts, strict=True):  # and each is its unbatched, uncached value
        ref = full_forward_logprobs(eng, [*p, f[0][0]], 1.0)[-2, f[0][0]].item()
        assert f[0][1] == pytest.approx(ref, abs=1e-4)
    eng.pool.check()


def test_a_model_whose_logits_are_not_its_output_layers_prefills_in_two_forwards(make_engine: Any) -> None:
    """Where the output layer alone does not give the logits (here it is patched to be scaled
    after it, as soft-capping models do), `ends_are_exact` says so and the engine keeps the split
    prefill: the prompt but its last token, then that token; a retry runs that token again and
    still gets bit-identical logprobs."""
    eng: TorchEngine = make_engine(max_running=2)
    model = eng._current.model
    real_forward = model.forward

    def scaled(*args: Any, **kw: Any) -> Any:
        out = real_forward(*args, **kw)
        out.logits = out.logits * 0.5
        return out

    model.forward = scaled
    assert not KVPool.ends_are_exact(model)
    eng.one_forward_prefill = False
    params = SamplingParams(max_tokens=4, temperature=0.9, seed=3)
    forwards = count_forwards(eng)
    first, _ = run(collect(eng, PROMPT, params))
    assert forwards == [len(PROMPT) - 1, 1] + [1] * (len(first) - 1)
    forwards.clear()
    again, _ = run(collect(eng, PROMPT, params))
    assert exact(again) == exact(first)
    assert forwards == [1] + [1] * (len(first) - 1), "the prompt's last token again, then decode"


def test_a_sliding_window_layer_attends_within_its_window(model_dir: Path, tmp_path: Path) -> None:
    """Layer 1 of the tiny model made a sliding-window layer (window 6): batched decode over the pool
    gives the logprobs of transformers' own full forward, whose mask carries the window, for
    prompts and answers well past the window; and those differ from the same model without it."""
    import json
    import shutil

    windowed = tmp_path / "windowed"
    shutil.copytree(model_dir, windowed)
    cfg = json.loads((windowed / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    (windowed / "config.json").write_text(json.dumps(cfg))
    eng = TorchEngine.load(str(windowed), device="cpu", progress=False, max_running=2)
    plain = TorchEngine.load(str(model_dir), device="cpu", progress=False, max_running=2)
    try:
        assert eng._current.model.config.layer_types == ["full_attention", "sliding_attention"]
        params = SamplingParams(max_tokens=12, temperature=0.8, seed=9)
        prompts = [PROMPT, [7, *PROMPT, 11, 13]]

        async def both() -> list[Any]:
            return list(await asyncio.gather(*(collect(eng, p, params) for p in prompts)))

        results = run(both())
        assert eng.batched_steps > 0
        far = 0.0
        for prompt, (toks, _) in zip(prompts, results, strict=True):
            assert len(prompt) > 6
            assert_logprobs_exact(eng, prompt, toks, params.temperature)
            ref = full_forward_logprobs(plain, prompt + [t.token_id for t in toks], params.temperature)
            far = max(far, *(abs(t.logprob - ref[len(prompt) - 1 + i, t.token_id].item()) for i, t in enumerate(toks)))
        assert far > 1e-3, "the window changed nothing: the test would not see a wrong mask"
    finally:
        eng.shutdown()
        plain.shutdown()


def test_cancel_mid_stream_frees_its_region(make_engine: Any) -> None:
    """With a budget one request fills, a second one runs only once the first is cancelled."""
    eng: TorchEngine = make_engine(max_running=4, kv_budget_tokens=64)

    async def go() -> None:
        first = await eng.sample(PROMPT, SamplingParams(max_tokens=10_000, seed=0))  # clamped: fills the pool
        it = first.__aiter__()
        await it.__anext__()
        assert eng.engine_status()["kv_used_tokens"] == 63
        second = await eng.sample(PROMPT, SamplingParams(max_tokens=10_000, seed=1))
        await first.aclose()
        toks = [t async for t in second]
        assert (len(toks), second.finish_reason) == (64 - len(PROMPT), "length")

    run(asyncio.wait_for(go(), 120))
    assert eng.engine_status()["kv_used_tokens"] == 0
    assert eng.in_flight == 0
    eng.pool.check()


def test_publish_drops_the_old_weights_prefixes(make_engine: Any) -> None:
    eng: TorchEngine = make_engine(max_running=2)
    run(collect(eng, PROMPT, SamplingParams(max_tokens=4, temperature=0.0)))
    assert eng.engine_status()["prefix_entries"] == 1

    def bump(model: torch.nn.Module) -> None:
        for p in model.parameters():
            p.add_(0.01)

    run(eng.swap_weights(bump, 1))
    toks, _ = run(collect(eng, [*PROMPT, 3, 4], SamplingParams(max_tokens=4, temperature=0.0)))
    assert eng.engine_status()["prefix_hits"] == 0  # the old entry was dropped, not reused
    assert_logprobs_exact(eng, [*PROMPT, 3, 4], toks, 0.0)


def test_pool_allocator_coalesces_and_evicts_lru() -> None:
    pool = KVPool(n_layers=1, kv_heads=1, head_dim=2, budget_tokens=10, dtype=torch.float32,
                  device=torch.device("cpu"))
    class Weights:
        """Stands for the engine's `_Weights` (entries hold a weak reference to their owner)."""

    owner = Weights()
    a, b = pool.allocate(4), pool.allocate(4)
    assert (a, b) == (0, 4)
    assert pool.allocate(4) is None  # 2 free, no entries to evict
    pool.keep_prefix(owner, [1, 2, 3], a, 4)  # a becomes a 3-token prefix, 1 token freed
    pool.free(b, 4)
    pool.check()
    assert pool.allocate(7) == 3  # fits after the entry without evicting it
    assert pool.stats().prefix_entries == 1
    pool.free(3, 7)
    assert pool.allocate(10) == 0  # needs the whole pool: the entry is evicted
    assert pool.stats().prefix_entries == 0
    pool.free(0, 10)
    pool.check()
    assert pool.free_tokens() == 10


def _pool(budget: int) -> KVPool:
    return KVPool(n_layers=1, kv_heads=1, head_dim=2, budget_tokens=budget, dtype=torch.float32,
                  device=torch.device("cpu"))


class _Owner:
    """Stands for the engine's `_Weights` (entries hold a weak reference to their owner)."""


def test_an_allocation_that_cannot_fit_evicts_nothing() -> None:
    """The room is held by a running request: evicting the cached prefix would not make the
    waiting request fit, so the prefix stays (it used to be evicted, and every waiting turn then
    re-prefilled its whole context exactly when the pool was full)."""
    pool, owner = _pool(10), _Owner()
    running = pool.allocate(6)
    entry = pool.allocate(2)
    assert (running, entry) == (0, 6)
    pool.keep_prefix(owner, [1, 2], entry, 2)
    assert pool.allocate(5) is None  # 2 free + 2 cached < 5
    assert pool.stats().prefix_entries == 1 and pool.cached_tokens == 2
    assert pool.take_prefix(owner, [1, 2, 3]) is not None  # still reusable
    pool.check()


def test_an_allocation_evicts_only_the_entries_that_make_it_fit() -> None:
    """Two entries, the older one walled in by a running request: only the newer one, next to the
    free range, is evicted; the older one stays cached."""
    pool, owner = _pool(10), _Owner()
    old, running, new = pool.allocate(2), pool.allocate(3), pool.allocate(2)
    assert (old, running, new) == (0, 2, 5)
    pool.keep_prefix(owner, [1, 2], old, 2)  # least recently used
    pool.keep_prefix(owner, [3, 4], new, 2)
    assert pool.allocate(5) == 5  # [5, 10): the newer entry and the free tail
    assert pool.take_prefix(owner, [1, 2, 9]) is not None  # the older entry was kept
    assert pool.stats().prefix_entries == 0
    pool.check()


def test_an_allocation_prefers_evicting_the_least_recently_used_entry() -> None:
    """Either entry makes room: the least recently used one goes."""
    pool, owner = _pool(8), _Owner()
    a, running, b = pool.allocate(3), pool.allocate(2), pool.allocate(3)
    pool.keep_prefix(owner, [1, 2, 3], a, 3)
    pool.keep_prefix(owner, [4, 5, 6], b, 3)
    assert pool.allocate(3) == a
    assert pool.take_prefix(owner, [4, 5, 6, 7]) is not None and pool.stats().prefix_entries == 0
    del running


def test_a_waiting_request_keeps_the_cached_prefixes_while_the_budget_is_full(make_engine: Any) -> None:
    """Under saturation (one long request holds most of the budget), a queued request that cannot
    fit leaves the prefix of a finished turn in the pool, so the next turn of that conversation
    reuses it once room frees."""
    eng: TorchEngine = make_engine(max_running=4, max_queued=8, kv_budget_tokens=64)
    turn = [*PROMPT, 5, 6]
    toks, _ = run(collect(eng, turn, SamplingParams(max_tokens=4, temperature=0.0)))
    cached = eng.engine_status()["kv_cached_tokens"]
    assert cached > 0

    async def saturate() -> None:
        hog = await eng.sample([9, 8, 7], SamplingParams(max_tokens=64 - 3 - cached - 2, temperature=1.0, seed=1))
        waiter = await eng.sample([3] * 20, SamplingParams(max_tokens=10, temperature=1.0, seed=2))
        it = hog.__aiter__()
        await it.__anext__()
        for _ in range(100):  # the waiter is at the head of the queue and cannot fit
            if eng.engine_status()["waiting"] == 1 and eng.waited >= 1:
                break
            await asyncio.sleep(0.01)
        assert eng.engine_status()["waiting"] == 1 and eng.waited >= 1
        assert eng.engine_status()["prefix_entries"] == 1  # not evicted for a request it cannot seat
        await hog.aclose()
        await waiter.aclose()

    run(saturate())
    nxt = [*turn, *[t.token_id for t in toks], 7]
    run(collect(eng, nxt, SamplingParams(max_tokens=2, temperature=0.0)))
    assert eng.engine_status()["prefix_hits"] == 1
    eng.pool.check()
