"""The local backend's training half, end to end on CPU with the tiny model.

What these tests pin down (issue 3, "Tests" for the local backend):
- train_step on datums built from real sampled ids/logprobs with positive advantages, then publish:
  the engine serves policy version 1, new streams report version 1, and the same greedy prompt's
  logprobs for the trained tokens went up (full fine-tuning and LoRA);
- a stream started before a publish finishes on version 0 with the old weights' logprobs;
- LoRA publish: the engine's merged weights give the trainer's peft model's logprobs (merge_lora);
- checkpoints: a fresh backend on the same state dir serves the newest checkpoint's version with
  the same greedy logprobs, and keeps counting versions from there;
- the trainer loop + LocalBackend through the real proxy: sessions, rewards, a step, version 1
  served and recorded.

Invariants kept by every test: the model is built offline (`tiny_model_dir`), every wait is bounded,
every backend is closed in `finally`, torch runs one thread here (restored after), and each assertion compares against a value measured in the
same test (base weights, trainer model), so a wrong sign, scale or swap fails it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("clawbridge_local")

import httpx  # noqa: E402
import openai  # noqa: E402
from clawbridge_local.backend import LocalBackend  # noqa: E402
from clawbridge_local.engine import TorchEngine  # noqa: E402

from clawbridge.backend import Datum, LossConfig  # noqa: E402
from clawbridge.config import Settings  # noqa: E402
from clawbridge.serving.sampler import SamplingParams  # noqa: E402
from tests.support import free_port, in_process_proxy  # noqa: E402

PROMPTS: tuple[tuple[int, ...], ...] = ((1, 2, 3, 4, 5), (10, 20, 30), (100, 200, 300, 400), (7, 8, 9))
"""Prompt ids (inside the tiny vocabulary); each is trained on its own greedy completion."""
COMPLETION = 8
"""Greedy tokens sampled per prompt."""
Sample = tuple[list[int], list[float], int]
"""What one greedy call gave: sampled ids, their logprobs, the stream's policy version."""


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for this module (restored after): the tiny model gains nothing from
    more, and on a shared 2-core machine OpenMP spin-waiting made decoding ~20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def settings_for(model_dir: Path, state_dir: Path, lora_rank: int, **extra: Any) -> Settings:
    """Local-backend settings on CPU: fp32 engine with fp32 keys and values (served logprobs equal the
    trainer's to 1e-4), in-process trainer, lr high enough to see."""
    values: dict[str, Any] = {
        "model": str(model_dir),
        "state_dir": state_dir,
        "lora_rank": lora_rank,
        "lora_alpha": 32.0,
        "learning_rate": 1e-3,
        "backends": {"local": {"device": "cpu", "dtype": "float32", "kv_dtype": "float32", "max_running_requests": 4,
                               "train_world_size": 1}},
    }
    values.update(extra)
    return Settings(**values)


async def greedy(engine: TorchEngine, prompt: Sequence[int], n: int = COMPLETION) -> Sample:
    """Greedy ids, their logprobs and the stream's policy version."""
    stream = await engine.sample(prompt, SamplingParams(max_tokens=n, temperature=0.0))
    toks = [t async for t in stream]
    assert stream.finish_reason == "length"
    return [t.token_id for t in toks], [t.logprob for t in toks], stream.policy_version


async def greedy_all(engine: TorchEngine) -> list[Sample]:
    return [await greedy(engine, p) for p in PROMPTS]


async def served_logprobs(
    engine: TorchEngine, prompt: Sequence[int], ids: Sequence[int]
) -> tuple[list[float], set[int]]:
    """Teacher-forced logprobs of `ids` after `prompt` as the engine serves them now (one 1-token
    call per position, with the whole distribution as top_logprobs), and the versions that served."""
    out: list[float] = []
    versions: set[int] = set()
    for i, tok in enumerate(ids):
        params = SamplingParams(max_tokens=1, temperature=0.0, top_logprobs=engine.vocab_size)
        stream = await engine.sample([*prompt, *ids[:i]], params)
        (only,) = [t async for t in stream]
        out.append(dict(only.top_logprobs)[tok])
        versions.add(stream.policy_version)
    return out, versions


