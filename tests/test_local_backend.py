"""LocalBackend (backends/local): entry-point discovery, start/model_info/sampler/close, engine choice."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("clawbridge_local")

from clawbridge_local.backend import EngineNotAvailable, LocalBackend
from clawbridge_local.engine import TorchEngine

from clawbridge.backend import ModelInfo, ServingBackend
from clawbridge.config import Settings
from clawbridge.devtools.tinymodel import build_tiny_model
from clawbridge.plugins import available_backends, load_backend
from clawbridge.serving.sampler import SamplerOverloaded, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_backend"))


def test_entry_point_is_installed() -> None:
    ep = available_backends()["local"]
    assert ep.value == "clawbridge_local.backend:create"


def test_load_backend_start_sample_close(model_dir: Path, tmp_path: Path) -> None:
    settings = Settings.model_validate(
        {
            "model": str(model_dir),
            "state_dir": str(tmp_path),
            "backends": {"local": {"device": "auto", "dtype": "auto", "max_running_requests": 1,
                                   "max_queued_requests": 0}},
            "default_max_tokens": 77,
        }
    )
    backend = load_backend("local", settings)
    assert isinstance(backend, LocalBackend) and isinstance(backend, ServingBackend)
    assert backend.name == "local" and backend.engine_name == "torch"
    with pytest.raises(RuntimeError):
        backend.model_info()

    async def go() -> None:
        await backend.start()
        info = backend.model_info()
        assert info == ModelInfo(
            name=model_dir.name, tokenizer_path=str(model_dir), context_window=32768, max_output_tokens=77
        )
        sampler = backend.sampler()
        assert isinstance(sampler, TorchEngine)
        assert (sampler.max_running, sampler.max_queued) == (1, 0)
        stream = await sampler.sample([1, 2, 3], SamplingParams(max_tokens=4, seed=0))
        with pytest.raises(SamplerOverloaded):
            await sampler.sample([1, 2, 3], SamplingParams(max_tokens=4))
        toks = [t async for t in stream]
        assert (len(toks), stream.finish_reason, stream.policy_version) == (4, "length", 0)
        await backend.close()
        await backend.close()  # idempotent
        assert not sampler._worker.is_alive()
        with pytest.raises(RuntimeError):
            backend.sampler()

    asyncio.run(go())


def test_served_model_name_and_tokenizer_override(model_dir: Path, tmp_path: Path) -> None:
    settings = Settings.model_validate(
        {"model": str(model_dir), "served_model_name": "mine", "tokenizer": "some/tokenizer",
         "state_dir": str(tmp_path)}
    )
    backend = load_backend("local", settings)

    async def go() -> ModelInfo:
        await backend.start()
        try:
            return backend.model_info()
        finally:
            await backend.close()

    info = asyncio.run(go())
    assert (info.name, info.tokenizer_path) == ("mine", "some/tokenizer")


def test_sglang_engine_without_the_package_is_refused_clearly(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import clawbridge_local.backend as local_backend

    monkeypatch.setattr(local_backend, "sglang_installed", lambda: False)
    backend = load_backend("local", Settings.model_validate(
        {"model": str(model_dir), "backends": {"local": {"engine": "sglang"}}, "state_dir": str(tmp_path)}))
    with pytest.raises(EngineNotAvailable, match="needs the sglang package"):
        asyncio.run(backend.start())


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--model"):
        load_backend("local", Settings.model_validate({"model": "", "state_dir": str(tmp_path)}))
    backend = load_backend("local", Settings.model_validate({"model": str(tmp_path / "absent"), "state_dir": str(tmp_path)}))
    with pytest.raises(ValueError, match="absent"):
        asyncio.run(backend.start())
