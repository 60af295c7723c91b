"""A backend found by entry point, third-party included, is selectable and has its own options:
TOML `[backends.<name>]`, environment `CLAWBRIDGE_<NAME>_<OPTION>`, validated when selected."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

import clawbridge.plugins as backend_mod
from clawbridge.backend import FakeServingBackend, ModelInfo
from clawbridge.backend_settings import BackendSettingsError, backend_section, env_prefix
from clawbridge.config import Settings, load_settings
from clawbridge.plugins import load_backend
from clawbridge.serving.sampler import FakeSampler


class EchoSettings(BaseModel):
    """The options of a third-party backend named `echo-lab`."""

    url: str = "http://127.0.0.1:1"
    replicas: int = Field(1, ge=1)
    tags: list[str] = Field(default_factory=list)


def create_echo(settings: Settings) -> FakeServingBackend:
    opts = backend_section(settings, settings.backend, EchoSettings)
    created.append(opts)
    return FakeServingBackend(FakeSampler([1]), ModelInfo(opts.url, "tok", 64, 8))


create_echo.settings_model = EchoSettings  # type: ignore[attr-defined]
created: list[EchoSettings] = []


def create_plain(settings: Settings) -> FakeServingBackend:
    return FakeServingBackend(FakeSampler([1]), ModelInfo("plain", "tok", 64, 8))


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """`echo-lab` and `plain` installed by entry point (as a pip package would register them)."""
    eps = {
        "echo-lab": metadata.EntryPoint("echo-lab", f"{__name__}:create_echo", backend_mod.ENTRY_POINT_GROUP),
        "plain": metadata.EntryPoint("plain", f"{__name__}:create_plain", backend_mod.ENTRY_POINT_GROUP),
    }
    monkeypatch.setattr(backend_mod, "available_backends", lambda: eps)
    for var in ("CLAWBRIDGE_ECHO_LAB_URL", "CLAWBRIDGE_ECHO_LAB_REPLICAS", "CLAWBRIDGE_ECHO_LAB_TAGS"):
        monkeypatch.delenv(var, raising=False)
    created.clear()


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "clawbridge.toml"
    path.write_text(text)
    return path


def test_a_third_party_backend_is_selected_with_its_toml_section_and_env(
    installed: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert env_prefix("echo-lab") == "CLAWBRIDGE_ECHO_LAB_"
    cfg = _toml(tmp_path, f'backend = "echo-lab"\nstate_dir = "{tmp_path}"\n'
                '[backends.echo-lab]\nurl = "http://127.0.0.1:7000"\nreplicas = 2\n')
    monkeypatch.setenv("CLAWBRIDGE_ECHO_LAB_REPLICAS", "3")  # the environment wins over the file
    monkeypatch.setenv("CLAWBRIDGE_ECHO_LAB_TAGS", '["a", "b"]')
    settings = load_settings(cfg)
    assert settings.backend == "echo-lab"
    backend = load_backend(settings.backend, settings)
    assert backend.model_info().name == "http://127.0.0.1:7000"
    assert created == [EchoSettings(url="http://127.0.0.1:7000", replicas=3, tags=["a", "b"])]


@pytest.mark.parametrize(
    ("section", "env", "message"),
    [
        ({"replicas": 0}, {}, r"backends\.echo-lab\.replicas \(env CLAWBRIDGE_ECHO_LAB_REPLICAS\)"),
        ({"urll": "x"}, {}, r"unknown option\(s\) backends\.echo-lab\.urll; known: url, replicas, tags"),
        ({}, {"CLAWBRIDGE_ECHO_LAB_REPLICAS": "many"}, r"backends\.echo-lab\.replicas"),
        ({}, {"CLAWBRIDGE_ECHO_LAB_TAGS": "a,b"}, r"CLAWBRIDGE_ECHO_LAB_TAGS: expected JSON"),
    ],
)
def test_bad_options_are_refused_when_the_backend_is_selected(
    installed: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    section: dict[str, Any], env: dict[str, str], message: str,
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings = Settings(backend="echo-lab", state_dir=tmp_path, backends={"echo-lab": section})
    with pytest.raises(BackendSettingsError, match=message):
        load_backend("echo-lab", settings)
    assert created == []  # refused before the factory ran


def test_a_backend_without_options_refuses_a_section(installed: None, tmp_path: Path) -> None:
    ok = Settings(backend="plain", state_dir=tmp_path)
    assert load_backend("plain", ok).model_info().name == "plain"
    bad = Settings(backend="plain", state_dir=tmp_path, backends={"plain": {"x": 1}})
    with pytest.raises(BackendSettingsError, match=r"backend 'plain' takes no options, but \[backends.plain\] sets x"):
        load_backend("plain", bad)


def test_a_backend_name_must_be_a_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="backend"):
        Settings(backend="../evil", state_dir=tmp_path)


def test_config_show_masks_a_backend_sections_secrets(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path, backends={"echo-lab": {"api_key": "sk-live-1", "url": "http://h"}})
    assert settings.masked_dump()["backends"] == {"echo-lab": {"api_key": "***", "url": "http://h"}}
