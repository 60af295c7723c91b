"""Many users' adapters beside SGLang through its own multi-LoRA machinery (issue 32 §2), against the
server that checks sglang 0.5.x shapes (tests/sglang_server.py), which refuses a load past
`--max-loaded-loras`, keeps at most `--max-loras-per-batch` adapters in GPU slots (lru), and answers
by the content of the adapter a request names, so an answer from the wrong adapter differs.

- More kept versions than the server may hold, called at random and at once: every answer equals
  the one that version's adapter gives loaded alone; the server never held more than its limit,
  never refused a load and never had to wait to unload an adapter in use; GPU slots were swapped
  (SGLang's own eviction at work) and kept versions unloaded for room were loaded again.
- `LocalBackend` launches SGLang with the three multi-LoRA arguments sized from the settings.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("clawbridge_local")

from clawbridge_local.backend import LocalBackend
from clawbridge_local.sglang_engine import SGLangEngine
from clawbridge_local.sglang_launch import SGLangServer

from clawbridge.config import Settings
from clawbridge.serving.sampler import Sampler, SamplingParams
from tests.sglang_server import FakeSGLang
from tests.support import free_port

FAKE_CMD = [sys.executable, str(Path(__file__).with_name("sglang_server.py"))]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
LIMIT = 4
"""--max-loaded-loras of the server."""
VERSIONS = 11
"""LoRA versions: the published one and ten kept beside it (users' adapters)."""


def adapter(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8,
                                                            "target_modules": ["q_proj", "v_proj"]}))
    (folder / "adapter_model.safetensors").write_bytes(f"weights of user {seed}".encode())
    return folder


def fake_server(model: Path, **kw: object) -> FakeSGLang:
    return FakeSGLang(model, port=free_port(), enable_lora=True, max_lora_rank=8,
                      lora_target_modules=("q_proj", "v_proj"), **kw).start()  # type: ignore[arg-type]


async def answer(sampler: Sampler, prompt: list[int]) -> list[int]:
    stream = await sampler.sample(prompt, GREEDY)
    return [t.token_id async for t in stream]


def test_more_adapters_than_the_server_holds_answer_each_from_its_own(tiny_model_dir: Path, tmp_path: Path) -> None:
    folders = {v: adapter(tmp_path / f"a{v}", v) for v in range(1, VERSIONS + 1)}
    prompts = [[3, 4, 5 + i] for i in range(3)]
    server = fake_server(tiny_model_dir, max_loaded_loras=LIMIT, max_loras_per_batch=2, token_delay_s=0.003)
    alone = fake_server(tiny_model_dir)

    async def reference() -> dict[tuple[int, int], list[int]]:
        """Each version's adapter loaded alone (no limit, nothing else loaded) answers each prompt."""
        engine = await SGLangEngine.connect(alone.url, lora=True)
        out = {}
        for v, folder in folders.items():
            await engine.publish_lora(folder, v)
            await engine.drain_unloads()
            assert set(alone.adapters) == {f"v{v}"}
            for i, p in enumerate(prompts):
                out[(v, i)] = await answer(engine, p)
        await engine.aclose()
        return out

    async def many() -> tuple[list[tuple[int, int, list[int], int]], SGLangEngine]:
        engine = await SGLangEngine.connect(server.url, lora=True, max_loaded_loras=LIMIT)
        await engine.publish_lora(folders[1], 1)
        samplers: dict[int, Sampler] = {1: engine}
        for v in range(2, VERSIONS + 1):  # more than the server may hold: the idle ones make room
            samplers[v] = await engine.load_lora_version(folders[v], v)
            assert len(engine.loaded_versions) <= LIMIT
        rng = random.Random(0)
        calls = [(rng.randrange(1, VERSIONS + 1), rng.randrange(len(prompts))) for _ in range(60)]
        gate = asyncio.Semaphore(8)

        async def one(v: int, i: int) -> tuple[int, int, list[int], int]:
            async with gate:
                sampler = samplers[v]
                stream = await sampler.sample(prompts[i], GREEDY)
                return v, i, [t.token_id async for t in stream], stream.policy_version

        got = await asyncio.gather(*(one(v, i) for v, i in calls))
        await engine.drain_unloads()
        return list(got), engine

    try:
        want = asyncio.run(reference())
        got, engine = asyncio.run(many())
    finally:
        server.stop()
        alone.stop()
    assert len({tuple(t) for t in want.values()}) > VERSIONS  # the adapters answer differently
    wrong = [(v, i) for v, i, tokens, version in got if tokens != want[(v, i)] or version != v]
    assert not wrong, wrong
    assert server.most_loaded <= LIMIT
    assert server.refused_loads == []
    assert server.unload_waits == []  # never unloaded an adapter a request was using
    loads = [b["lora_name"] for path, b in server.calls if path == "/load_lora_adapter"]
    assert len(loads) == engine.lora_loads > VERSIONS  # kept versions unloaded for room came back
    assert server.slot_loads > 2  # the server moved adapters in and out of its 2 GPU slots itself
    assert {v for v, _, _, _ in got} == set(range(1, VERSIONS + 1))


