"""The local backend's options live in `[backends.local]` (`LocalSettings`): the environment names
users already set (`CLAWBRIDGE_ENGINE`, ...) still work after the section's own
(`CLAWBRIDGE_LOCAL_ENGINE`, ...), old flat keys are refused naming where they moved, `up --engine`
sets the section's option, and listing the backends' options imports neither torch nor an SDK."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tomllib
from importlib import import_module, metadata
from pathlib import Path

import pytest
from clawbridge_local.backend import LocalBackend, create
from clawbridge_local.settings import LocalSettings, local_settings

import clawbridge.plugins as backend_mod
from clawbridge.backend_settings import BackendSettingsError
from clawbridge.config import OptionMoved, Settings, load_settings
from clawbridge.plugins import load_backend, settings_models

ROOT = Path(__file__).resolve().parent.parent
MOVED = ("engine", "device", "dtype", "engine_batch_decode", "engine_threads", "max_running_requests",
         "max_queued_requests", "sglang_url", "sglang_port", "sglang_tp_size", "sglang_dp_size",
         "sglang_mem_fraction", "sglang_extra_args", "sglang_startup_timeout_s", "max_grad_norm",
         "micro_batch_size", "train_world_size", "train_launcher")
"""Every option that was flat on `Settings` and only the local backend reads."""
NEW = ("max_loaded_versions", "sglang_urls", "train_nnodes", "train_master_addr", "train_master_port",
       "kv_budget_tokens", "activation_checkpointing", "engine_cuda_graphs", "sglang_max_loras_per_batch",
       "sglang_max_loaded_loras", "sglang_lora_eviction_policy", "max_lane_trainers", "kv_memory_fraction",
       "kv_dtype", "malloc_mmap_threshold_kib")
"""Options added to the section since (no flat name to keep)."""


def _env_without_clawbridge(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWBRIDGE_")}
    env.update(extra)
    return env


def test_the_local_options_moved_out_of_settings() -> None:
    assert settings_models()["local"] is LocalSettings
    assert create.settings_model is LocalSettings  # type: ignore[attr-defined]
    assert set(MOVED) | set(NEW) == set(LocalSettings.model_fields)
    assert not set(MOVED) & set(Settings.model_fields)
    # what the core reads stays where the core reads it (the checkpoint identity, every backend's loss)
    assert {"lora_rank", "lora_alpha", "lora_target_modules", "learning_rate"} <= set(Settings.model_fields)


@pytest.mark.parametrize(("key", "value"), [("engine", '"torch"'), ("sglang_url", '"http://127.0.0.1:1"'),
                                            ("train_launcher", '"torchrun"'), ("max_running_requests", "2"),
                                            ("sglang_extra_args", '["--x"]')])
def test_an_old_flat_key_is_refused_naming_the_local_section(tmp_path: Path, key: str, value: str) -> None:
    cfg = tmp_path / "clawbridge.toml"
    cfg.write_text(f"port = 9001\n{key} = {value}\n")
    with pytest.raises(OptionMoved) as info:
        load_settings(cfg)
    message = str(info.value)
    assert f"option '{key}' moved to the local backend's own section: set `{key}` under `[backends.local]`" in message
    assert f"CLAWBRIDGE_LOCAL_{key.upper()}; CLAWBRIDGE_{key.upper()} still works" in message
    with pytest.raises(OptionMoved, match=r"under `\[backends\.local\]`"):
        Settings(state_dir=tmp_path, **{key: json.loads(value)})  # in code too
    # the same key in its section is read
    cfg.write_text(f"port = 9001\n[backends.local]\n{key} = {value}\n")
    assert getattr(local_settings(load_settings(cfg)), key) == json.loads(value)


def test_the_old_environment_names_still_work_after_the_new_ones(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "clawbridge.toml"
    cfg.write_text('[backends.local]\nengine = "sglang"\ndevice = "cuda:1"\nengine_threads = 3\n')
    monkeypatch.setenv("CLAWBRIDGE_ENGINE", "torch")  # the old name, over the file
    monkeypatch.setenv("CLAWBRIDGE_DEVICE", "cuda:0")
    monkeypatch.setenv("CLAWBRIDGE_LOCAL_DEVICE", "cpu")  # the section's own name wins over the old one
    monkeypatch.setenv("CLAWBRIDGE_SGLANG_EXTRA_ARGS", '["--enable-deterministic-inference"]')
    monkeypatch.setenv("CLAWBRIDGE_TRAIN_LAUNCHER", "torchrun")
    opts = local_settings(load_settings(cfg))
    assert (opts.engine, opts.device, opts.engine_threads, opts.train_launcher) == ("torch", "cpu", 3, "torchrun")
    assert opts.sglang_extra_args == ["--enable-deterministic-inference"]
    assert opts.max_running_requests == 8 and opts.sglang_startup_timeout_s == 900.0  # defaults unchanged
    monkeypatch.setenv("CLAWBRIDGE_MAX_RUNNING_REQUESTS", "0")
    with pytest.raises(BackendSettingsError,
                       match=r"backends\.local\.max_running_requests \(env CLAWBRIDGE_LOCAL_MAX_RUNNING_REQUESTS "
                             r"or CLAWBRIDGE_MAX_RUNNING_REQUESTS\)"):
        load_backend("local", load_settings(cfg, model="m"))


def test_a_bad_option_stops_the_local_backend_before_it_loads(tmp_path: Path) -> None:
    typo = Settings(state_dir=tmp_path, model="m", backends={"local": {"engnie": "torch"}})
    with pytest.raises(BackendSettingsError, match=r"unknown option\(s\) backends\.local\.engnie"):
        load_backend("local", typo)
    with pytest.raises(BackendSettingsError, match=r"backends\.local\.sglang_mem_fraction"):
        LocalBackend(Settings(state_dir=tmp_path, model="m", backends={"local": {"sglang_mem_fraction": 1.5}}))


def test_the_engine_flag_sets_the_section_over_the_environment(tmp_path: Path) -> None:
    """`up --engine` goes to `[backends.local] engine` and wins over CLAWBRIDGE_ENGINE: an invalid
    flag value is refused naming the option, although the environment's value is fine."""
    model = tmp_path / "model"
    model.mkdir()
    r = subprocess.run([sys.executable, "-m", "clawbridge.cli.main", "up", "--model", str(model), "--engine", "bogus",
                        "--port", "1", "--state-dir", str(tmp_path / "state")], capture_output=True, text=True,
                       env=_env_without_clawbridge(CLAWBRIDGE_ENGINE="torch"), timeout=120)
    out = " ".join(r.stderr.split())
    assert r.returncode == 1, out
    assert "backends.local.engine (env CLAWBRIDGE_LOCAL_ENGINE or CLAWBRIDGE_ENGINE)" in out, out
    flagged = load_settings(state_dir=tmp_path, backend_flags={"local": {"engine": "sglang"}})
    assert local_settings(flagged).engine == "sglang"


