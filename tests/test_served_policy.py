"""What the trainer learns is what the engine serves: sign of one step, and exact logprobs.

Issue 15 ("LoRA must learn"): a LoRA run learned nothing through `clawbridge up` while full fine
-tuning did. These tests pin down the path between the trainer and the served weights (export,
LoRA merge, engine swap, the sampler's logprobs), for full fine-tuning and LoRA:

- one step with advantage +1 on tokens the engine sampled (temperature 1) raises their logprob
  under the SERVED model after publish, and advantage -1 lowers it;
- after publish, the served logprobs of a fixed sequence equal the trainer's own forward pass to
  1e-4 (world size 1: the in-process trainer's model; world size 2: a torchrun/gloo FSDP2 group,
  compared with the in-process trainer trained on the same batch from the same init).

Served logprobs are read through the engine (teacher forcing: one 1-token call per position with
the whole distribution as top_logprobs), never from the engine's module directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("clawbridge_local")

from clawbridge_local.backend import LocalBackend  # noqa: E402
from clawbridge_local.engine import TorchEngine  # noqa: E402

from clawbridge.backend import Datum, LossConfig  # noqa: E402
from clawbridge.config import Settings  # noqa: E402
from clawbridge.serving.sampler import SamplingParams  # noqa: E402

PROMPTS: tuple[tuple[int, ...], ...] = ((1, 2, 3, 4, 5), (10, 20, 30), (100, 200, 300, 400))
COMPLETION = 6
MODES = {"full": 0, "lora": 8}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def settings(model_dir: Path, state_dir: Path, lora_rank: int, world_size: int = 1) -> Settings:
    """fp32 CPU engine with fp32 keys and values (the sampler equals the trainer to 1e-4 only then: a
    bfloat16 KV cache moves logprobs by ~1e-3, docs/engine-memory.md); the default learning rate of
    the mode (full or LoRA) and its defaults."""
    return Settings(
        model=str(model_dir), state_dir=state_dir, lora_rank=lora_rank,
        backends={"local": {"device": "cpu", "dtype": "float32", "kv_dtype": "float32", "max_running_requests": 2,
                            "train_world_size": world_size}},
    )


async def sampled(engine: TorchEngine) -> list[tuple[list[int], list[float]]]:
    """Temperature-1 samples (seeded), as a user's request would get them."""
    out = []
    for k, prompt in enumerate(PROMPTS):
        stream = await engine.sample(prompt, SamplingParams(max_tokens=COMPLETION, temperature=1.0, seed=k))
        toks = [t async for t in stream]
        out.append(([t.token_id for t in toks], [t.logprob for t in toks]))
    return out


async def served_logprobs(engine: TorchEngine, prompt: Sequence[int], ids: Sequence[int]) -> list[float]:
    """Teacher-forced logprobs of `ids` after `prompt`, as the engine serves them now."""
    out: list[float] = []
    for i, tok in enumerate(ids):
        params = SamplingParams(max_tokens=1, temperature=1.0, top_logprobs=engine.vocab_size, seed=0)
        stream = await engine.sample([*prompt, *ids[:i]], params)
        (only,) = [t async for t in stream]
        out.append(dict(only.top_logprobs)[tok])
    return out


def trainer_logprobs(backend: LocalBackend, prompt: Sequence[int], ids: Sequence[int]) -> list[float]:
    """The in-process trainer's own forward pass (its live, possibly peft-wrapped, model)."""
    trainer = backend._trainer
    assert trainer is not None and trainer.client.core is not None, "expected the in-process trainer"
    model: Any = trainer.client.core.model
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[*prompt, *ids]])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(ids)]


def batch(samples: Sequence[tuple[list[int], list[float]]], advantage: float) -> list[Datum]:
    return [
        Datum.from_turn(p, ids, lps, [advantage] * len(ids), policy_version=0, turn_id=f"t{i}")
        for i, (p, (ids, lps)) in enumerate(zip(PROMPTS, samples, strict=True))
    ]


