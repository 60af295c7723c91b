"""LoRA served unmerged by the torch engine (`clawbridge_local.lora_serving`): a publish adds an
adapter beside the base weights instead of copying and merging the model, versions kept beside
the published one are adapters too, and the in-process trainer shares the engine's base tensors.

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
from clawbridge_local.lora_serving import LoraAdapter  # noqa: E402

from clawbridge.serving.sampler import Sampler, SamplingParams  # noqa: E402

PROMPT = [11, 42, 7, 300, 5, 99, 1000, 3]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
SCORED = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")


async def run(sampler: Sampler, params: SamplingParams = GREEDY) -> tuple[list[int], list[float], int]:
    stream = await sampler.sample(PROMPT, params)
    toks = [t async for t in stream]
    return [t.token_id for t in toks], [t.logprob for t in toks], stream.policy_version


def served_name(trained: str) -> str:
    """The served model's name of a parameter of the trained peft model
    (`base_model.model.model.layers.0.mlp.up_proj.base_layer.weight` -> `model.layers.0.mlp.up_proj.weight`)."""
    return trained.removeprefix("base_model.model.").replace(".base_layer.", ".")


def random_adapter(model: Any, seed: int, scale: float = 2.0, rank: int = 4) -> tuple[LoraAdapter, dict[str, Any]]:
    """An adapter on TARGETS of every layer (peft-named tensors, as a checkpoint holds them), and
    the merged weights it stands for: W + scale * B @ A."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, Any] = {}
    merged: dict[str, Any] = {}
    for name, mod in model.named_modules():
        if not name.endswith(TARGETS):
            continue
        out_f, in_f = mod.weight.shape
        a = torch.randn(rank, in_f, generator=gen) * 0.05
        b = torch.randn(out_f, rank, generator=gen) * 0.05
        tensors[f"base_model.model.{name}.lora_A.default.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.default.weight"] = b
        merged[f"{name}.weight"] = mod.weight.detach() + scale * (b @ a)
    return LoraAdapter.from_peft(tensors, scale, "test"), merged


def test_an_adapter_publish_serves_the_merged_weights_without_touching_the_base(tiny_model_dir: Path) -> None:
    engine = TorchEngine.load(str(tiny_model_dir), device="cpu", progress=False)
    merged_engine = TorchEngine.load(str(tiny_model_dir), device="cpu", progress=False)
    try:
        model: Any = engine._current.model
        base = {k: (v.data_ptr(), v.detach().clone()) for k, v in model.state_dict().items()}
        adapter, merged = random_adapter(model, seed=1)

        async def go() -> None:
            base_run = await run(engine)
            assert (await engine.swap_weights(adapter, 1)) == 1
            served = await run(engine, SCORED)
            await merged_engine.swap_weights(merged, 1)
            want = await run(merged_engine, SCORED)
            assert served[0] == want[0] and served[2] == 1
            assert max(abs(a - b) for a, b in zip(served[1], want[1], strict=True)) < 1e-4
            assert (await run(engine))[0] != base_run[0], "the adapter must change what is served"
            # The base is shared by every version: the same tensors, unchanged.
            for k, v in model.state_dict().items():
                assert v.data_ptr() == base[k][0] and torch.equal(v, base[k][1]), k
            assert engine._current.model is model
            # A version kept beside it is an adapter over the same base; v0 is the base exactly.
            zero = LoraAdapter(adapter.down, {k: torch.zeros_like(v) for k, v in adapter.up.items()})
            v0 = await engine.load_version(zero, 0)
            assert v0._weights.model is model
            assert (await run(v0)) == base_run
            both = await asyncio.gather(run(v0), run(engine))
            # Together they decode in one forward (summation order: logprobs to 1e-4, as batching).
            assert both[0][0] == base_run[0] and both[1][0] == (await run(engine))[0]
            assert max(abs(a - b) for a, b in zip(both[0][1], base_run[1], strict=True)) < 1e-4
            # Full weights would change the base every adapter is added to: refused, nothing changes.
            with pytest.raises(ValueError, match="serves LoRA adapters"):
                await engine.swap_weights(merged, 2)
            assert engine.policy_version == 1

        asyncio.run(go())
        assert engine.in_flight == 0
    finally:
        engine.shutdown()
        merged_engine.shutdown()