def test_listing_the_backends_options_imports_neither_torch_nor_an_sdk() -> None:
    """`clawbridge config show` lists every backend's options from the `clawbridge.backend_settings`
    entry points: the backends themselves (torch, tinker, fireworks) are not imported."""
    light = {ep.name for ep in metadata.entry_points(group=backend_mod.SETTINGS_ENTRY_POINT_GROUP)}
    if "local" not in light:
        pytest.skip("the installed clawbridge-local metadata predates its clawbridge.backend_settings entry point: "
                    "pip install -e backends/local --no-deps")
    code = ("import sys; from clawbridge.plugins import settings_models; models = settings_models(); "
            "print(sorted(n for n, m in models.items() if m is not None)); "
            "print(sorted(m for m in ('torch', 'transformers', 'tinker', 'fireworks') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=_env_without_clawbridge())
    assert r.returncode == 0, r.stderr
    listed, imported = (json.loads(line.replace("'", '"')) for line in r.stdout.splitlines())
    assert "local" in listed and imported == [], r.stdout


@pytest.mark.parametrize("backend", ["local", "tinker", "fireworks"])
def test_the_settings_entry_point_names_the_factorys_model(backend: str) -> None:
    """Each bundled backend declares its settings model twice (the factory's `settings_model`, read
    when the backend is selected, and the light entry point, read to list options): the same class."""
    project = tomllib.loads((ROOT / "backends" / backend / "pyproject.toml").read_text())
    groups = project["project"]["entry-points"]
    factory_mod, _, factory_name = groups[backend_mod.ENTRY_POINT_GROUP][backend].partition(":")
    model_mod, _, model_name = groups[backend_mod.SETTINGS_ENTRY_POINT_GROUP][backend].partition(":")
    pytest.importorskip(factory_mod, reason=f"the {backend} backend's dependencies are not installed")
    factory = getattr(import_module(factory_mod), factory_name)
    assert getattr(import_module(model_mod), model_name) is factory.settings_model


def test_a_factory_only_backend_is_listed_and_a_disagreement_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A third-party backend that declares its model only on the factory is still listed (its
    factory is loaded for it); a light entry point naming another class is reported and the
    factory's model is used."""
    local_ep = metadata.EntryPoint("local", "clawbridge_local.backend:create", backend_mod.ENTRY_POINT_GROUP)
    monkeypatch.setattr(backend_mod, "available_backends", lambda: {"local": local_ep})
    monkeypatch.setattr(backend_mod, "_light_entry_points", lambda: {})
    assert settings_models() == {"local": LocalSettings}  # the fallback: the factory's attribute
    wrong = metadata.EntryPoint("local", "clawbridge_tinker.settings:TinkerSettings",
                                backend_mod.SETTINGS_ENTRY_POINT_GROUP)
    monkeypatch.setattr(backend_mod, "_light_entry_points", lambda: {"local": wrong})
    caplog.set_level(logging.WARNING, logger="clawbridge.backend")
    backend = load_backend("local", Settings(state_dir=tmp_path, model="m", backends={"local": {"engine": "torch"}}))
    assert isinstance(backend, LocalBackend) and backend.options.engine == "torch"
    assert "names clawbridge_tinker.settings:TinkerSettings but its factory declares LocalSettings" in caplog.text


def test_nodes_and_replicas_are_checked_when_read() -> None:
    """`train_nnodes` must split `train_world_size` evenly and needs torchrun; one server or replicas, not both."""
    from pydantic import ValidationError

    assert LocalSettings(train_nnodes=2, train_world_size=4).train_nnodes == 2
    with pytest.raises(ValidationError, match="does not split over train_nnodes 2"):
        LocalSettings(train_nnodes=2, train_world_size=3)
    with pytest.raises(ValidationError, match="needs train_launcher torchrun"):
        LocalSettings(train_nnodes=2, train_world_size=2, train_launcher="inprocess")
    with pytest.raises(ValidationError, match="not both"):
        LocalSettings(sglang_url="http://127.0.0.1:1", sglang_urls=["http://127.0.0.1:2"])