@pytest.mark.parametrize("advantage", [1.0, -1.0], ids=["positive", "negative"])
@pytest.mark.parametrize("mode", list(MODES))
def test_one_step_moves_served_logprobs_with_the_advantage(
    tiny_model_dir: Path, tmp_path: Path, mode: str, advantage: float
) -> None:
    backend = LocalBackend(settings(tiny_model_dir, tmp_path, MODES[mode]), progress=False)

    async def scenario() -> None:
        await backend.start()
        try:
            engine = backend.sampler()
            samples = await sampled(engine)
            result = await backend.train_step(batch(samples, advantage), LossConfig("importance_sampling"))
            assert result.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # sampler == trainer
            assert await backend.publish() == 1
            for prompt, (ids, before) in zip(PROMPTS, samples, strict=True):
                after = await served_logprobs(engine, prompt, ids)
                change = sum(after) - sum(before)
                # Each sequence's own tokens move the way its advantage says, by a visible amount.
                assert change * advantage > 0.05, (mode, advantage, before, after)
                assert after == pytest.approx(trainer_logprobs(backend, prompt, ids), abs=1e-4)
        finally:
            await backend.close()

    asyncio.run(scenario())


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_fsdp_two_ranks_serve_what_one_trainer_computes(tiny_model_dir: Path, tmp_path: Path, mode: str) -> None:
    """World size 2 (torchrun, gloo, FSDP2) vs the in-process trainer after the same step."""
    two = LocalBackend(settings(tiny_model_dir, tmp_path / "two", MODES[mode], world_size=2), progress=False)
    one = LocalBackend(settings(tiny_model_dir, tmp_path / "one", MODES[mode]), progress=False)

    async def scenario() -> None:
        await two.start()
        await one.start()
        try:
            samples = await sampled(two.sampler())
            data = batch(samples, 1.0)
            await two.train_step(data, LossConfig("importance_sampling"))
            await one.train_step(data, LossConfig("importance_sampling"))
            assert await two.publish() == 1
            moved = 0.0
            for prompt, (ids, before) in zip(PROMPTS, samples, strict=True):
                served = await served_logprobs(two.sampler(), prompt, ids)
                assert served == pytest.approx(trainer_logprobs(one, prompt, ids), abs=1e-4)
                moved = max(moved, max(abs(a - b) for a, b in zip(served, before, strict=True)))
            assert moved > 1e-3, "the step must change what is served for the comparison to mean anything"
        finally:
            await two.close()
            await one.close()

    asyncio.run(scenario())


def test_lm_head_lora_of_a_tied_embedding_model_changes_only_the_output_layer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A model with tied embeddings has no `lm_head.weight` of its own: the merge starts from the
    input embedding, and the engine unties before loading, so the input embedding keeps its values."""
    import json

    from clawbridge_local.engine import untie_output_embeddings
    from clawbridge_local.training import merge_lora
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    cfg.tie_word_embeddings = True
    model: Any = AutoModelForCausalLM.from_config(cfg)
    embed = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embed
    vocab, hidden = embed.shape
    a, b = torch.randn(4, hidden), torch.randn(vocab, 4)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file({"base_model.model.lm_head.lora_A.weight": a, "base_model.model.lm_head.lora_B.weight": b},
              str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 6.0}))
    base = {"model.embed_tokens.weight": embed.detach().clone()}  # what a tied checkpoint holds
    merged = merge_lora(adapter, base)
    want = base["model.embed_tokens.weight"] + 1.5 * (b @ a)
    torch.testing.assert_close(merged["lm_head.weight"], want)

    assert untie_output_embeddings(model) and not untie_output_embeddings(model)
    model.load_state_dict(merged, strict=False)
    torch.testing.assert_close(model.get_output_embeddings().weight.detach(), want)
    torch.testing.assert_close(model.get_input_embeddings().weight.detach(), base["model.embed_tokens.weight"])