def test_rows_of_different_adapters_decode_in_one_forward_each_with_its_own(tiny_model_dir: Path) -> None:
    """The base (no adapter), a kept adapter (v1) and another on fewer modules (v2), one request
    each, run at once: their decode steps share forwards, and each request gets the tokens and
    logprobs (to 1e-4) it gets when it runs alone: no row sees another row's adapter."""
    engine = TorchEngine.load(str(tiny_model_dir), device="cpu", progress=False)
    try:
        model: Any = engine._current.model
        one, _ = random_adapter(model, seed=1)
        two, _ = random_adapter(model, seed=2, scale=4.0)
        fewer = ("mlp.down_proj", "self_attn.v_proj")
        two = LoraAdapter({k: v for k, v in two.down.items() if k.endswith(fewer)},
                          {k: v for k, v in two.up.items() if k.endswith(fewer)})

        async def go() -> None:
            samplers: list[Sampler] = [engine, await engine.load_version(one, 1), await engine.load_version(two, 2)]
            alone = [await run(s, SCORED) for s in samplers]
            assert len({tuple(a[0]) for a in alone}) == 3, "three versions that answer alike prove nothing"
            for _ in range(2):  # the second time, after the engine went idle and forgot the mix
                before = engine.batched_steps
                together = await asyncio.gather(*(run(s, SCORED) for s in samplers))
                assert engine.batched_steps > before, "one request per version: only a mixed forward is batched"
                for (ids, lps, v), (want_ids, want_lps, want_v) in zip(together, alone, strict=True):
                    assert ids == want_ids and v == want_v
                    assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < 1e-4

        asyncio.run(go())
    finally:
        engine.shutdown()


def test_a_loaded_adapter_is_one_buffer_and_is_freed_once_dropped(tiny_model_dir: Path) -> None:
    """Issue 32 §2: an adapter's matrices live in one buffer (one mapping, given back whole, where
    hundreds of small blocks fragmented the heap as users' adapters came and went), and an
    adapter that served a mixed forward is freed once its sampler is dropped and the engine is
    idle (the last forward's rows and the mix's concatenation kept it alive until the next mix)."""
    import gc
    import time
    import weakref

    engine = TorchEngine.load(str(tiny_model_dir), device="cpu", progress=False)
    try:
        model: Any = engine._current.model

        async def go() -> weakref.ref[LoraAdapter]:  # holds the adapters: nothing outside it does
            one, _ = random_adapter(model, seed=1)
            two, _ = random_adapter(model, seed=2, scale=4.0)
            first, second = await engine.load_version(one, 1), await engine.load_version(two, 2)
            placed = second._weights.adapter
            assert placed is not None
            tensors = [*placed.down.values(), *placed.up.values()]
            assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1, "one buffer per adapter"
            alone = await run(second, SCORED)
            ids = await asyncio.gather(run(first, SCORED), run(second, SCORED))  # a mixed forward
            (got_ids, got_lps, _), (want_ids, want_lps, _) = ids[1], alone
            assert got_ids == want_ids and max(abs(a - b) for a, b in zip(got_lps, want_lps, strict=True)) < 1e-4
            return weakref.ref(placed)

        placed = asyncio.run(go())
        deadline = time.monotonic() + 30
        while placed() is not None and time.monotonic() < deadline:  # until the worker has gone idle
            gc.collect()
            time.sleep(0.05)
        assert placed() is None, "a dropped adapter stayed alive after its streams ended"
    finally:
        engine.shutdown()