def batch_from(samples: Sequence[Sample], advantage: float = 1.0) -> list[Datum]:
    """One datum per prompt from what the engine sampled, with the same advantage on every token."""
    return [
        Datum.from_turn(prompt, ids, lps, [advantage] * len(ids), policy_version=version, turn_id=f"t{i}")
        for i, (prompt, (ids, lps, version)) in enumerate(zip(PROMPTS, samples, strict=True))
    ]


def trainer_logprobs(backend: LocalBackend, prompt: Sequence[int], ids: Sequence[int]) -> list[float]:
    """Teacher-forced logprobs of `ids` after `prompt` under the in-process trainer's model."""
    trainer = backend._trainer
    assert trainer is not None and trainer.client.core is not None, "expected the in-process trainer"
    model = trainer.client.core.model
    seq = torch.tensor([[*prompt, *ids]], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [float(logp[start + i, t]) for i, t in enumerate(ids)]


# ------------------------------------------------------------------------ (1) publish changes serving


@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora8"])
def test_train_publish_raises_served_logprobs_of_trained_tokens(
    tiny_model_dir: Path, tmp_path: Path, lora_rank: int
) -> None:
    backend = LocalBackend(settings_for(tiny_model_dir, tmp_path, lora_rank), progress=False)

    async def scenario() -> None:
        await backend.start()
        try:
            engine = backend.sampler()
            before = await greedy_all(engine)
            assert all(v == 0 for _, _, v in before)
            # The teacher-forced probe reads the same numbers the greedy stream reported.
            probe, versions = await served_logprobs(engine, PROMPTS[0], before[0][0])
            assert versions == {0} and probe == pytest.approx(before[0][1], abs=1e-5)
            batch = batch_from(before)
            result = await backend.train_step(batch, LossConfig("importance_sampling"))
            m = result.metrics
            assert m["tokens"] == len(PROMPTS) * COMPLETION and m["step"] == 1
            # On-policy: the trainer's logprobs are the sampler's, so every ratio is 1.
            assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
            # Training alone changes nothing that is served.
            assert await greedy_all(engine) == before

            assert await backend.publish() == 1
            assert engine.policy_version == 1
            assert all(v == 1 for _, _, v in await greedy_all(engine))
            for prompt, (ids, lps0, _) in zip(PROMPTS, before, strict=True):
                # The same prompt, the trained tokens: their served logprobs went up.
                lps1, versions = await served_logprobs(engine, prompt, ids)
                assert versions == {1}
                assert sum(lps1) > sum(lps0) + 0.05, (lps0, lps1)
        finally:
            await backend.close()

    asyncio.run(scenario())


# ------------------------------------------------------------------- (2) streams keep their version


def test_stream_started_before_publish_finishes_on_old_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    long_n = 200  # long enough to still be decoding when the swap lands (asserted below)
    backend = LocalBackend(settings_for(tiny_model_dir, tmp_path, 0), progress=False)

    async def scenario() -> None:
        await backend.start()
        try:
            engine = backend.sampler()
            ref_ids, ref_lps, _ = await greedy(engine, PROMPTS[0], long_n)
            await backend.train_step(batch_from(await greedy_all(engine)), LossConfig("importance_sampling"))

            old = await engine.sample(PROMPTS[0], SamplingParams(max_tokens=long_n, temperature=0.0))
            it = aiter(old)
            got = [await anext(it)]
            assert await backend.publish() == 1
            # The old request was accepted and not yet released when the swap was applied, so the
            # engine had to keep its weights (a copy) for it.
            assert engine.in_flight >= 1, "the old stream ended before the publish; raise long_n"
            _, new_lps, new_v = await greedy(engine, PROMPTS[0], COMPLETION)
            assert new_v == 1
            assert max(abs(a - b) for a, b in zip(new_lps, ref_lps, strict=False)) > 1e-3
            async for tok in it:  # slow consumer: the engine keeps decoding on the old copy
                got.append(tok)
                if len(got) % 100 == 0:
                    await asyncio.sleep(0.01)
            assert old.policy_version == 0 and old.finish_reason == "length"
            assert [t.token_id for t in got] == ref_ids
            assert [t.logprob for t in got] == pytest.approx(ref_lps, abs=1e-5)
        finally:
            await backend.close()

    asyncio.run(scenario())


def test_full_publish_copies_the_trained_tensors_in_place(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Full fine-tuning in process: a publish copies the trainer's tensors into the served ones
    (same addresses: nothing reloaded, no export written to disk), the engine then serves exactly
    what the trainer computes, and a later step that is not published changes nothing served."""
    backend = LocalBackend(settings_for(tiny_model_dir, tmp_path, 0), progress=False)

    async def scenario() -> None:
        await backend.start()
        try:
            engine = backend.sampler()
            served = engine._current.model
            where = [p.data_ptr() for p in served.parameters()]
            samples = await greedy_all(engine)
            await backend.train_step(batch_from(samples), LossConfig("importance_sampling"))
            assert await backend.publish() == 1
            assert engine._current.model is served and [p.data_ptr() for p in served.parameters()] == where
            assert backend._trainer is not None
            assert not list((backend._trainer.work_dir / "exports").glob("*")), "a publish went through the disk"
            published = await greedy_all(engine)
            for prompt, (ids, lps, v) in zip(PROMPTS, published, strict=True):
                assert v == 1 and lps == pytest.approx(trainer_logprobs(backend, prompt, ids), abs=1e-5)
            assert max(abs(a - b) for (_, x, _), (_, y, _) in zip(samples, published, strict=True)
                       for a, b in zip(x, y, strict=True)) > 1e-3  # the step moved what is served
            await backend.train_step(batch_from(published), LossConfig("importance_sampling"))
            assert await greedy_all(engine) == published  # a copy, not the trainer's live tensors
        finally:
            await backend.close()

    asyncio.run(scenario())


# ------------------------------------------------------------------ (3) LoRA merge = trainer's model


def test_lora_publish_serves_what_the_trainer_computes(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = LocalBackend(settings_for(tiny_model_dir, tmp_path, 8, lora_alpha=16.0), progress=False)

    async def scenario() -> None:
        await backend.start()
        try:
            engine = backend.sampler()
            base = await greedy_all(engine)
            samples = base
            for version in (1, 2):  # the second publish merges from the base, not onto the first
                await backend.train_step(batch_from(samples), LossConfig("importance_sampling"))
                assert await backend.publish() == version
                samples = await greedy_all(engine)
                moved = 0.0
                for prompt, (ids, lps, v), (_, base_lps, _) in zip(PROMPTS, samples, base, strict=True):
                    assert v == version
                    want = trainer_logprobs(backend, prompt, ids)
                    assert lps == pytest.approx(want, abs=1e-4)
                    moved = max(moved, max(abs(a - b) for a, b in zip(lps, base_lps, strict=True)))
                assert moved > 1e-3, "the adapter must change what is served for the check to mean anything"
        finally:
            await backend.close()

    asyncio.run(scenario())


# --------------------------------------------------------------------------- (4) checkpoint/restore


@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora8"])
def test_restart_restores_a_checkpoint_and_serves_it(tiny_model_dir: Path, tmp_path: Path, lora_rank: int) -> None:
    settings = settings_for(tiny_model_dir, tmp_path, lora_rank)

    async def first_run() -> tuple[list[Sample], list[Sample], str]:
        backend = LocalBackend(settings, progress=False)
        await backend.start()
        try:
            engine = backend.sampler()
            base = samples = await greedy_all(engine)
            for version in (3, 5):  # the trainer loop hands out numbers from the store
                await backend.train_step(batch_from(samples), LossConfig("importance_sampling"))
                assert await backend.publish(version) == version
                samples = await greedy_all(engine)
            return base, samples, await backend.save_checkpoint("v00000005-step")
        finally:
            await backend.close()

    async def second_run(path: str) -> tuple[list[Sample], int, int]:
        backend = LocalBackend(settings, progress=False)
        await backend.start()
        try:
            engine = backend.sampler()
            assert engine.policy_version == 0  # a backend never restores by itself
            assert await backend.restore_checkpoint(path, 5) == 5
            restored = await greedy_all(engine)
            trainer = backend._trainer
            assert trainer is not None
            step = trainer.client.step
            await backend.train_step(batch_from(restored), LossConfig("importance_sampling"))
            return restored, step, await backend.publish()
        finally:
            await backend.close()

    base, served, path = asyncio.run(first_run())
    assert Path(path).parent == tmp_path / "checkpoints" / "local"
    restored, step, next_version = asyncio.run(second_run(path))
    assert step == 2 and next_version == 6
    for (ids, lps, v), (ids_r, lps_r, v_r), (_, base_lps, _) in zip(served, restored, base, strict=True):
        assert (v, v_r) == (5, 5)
        assert ids_r == ids
        assert lps_r == pytest.approx(lps, abs=1e-6)
        assert max(abs(a - b) for a, b in zip(lps, base_lps, strict=False)) > 1e-3  # not just the base


# ------------------------------------------------------------------- (5) through the real proxy


def test_proxy_trainer_loop_trains_publishes_and_records_new_version(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = settings_for(
        tiny_model_dir,
        tmp_path,
        8,
        port=free_port(),
        served_model_name="tiny",
        batch_size=2,
        baseline="none",
        trainer_poll_interval_s=0.05,
        default_max_tokens=8,
        promotion_mode="off",  # the step's version serves at once (the gate: tests/test_capability_probe.py)
    )
    backend = LocalBackend(settings, progress=False)
    try:
        with in_process_proxy(settings, backend) as proxy:
            admin = {"Authorization": f"Bearer {proxy.state.keys.admin}"}
            client = openai.OpenAI(
                base_url=proxy.base + "/v1", api_key=proxy.state.keys.client, max_retries=0
            )

            def chat(sid: str) -> Any:
                return client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "say something"}],
                    max_tokens=8,
                    extra_headers={"X-Session-Id": sid},
                )

            for sid, reward in (("s1", 1.0), ("s2", 0.5), ("s3", 1.0)):
                assert chat(sid).system_fingerprint == "policy-v0"
                r = httpx.post(
                    proxy.base + "/rl/set_reward", json={"reward": reward, "session_id": sid}, headers=admin
                )
                assert r.status_code == 200, r.text
                r = httpx.post(proxy.base + "/rl/end_session", json={"session_id": sid}, headers=admin)
                assert r.status_code == 200, r.text

            status: dict[str, Any] = {}
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                status = httpx.get(proxy.base + "/rl/status", headers=admin).json()
                if status["trainer"]["steps"]["ok"] >= 1 and status["policy_version"] >= 1:
                    break
                time.sleep(0.1)
            assert status["trainer"]["steps"]["ok"] >= 1, status
            assert status["policy_version"] == 1 and status["trainer"]["serving_policy_version"] == 1, status
            assert status["trainer"]["last_error"] is None, status["trainer"]["last_error"]

            assert chat("s4").system_fingerprint == "policy-v1"
            view = httpx.get(proxy.base + "/rl/sessions/s4", headers=admin).json()
            assert [t["policy_version"] for t in view["turns"]] == [1]
    finally:
        asyncio.run(backend.close())
