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

from clawbridge.serving.sampler import Sampler, SamplingParams  # noqa: E402

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


def test_a_missing_checkpoint_is_refused_not_a_crash(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A checkpoint deleted outside retention (still `restorable` in the store) cannot be loaded:
    `VersionUnavailable` for that version only, which the router answers as a 404."""
    from clawbridge_local.backend import LocalBackend

    from clawbridge.config import Settings
    from clawbridge.serving.versions import VersionUnavailable

    settings = Settings.model_validate({"model": str(tiny_model_dir), "state_dir": str(tmp_path), "lora_rank": 4,
                                        "backends": {"local": {"engine": "torch", "device": "cpu"}}})
    backend = LocalBackend(settings, progress=False)

    async def go() -> None:
        await backend.start()
        try:
            with pytest.raises(VersionUnavailable, match="cannot be loaded") as err:
                await backend.load_version(3, str(tmp_path / "checkpoints" / "local" / "gone"))
            assert not err.value.only_published
        finally:
            await backend.close()

    asyncio.run(go())


# ------------------------------------------------------------------ through `clawbridge up` (LoRA)

ENV = {
    "CLAWBRIDGE_BASELINE": "none",  # the reward is the advantage: every rewarded turn moves the weights
    "CLAWBRIDGE_MAX_BATCH_TOKENS": "0",  # exactly batch_size per step
    "CLAWBRIDGE_TRAINER_POLL_INTERVAL_S": "0.2",
    "CLAWBRIDGE_LEARNING_RATE": "0.05",
    "CLAWBRIDGE_LORA_RANK": "4",
    "CLAWBRIDGE_KEEP_CHECKPOINTS": "2",  # after step 3 version 1 is pruned (the base, version 0, never is)
}
PROBE = [{"role": "user", "content": "name a colour"}]


def test_a_committed_version_answers_by_name_through_the_proxy(tiny_model_dir: Path, tmp_path: Path) -> None:
    import anthropic
    import openai

    from tests.kill_support import Agent, StoreView, wait_until
    from tests.support import ProxyProcess

    state = tmp_path / "state"
    proxy = ProxyProcess(tiny_model_dir, state, extra_args=("--batch-size", "2", "--method", "rl"),
                         env=ENV).start(timeout_s=300)
    agent = Agent(proxy)
    view = StoreView(state)
    name = tiny_model_dir.name
    an = anthropic.Anthropic(base_url=proxy.base, api_key=proxy.key(), max_retries=0, timeout=120)

    def probe(model: str, session: str) -> openai.types.chat.ChatCompletion:
        return agent.client.chat.completions.create(model=model, messages=PROBE, temperature=0.0,  # type: ignore[arg-type]
                                                    max_tokens=12, extra_headers={"X-Session-Id": session})

    def train_step(sessions: tuple[str, ...], rewards: tuple[float, ...], version: int) -> None:
        for i, (sid, r) in enumerate(zip(sessions, rewards, strict=True)):
            agent.call(sid, seed=i)
            agent.reward(sid, r)
            agent.end(sid)
        wait_until(lambda: agent.health()["policy_version"] == version, f"version {version} served", proxy=proxy)

    try:
        train_step(("a0", "a1"), (1.0, -1.0), 1)
        served_v1 = probe("default", "probe-v1")
        assert served_v1.system_fingerprint == "policy-v1"
        v1 = view.turn(served_v1.id.replace("chatcmpl-", "turn_"))
        v1_anthropic = an.messages.create(model="default", max_tokens=12, extra_body={"temperature": 0.0}, messages=PROBE)  # type: ignore[arg-type]

        train_step(("b0", "b1"), (-1.0, 1.0), 2)
        served_v2 = view.turn(probe("default", "probe-v2").id.replace("chatcmpl-", "turn_"))
        assert served_v2["policy_version"] == 2 and served_v2["logprobs"] != pytest.approx(v1["logprobs"], abs=1e-6)

        # Version 1 by name: the same greedy tokens, with the logprobs it gave when it was serving.
        again = probe(f"{name}@1", "probe-again")
        assert again.model == f"{name}@1" and again.system_fingerprint == "policy-v1"
        turn = view.turn(again.id.replace("chatcmpl-", "turn_"))
        assert turn["policy_version"] == 1  # recorded with the version that answered
        assert turn["completion"] == v1["completion"]
        # Same tokens; logprobs within 2e-3 nats: on an AMD EPYC (AVX-512) the cold prefill again on
        # bit-identical adapter weights came 5.4e-4 apart (under 1e-5 where CI ran before); version 2
        # answers 2.1 nats apart, so the bound still tells the versions apart.
        assert turn["logprobs"] == pytest.approx(v1["logprobs"], abs=2e-3)
        chunks = list(agent.client.chat.completions.create(model="default@1", messages=PROBE, temperature=0.0,  # type: ignore[arg-type]
                                                           max_tokens=12, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == served_v1.choices[0].message.content
        with an.messages.stream(model=f"{name}@1", max_tokens=12, extra_body={"temperature": 0.0}, messages=PROBE) as s:  # type: ignore[arg-type]
            assert s.get_final_text() == v1_anthropic.content[0].text  # type: ignore[union-attr]
        resp = agent.client.responses.create(model=f"{name}@1", input=PROBE, temperature=0.0,  # type: ignore[arg-type]
                                             max_output_tokens=12)
        assert resp.model == f"{name}@1" and resp.output_text == served_v1.choices[0].message.content
        # The published version still answers plain requests.
        assert probe("default", "probe-v2b").system_fingerprint == "policy-v2"

        # The base (version 0) is never pruned: it still answers by name.
        assert probe(f"{name}@0", "probe-base").system_fingerprint == "policy-v0"
        with pytest.raises(anthropic.NotFoundError):
            an.messages.create(model=f"{name}@7", max_tokens=4, messages=PROBE)  # type: ignore[arg-type]
        assert [m.id for m in agent.client.models.list().data] == [name, "default", f"{name}@0", f"{name}@1",
                                                                   f"{name}@2"]

        # A turn answered by version 1 trains like any turn sampled one version ago.
        agent.reward("probe-again", 1.0)
        agent.end("probe-again")
        agent.reward("probe-v2b", -1.0)
        agent.end("probe-v2b")
        wait_until(lambda: len(view.ok_steps()) >= 3, "step 3", proxy=proxy)
        step3 = view.ok_steps()[2]
        assert step3.metrics["datums"] == 2.0 and step3.metrics["staleness_max"] == 1.0, step3.metrics

        # Version 1's checkpoint is pruned now (keep_checkpoints 2: v2, v3, and the base): 404 naming what is kept.
        with pytest.raises(openai.NotFoundError) as err:
            probe(f"{name}@1", "probe-pruned")
        body = err.value.body
        assert isinstance(body, dict) and body["code"] == "model_not_found"
        assert "pruned" in body["message"] and f"{name}@0, {name}@2, {name}@3" in body["message"], body
    finally:
        agent.close()
        an.close()
        proxy.stop()


# ------------------------------------------------------------------ SGLang (LoRA): adapters per version


def test_sglang_serves_committed_lora_versions_as_pinned_adapters(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Against the server that checks sglang 0.5.x shapes: version N's adapter, written from its
    checkpoint, is exactly what the trainer exported for it, loads as `vN`, answers `NAME@N`
    requests beside the published version, and is unloaded when it leaves max_loaded_versions."""
    from clawbridge_local.backend import LocalBackend
    from clawbridge_local.training import load_safetensors_dir

    from clawbridge.backend import Datum, LossConfig
    from clawbridge.config import Settings
    from tests.sglang_server import FakeSGLang
    from tests.support import free_port

    fake = FakeSGLang(tiny_model_dir, port=free_port(), enable_lora=True, max_lora_rank=8,
                      lora_target_modules=("q_proj", "v_proj")).start()
    settings = Settings.model_validate({
        "model": str(tiny_model_dir), "state_dir": str(tmp_path), "lora_rank": 4,
        "lora_target_modules": ["q_proj", "v_proj"], "learning_rate": 0.05,
        "backends": {"local": {"sglang_url": fake.url, "max_loaded_versions": 1, "train_launcher": "inprocess"}},
    })
    backend = LocalBackend(settings)
    datum = Datum.from_turn([3, 4, 5], [6, 7], [-1.0, -1.0], [1.0, 1.0], 0)

    async def go() -> dict[str, Any]:
        await backend.start()
        try:
            base_ckpt = await backend.save_checkpoint("v0")
            await backend.train_step([datum], LossConfig("importance_sampling"))
            assert await backend.publish(1) == 1
            ckpt1 = await backend.save_checkpoint("v1")
            exported = load_safetensors_dir(backend._training().export())  # version 1's adapter, as published
            await backend.train_step([datum], LossConfig("importance_sampling"))
            assert await backend.publish(2) == 2
            assert set(fake.adapters) == {"v2"}  # v1 was unloaded at publish (nothing used it)

            v1 = await backend.load_version(1, ckpt1)
            written = load_safetensors_dir(tmp_path / "trainer" / "local" / "versions" / "v1")
            stream = await v1.sample([1, 2, 3], GREEDY)
            [t async for t in stream]
            plain = await backend.sampler().sample([1, 2, 3], GREEDY)
            [t async for t in plain]
            out = {"exported": exported, "written": written, "v1_version": stream.policy_version,
                   "plain_version": plain.policy_version, "lora_paths": [r.get("lora_path") for r in fake.requests],
                   "adapters_with_v1": set(fake.adapters)}
            v0 = await backend.load_version(0, base_ckpt)  # max_loaded_versions 1: v1 is dropped and unloaded
            stream0 = await v0.sample([1, 2, 3], GREEDY)
            [t async for t in stream0]
            out.update(v0_version=stream0.policy_version, v0_lora=fake.requests[-1].get("lora_path"),
                       adapters_after=set(fake.adapters),
                       v1_dir_left=(tmp_path / "trainer" / "local" / "versions" / "v1").exists())
            return out
        finally:
            await backend.close()

    try:
        out = asyncio.run(go())
    finally:
        fake.stop()
    assert set(out["written"]) == set(out["exported"]) and out["written"]
    for k, v in out["exported"].items():
        assert torch.equal(out["written"][k], v), k
    assert out["adapters_with_v1"] == {"v1", "v2"} and out["lora_paths"] == ["v1", "v2"]
    assert (out["v1_version"], out["plain_version"], out["v0_version"]) == (1, 2, 0)
    assert out["v0_lora"] is None  # version 0 is the base model
    assert out["adapters_after"] == {"v2"} and not out["v1_dir_left"]