def test_waiting_for_room_when_every_loaded_adapter_is_streaming(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With every adapter the server holds in use by a stream, a call on another one waits for a
    stream to end (it is not refused by the server), then gets its own adapter."""
    server = fake_server(tiny_model_dir, max_loaded_loras=2, max_loras_per_batch=2, token_delay_s=0.02)
    folders = {v: adapter(tmp_path / f"a{v}", v) for v in (1, 2, 3)}

    async def go() -> tuple[list[int], int]:
        engine = await SGLangEngine.connect(server.url, lora=True, max_loaded_loras=2)
        await engine.publish_lora(folders[1], 1)
        kept = {v: await engine.load_lora_version(folders[v], v) for v in (2, 3)}
        long_1 = await engine.sample([1, 2], SamplingParams(max_tokens=20, temperature=0.0))
        long_2 = await kept[2].sample([1, 2], SamplingParams(max_tokens=20, temperature=0.0))
        third = asyncio.ensure_future(answer(kept[3], [1, 2]))
        await asyncio.sleep(0.1)
        assert not third.done()  # waiting for room, not refused
        [t async for t in long_2]
        tokens = await third
        [t async for t in long_1]
        await engine.aclose()
        return tokens, server.most_loaded

    try:
        tokens, most = asyncio.run(go())
    finally:
        server.stop()
    assert most == 2 and len(tokens) == 6


def test_a_start_waiting_for_a_load_does_not_pin_an_adapter_it_does_not_run_on(tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    """Room for one adapter beside the current one. A (version 2) unloads 3 and loads 2; meanwhile
    B (version 3) and then C (version 2) wait for the load lock. B gets it next and needs 2's room:
    2 must count as free once A's stream ends, though C is waiting to use it. (Counted as a user
    from its start, C pinned 2 and B waited for room until read_timeout_s: the CI run's timeout.)"""
    server = fake_server(tiny_model_dir, max_loaded_loras=2, max_loras_per_batch=2, token_delay_s=0.003)
    folders = {v: adapter(tmp_path / f"a{v}", v) for v in (1, 2, 3)}

    async def go() -> tuple[list[list[int]], list[str]]:
        engine = await SGLangEngine.connect(server.url, lora=True, max_loaded_loras=2, read_timeout_s=10.0)
        await engine.publish_lora(folders[1], 1)
        kept = {v: await engine.load_lora_version(folders[v], v) for v in (2, 3)}
        assert engine.loaded_versions == {1, 3}
        before = len(server.calls)
        got = await asyncio.gather(answer(kept[2], [3, 4]), answer(kept[3], [3, 4]), answer(kept[2], [3, 5]))
        await engine.drain_unloads()
        await engine.aclose()
        loads = [b["lora_name"] for path, b in server.calls[before:] if path == "/load_lora_adapter"]
        return list(got), loads

    try:
        got, loads = asyncio.run(go())
    finally:
        server.stop()
    assert loads == ["v2", "v3", "v2"]  # A's load, then B's, then C's: the interleaving described
    assert all(len(tokens) == 6 for tokens in got)
    assert server.most_loaded <= 2 and server.refused_loads == []


def test_backend_launches_sglang_with_its_multi_lora_arguments(tiny_model_dir: Path, tmp_path: Path) -> None:
    s = Settings.model_validate({
        "model": str(tiny_model_dir), "state_dir": str(tmp_path), "lora_rank": 4, "per_user_adapters": True,
        "lora_target_modules": ["q_proj", "v_proj"], "max_user_adapters": 16,
        "backends": {"local": {"engine": "sglang", "max_loaded_versions": 2, "sglang_max_loras_per_batch": 4,
                               "sglang_lora_eviction_policy": "fifo", "sglang_startup_timeout_s": 60}}})
    backend = LocalBackend(s, sglang_command=FAKE_CMD)
    assert backend.sglang_max_loaded_loras() == 1 + 2 + 16
    server: SGLangServer = backend._sglang_server()
    argv = " ".join(server.config.argv())
    assert "--max-loaded-loras 19 --max-loras-per-batch 4 --lora-eviction-policy fifo" in argv
    url = server.start()  # the fake parses them as launch_server does
    try:
        engine = asyncio.run(SGLangEngine.connect(url, lora=True, max_loaded_loras=19))
        assert engine.max_loaded_loras == 19
        asyncio.run(engine.aclose())
    finally:
        server.stop()
    small = Settings.model_validate({"model": str(tiny_model_dir), "state_dir": str(tmp_path), "lora_rank": 4,
                                     "backends": {"local": {"engine": "sglang", "sglang_max_loras_per_batch": 4}}})
    assert LocalBackend(small, sglang_command=FAKE_CMD).sglang_max_loaded_loras() == 4  # at least one batch's
