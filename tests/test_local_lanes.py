"""Users' lanes on the local backend beside SGLang (the server that checks sglang 0.5.x shapes):
each user's adapter is exported, loaded as `v{N}` and named per request as `lora_path`; the users'
trainers share one base copy; a version evicted from the cache is unloaded from the server.
(The torch engine's lanes: tests/test_user_adapters.py, through `clawbridge up`.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("clawbridge_local")

from clawbridge_local.backend import LocalBackend  # noqa: E402
from clawbridge_local.training import load_safetensors_dir  # noqa: E402

from clawbridge.backend import Datum, LossConfig  # noqa: E402
from clawbridge.config import Settings  # noqa: E402
from clawbridge.serving.sampler import SamplingParams  # noqa: E402
from tests.sglang_server import FakeSGLang  # noqa: E402
from tests.support import free_port  # noqa: E402

GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


def test_users_adapters_beside_sglang(tiny_model_dir: Path, tmp_path: Path) -> None:
    fake = FakeSGLang(tiny_model_dir, port=free_port(), enable_lora=True, max_lora_rank=8,
                      lora_target_modules=("q_proj", "v_proj")).start()
    settings = Settings.model_validate({
        "model": str(tiny_model_dir), "state_dir": str(tmp_path), "lora_rank": 4,
        "lora_target_modules": ["q_proj", "v_proj"], "learning_rate": 0.05, "per_user_adapters": True,
        "max_user_adapters": 1, "backends": {"local": {"sglang_url": fake.url, "max_loaded_versions": 1,
                                                       "train_launcher": "inprocess"}},
    })
    backend = LocalBackend(settings)
    data = {"alice": Datum.from_turn([3, 4, 5], [6, 7], [-1.0, -1.0], [1.0, 1.0], 0),
            "bob": Datum.from_turn([9, 8, 7], [5, 4], [-1.0, -1.0], [1.0, 1.0], 0)}

    async def go() -> dict[str, Any]:
        await backend.start()
        out: dict[str, Any] = {}
        try:
            assert backend.user_lanes_unsupported() is None
            lanes = {u: backend.user_lane(u) for u in data}
            for version, (user, lane) in enumerate(lanes.items(), start=1):
                await lane.start()
                await lane.train_step([data[user]], LossConfig("importance_sampling"))
                assert await lane.publish(version) == version
                out[f"{user}_ckpt"] = await lane.save_checkpoint(f"v{version}")
                out[f"{user}_adapter"] = load_safetensors_dir(backend.version_dir(version))
            # The cache keeps the shared published version's neighbours: max_loaded_versions 1 +
            # max_user_adapters 1, so both users' versions are loaded.
            out["adapters"] = set(fake.adapters)
            for version in (1, 2):
                sampler = backend.loaded_versions.peek(version)
                assert sampler is not None
                stream = await sampler.sample([1, 2, 3], GREEDY)
                [t async for t in stream]
                out[f"lora_{version}"] = fake.requests[-1].get("lora_path")
            bases = [{p.data_ptr() for p in lane.trainer.client.core.model.parameters() if not p.requires_grad}
                     for lane in lanes.values()]  # type: ignore[union-attr]
            out["shared_base"] = bases[0] == bases[1] and bases[0] <= {
                t.data_ptr() for t in backend._lanes_base().parameters()}
            # A third version pushes the least recently used out of the cache: unloaded from SGLang.
            await backend.load_version(1, out["alice_ckpt"])
            await lanes["bob"].train_step([data["bob"]], LossConfig("importance_sampling"))
            await lanes["bob"].publish(3)
            out["adapters_after"] = set(fake.adapters)
            for lane in lanes.values():
                await lane.close()
        finally:
            await backend.close()
        return out

    try:
        out = asyncio.run(go())
    finally:
        fake.stop()
    assert out["adapters"] == {"v1", "v2"}
    assert (out["lora_1"], out["lora_2"]) == ("v1", "v2")
    assert set(out["alice_adapter"]) == set(out["bob_adapter"])
    assert any(not torch.equal(out["alice_adapter"][k], out["bob_adapter"][k]) for k in out["alice_adapter"])
    assert out["shared_base"]
    assert out["adapters_after"] == {"v1", "v3"}  # v2 was the least recently used


def test_forgotten_versions_leave_sglang_and_the_disk(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`unload_versions` (what forgetting a user calls): her adapter is unloaded from the SGLang
    server and its `versions/vN` folder deleted, the other user's stays loaded and served; an
    adapter an earlier process left loaded (its folder still on disk after a kill) is unloaded too."""
    import shutil

    import httpx

    fake = FakeSGLang(tiny_model_dir, port=free_port(), enable_lora=True, max_lora_rank=8,
                      lora_target_modules=("q_proj", "v_proj")).start()
    settings = Settings.model_validate({
        "model": str(tiny_model_dir), "state_dir": str(tmp_path), "lora_rank": 4,
        "lora_target_modules": ["q_proj", "v_proj"], "learning_rate": 0.05, "per_user_adapters": True,
        "backends": {"local": {"sglang_url": fake.url, "train_launcher": "inprocess"}},
    })
    backend = LocalBackend(settings)
    datum = Datum.from_turn([3, 4, 5], [6, 7], [-1.0, -1.0], [1.0, 1.0], 0)

    async def go() -> dict[str, Any]:
        await backend.start()
        out: dict[str, Any] = {}
        try:
            lanes = {u: backend.user_lane(u) for u in ("alice", "bob")}
            for version, lane in enumerate(lanes.values(), start=1):
                await lane.train_step([datum], LossConfig("importance_sampling"))
                await lane.publish(version)
            out["before"] = set(fake.adapters)
            stale = backend.version_dir(7)  # as a killed earlier run left it: loaded on the server
            shutil.copytree(backend.version_dir(2), stale)
            httpx.post(fake.url + "/load_lora_adapter", json={"lora_name": "v7", "lora_path": str(stale)}).raise_for_status()
            await backend.unload_versions([1, 7])
            out["after"] = set(fake.adapters)
            out["kept"] = backend.loaded_versions.versions
            out["dirs"] = sorted(p.name for p in backend.version_dir(1).parent.iterdir())
            sampler = backend.loaded_versions.peek(2)
            assert sampler is not None
            stream = await sampler.sample([1, 2, 3], GREEDY)
            [t async for t in stream]
            out["bob_lora"] = fake.requests[-1].get("lora_path")
            for lane in lanes.values():
                await lane.close()
        finally:
            await backend.close()
        return out

    try:
        out = asyncio.run(go())
    finally:
        fake.stop()
    assert out["before"] == {"v1", "v2"}
    assert out["after"] == {"v2"} and out["kept"] == [2] and out["dirs"] == ["v2"], out
    assert out["bob_lora"] == "v2"