def test_an_adapter_read_from_its_file_one_tensor_at_a_time_is_the_same(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`LoraAdapter.from_safetensors` (how a user's version is loaded from its checkpoint) gives what
    `from_peft` of the whole file gives, bf16 tensors included, in one buffer."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    adapter, _ = random_adapter(model, seed=5)
    gen = torch.Generator().manual_seed(5)
    tensors: dict[str, Any] = {"base_model.model.model.norm.weight": torch.ones(4)}  # not LoRA: skipped
    for name, mod in model.named_modules():
        if name.endswith(TARGETS):
            out_f, in_f = mod.weight.shape
            tensors[f"base_model.model.{name}.lora_A.default.weight"] = torch.randn(4, in_f, generator=gen)
            tensors[f"base_model.model.{name}.lora_B.default.weight"] = torch.randn(out_f, 4, generator=gen).bfloat16()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    whole = LoraAdapter.from_peft(load_file(str(tmp_path / "model.safetensors")), 2.0, "whole")
    streamed = LoraAdapter.from_safetensors(tmp_path / "model.safetensors", 2.0, "streamed")
    assert set(streamed.down) == set(whole.down) == set(adapter.down)
    for name in whole.down:
        assert torch.equal(streamed.down[name], whole.down[name]) and torch.equal(streamed.up[name], whole.up[name])
        assert streamed.up[name].dtype == torch.float32
    assert len({t.untyped_storage().data_ptr() for t in (*streamed.down.values(), *streamed.up.values())}) == 1
    assert streamed.placed(model) is streamed, "already one buffer of the model's dtype: placed as it is"


def test_a_bad_adapter_is_refused_before_anything_changes(tiny_model_dir: Path) -> None:
    engine = TorchEngine.load(str(tiny_model_dir), device="cpu", progress=False)
    try:
        model: Any = engine._current.model
        adapter, _ = random_adapter(model, seed=2)
        name = next(iter(adapter.down))

        async def go() -> None:
            before = await run(engine)
            unknown = LoraAdapter({"model.nope": adapter.down[name]}, {"model.nope": adapter.up[name]})
            with pytest.raises(ValueError, match="not a linear layer"):
                await engine.swap_weights(unknown, 1)
            wrong = LoraAdapter({name: adapter.down[name][:-1]}, {name: adapter.up[name]})
            with pytest.raises(ValueError, match="do not fit"):
                await engine.swap_weights(wrong, 1)
            with pytest.raises(ValueError, match="no LoRA weights"):
                LoraAdapter.from_peft({"model.norm.weight": torch.ones(3)}, 1.0, "empty")
            assert engine.policy_version == 0 and (await run(engine)) == before

        asyncio.run(go())
    finally:
        engine.shutdown()


def test_the_in_process_lora_trainer_shares_the_engines_base(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Through the local backend: after a step, every frozen parameter of the trainer's peft model
    is the engine's tensor (one copy of the base), the publish serves the trainer's logprobs, and
    the engine refuses full weights from then on."""
    from clawbridge_local.backend import LocalBackend

    from clawbridge.backend import Datum, LossConfig
    from clawbridge.config import Settings

    settings = Settings.model_validate({"model": str(tiny_model_dir), "state_dir": str(tmp_path), "lora_rank": 4,
                                        "learning_rate": 0.05,
                                        "backends": {"local": {"engine": "torch", "device": "cpu"}}})
    backend = LocalBackend(settings, progress=False)

    async def go() -> None:
        await backend.start()
        try:
            engine: Any = backend.sampler()
            ids, lps, _ = await run(engine, SCORED)
            datum = Datum.from_turn(PROMPT, ids, lps, [1.0] * len(ids), policy_version=0, turn_id="t0")
            await backend.train_step([datum], LossConfig("importance_sampling"))
            served = {k: v.data_ptr() for k, v in engine._current.model.named_parameters(remove_duplicate=False)}
            trainer: Any = backend._training().client.core.model
            frozen = [(n, p) for n, p in trainer.named_parameters() if not p.requires_grad]
            assert frozen and all(p.data_ptr() == served[served_name(n)] for n, p in frozen)
            assert await backend.publish() == 1
            _, after_lps, v = await run(engine, SCORED)
            assert v == 1 and after_lps != lps
            with pytest.raises(ValueError, match="serves LoRA adapters"):
                await engine.swap_weights({}, 2)
        finally:
            await backend.close()

    asyncio.run(go())


def test_the_trainer_loads_its_own_base_where_the_served_one_is_not_the_base(tiny_model_dir: Path) -> None:
    """An engine that published full weights lends nothing; a served model that is not fp32 is not
    shared (the trainer's master weights are fp32): in both cases the trainer loads its own copy."""
    from clawbridge_local.trainer.config import LoraSettings, TrainerConfig
    from clawbridge_local.trainer.model import build_model

    engine = TorchEngine.load(str(tiny_model_dir), device="cpu", progress=False)
    try:
        model: Any = engine._current.model
        _, merged = random_adapter(model, seed=3)
        asyncio.run(engine.swap_weights(merged, 1))
        assert engine.lend_base() is None
        assert (asyncio.run(engine.swap_weights(merged, 2))) == 2, "lending nothing leaves full weights allowed"
    finally:
        engine.shutdown()
    config = TrainerConfig(model_path=str(tiny_model_dir), lora=LoraSettings(rank=4, target_modules=("q_proj",)))
    half = TorchEngine.load(str(tiny_model_dir), device="cpu", dtype="bfloat16", progress=False)
    try:
        base = half.lend_base()
        assert base is not None
        trained = build_model(config, torch.device("cpu"), base)
        served = {p.data_ptr() for p in base.parameters()}
        frozen = [p for p in trained.parameters() if not p.requires_grad]
        assert frozen and all(p.dtype == torch.float32 and p.data_ptr() not in served for p in frozen)
    finally:
        half.shutdown()