def test_users_trainers_beyond_max_lane_trainers_are_parked_without_changing_training(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Three users, two steps each, taking turns, on the torch engine: with `max_lane_trainers` 1 at
    most one lane's trainer is in memory after each step, the others restored from their checkpoints
    when their turn comes, and every adapter ends exactly as with all three trainers kept."""
    users = ("alice", "bob", "carol")
    data = {u: Datum.from_turn([3 + i, 4, 5], [6 + i, 7], [-1.0, -1.0], [1.0, -0.5], 0) for i, u in enumerate(users)}

    def run(limit: int, state: Path) -> tuple[dict[str, dict[str, Any]], list[int], int]:
        settings = Settings.model_validate({
            "model": str(tiny_model_dir), "state_dir": str(state), "lora_rank": 4, "learning_rate": 0.05,
            "per_user_adapters": True, "backends": {"local": {"engine": "torch", "train_launcher": "inprocess",
                                                              "max_lane_trainers": limit}}})
        backend = LocalBackend(settings, progress=False)

        async def go() -> tuple[dict[str, dict[str, Any]], list[int], int]:
            await backend.start()
            alive: list[int] = []
            try:
                lanes = {u: backend.user_lane(u) for u in users}
                for version, user in enumerate((*users, *users), start=1):
                    lane = lanes[user]
                    await lane.train_step([data[user]], LossConfig("importance_sampling"))
                    await lane.publish(version)
                    await lane.save_checkpoint(f"v{version}")
                    alive.append(sum(x.trainer.client.alive for x in lanes.values()))
                final = {u: load_safetensors_dir(Path(str(lanes[u].trainer.client.last_checkpoint))) for u in users}
                parked = backend.lane_trainers.parked
                for lane in lanes.values():
                    await lane.close()
            finally:
                await backend.close()
            return final, alive, parked

        return asyncio.run(go())

    kept, alive_kept, parked_kept = run(3, tmp_path / "kept")
    parked, alive_parked, parked_n = run(1, tmp_path / "parked")
    assert alive_kept == [1, 2, 3, 3, 3, 3] and parked_kept == 0
    assert alive_parked == [1] * 6 and parked_n == 5  # every step but the first parked the previous lane
    for user in users:
        assert set(kept[user]) == set(parked[user])
        for name, tensor in kept[user].items():
            assert torch.equal(tensor, parked[user][name]), (user, name)
    assert any(not torch.equal(kept["alice"][k], kept["bob"][k]) for k in kept["alice"])
