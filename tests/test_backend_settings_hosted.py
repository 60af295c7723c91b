"""The tinker and fireworks backends' options live in their own sections (`[backends.tinker]`,
`[backends.fireworks]`), read by their own settings models: same environment names as before, old
flat keys refused naming where they moved, keys masked, CLI flags over the environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clawbridge_fireworks.settings import FireworksSettings, fireworks_settings
from clawbridge_tinker.settings import TinkerSettings, tinker_settings
from pydantic import ValidationError

from clawbridge.backend_settings import BackendSettingsError
from clawbridge.config import OptionMoved, Settings, load_settings, masked_section
from clawbridge.plugins import load_backend, settings_models, trained_model
from clawbridge.trainer.identity import checkpoint_identity


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "clawbridge.toml"
    path.write_text(text)
    return path


def test_the_backends_declare_their_settings_models() -> None:
    models = settings_models()
    assert models["tinker"] is TinkerSettings and models["fireworks"] is FireworksSettings
    assert not [name for name in Settings.model_fields if name.startswith(("tinker_", "fireworks_"))]


def test_toml_section_env_and_the_usual_key_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _toml(tmp_path, '[backends.tinker]\nbase_url = "http://127.0.0.1:7001"\nmax_retries = 5\n'
                '[backends.fireworks]\ntraining_shape = "accounts/a/trainingShapes/s"\nyes = true\n')
    monkeypatch.setenv("CLAWBRIDGE_TINKER_MAX_RETRIES", "7")  # the old variable name, over the file
    monkeypatch.setenv("TINKER_API_KEY", "tml-from-env")
    monkeypatch.setenv("CLAWBRIDGE_TINKER_API_KEY", "tml-second-choice")
    monkeypatch.setenv("FIREWORKS_ACCOUNT_ID", "acct-env")
    monkeypatch.setenv("CLAWBRIDGE_FIREWORKS_POLL_INTERVAL_S", "0.5")
    settings = load_settings(cfg)
    tinker = tinker_settings(settings)
    assert tinker.base_url == "http://127.0.0.1:7001" and tinker.max_retries == 7
    assert tinker.api_key_value() == "tml-from-env"  # TINKER_API_KEY first, as before
    assert tinker.step_timeout_s == 900.0  # defaults unchanged
    fw = fireworks_settings(settings)
    assert (fw.training_shape, fw.yes, fw.account_id, fw.poll_interval_s) == ("accounts/a/trainingShapes/s", True,
                                                                              "acct-env", 0.5)
    assert fw.api_key is None and fw.base_url == "https://api.fireworks.ai"


@pytest.mark.parametrize(
    ("key", "value", "section", "option"),
    [("tinker_base_url", '"http://h"', "tinker", "base_url"),
     ("tinker_api_key", '"tml-x"', "tinker", "api_key"),
     ("fireworks_yes", "true", "fireworks", "yes"),
     ("fireworks_training_shape", '"accounts/a/trainingShapes/s"', "fireworks", "training_shape")],
)
def test_an_old_flat_key_is_refused_naming_where_it_moved(
    tmp_path: Path, key: str, value: str, section: str, option: str
) -> None:
    cfg = _toml(tmp_path, f"port = 9001\n{key} = {value}\n")
    with pytest.raises(OptionMoved) as info:
        load_settings(cfg)
    message = str(info.value)
    assert f"option '{key}' moved" in message and f"set `{option}` under `[backends.{section}]`" in message
    assert f"CLAWBRIDGE_{section.upper()}_{option.upper()} is unchanged" in message
    assert value.strip('"') not in message  # no value printed: a key would be among them
    with pytest.raises(OptionMoved, match=f"under `\\[backends.{section}\\]`"):
        Settings(state_dir=tmp_path, **{key: json.loads(value)})  # in code too


def test_an_old_flat_key_stops_the_cli_with_the_new_place(tmp_path: Path) -> None:
    cfg = _toml(tmp_path, 'tinker_base_url = "http://127.0.0.1:7001"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWBRIDGE_")}
    r = subprocess.run([sys.executable, "-m", "clawbridge.cli.main", "config", "show", "--config", str(cfg),
                        "--state-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    out = " ".join(r.stderr.split())
    assert r.returncode == 2, out
    assert "configuration error" in out and "set `base_url` under `[backends.tinker]`" in out, out


def test_an_unknown_top_level_key_is_still_refused_as_before(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        load_settings(_toml(tmp_path, "no_such_option = 1\n"))


def test_a_bad_value_names_the_section_option_and_its_variables(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWBRIDGE_TINKER_MAX_RETRIES", "many")
    settings = Settings(backend="tinker", state_dir=tmp_path, model="m")
    with pytest.raises(BackendSettingsError, match=r"backends\.tinker\.max_retries \(env CLAWBRIDGE_TINKER_MAX_RETRIES\)"):
        load_backend("tinker", settings)
    bad = Settings(state_dir=tmp_path, backends={"fireworks": {"grad_accumulation_normalization": "mean"}})
    with pytest.raises(BackendSettingsError, match=r"backends\.fireworks\.grad_accumulation_normalization"):
        fireworks_settings(bad)
    typo = Settings(state_dir=tmp_path, backends={"fireworks": {"training_shpe": "x"}})
    with pytest.raises(BackendSettingsError, match=r"unknown option\(s\) backends\.fireworks\.training_shpe"):
        fireworks_settings(typo)


def test_the_yes_flag_wins_over_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWBRIDGE_FIREWORKS_YES", "0")
    assert fireworks_settings(load_settings(state_dir=tmp_path)).yes is False
    flagged = load_settings(state_dir=tmp_path, backend_flags={"fireworks": {"yes": True}})
    assert fireworks_settings(flagged).yes is True
    assert fireworks_settings(flagged.model_copy(update={"probe_timeout_s": 1.0})).yes is True


def test_keys_are_masked_wherever_settings_are_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIREWORKS_API_KEY", "fw-live-secret")
    monkeypatch.setenv("FIREWORKS_ACCOUNT_ID", "acct-1")
    shown = masked_section(fireworks_settings(Settings(state_dir=tmp_path)))
    assert shown["api_key"] == "***" and shown["account_id"] == "acct-1"
    assert masked_section(tinker_settings(Settings(state_dir=tmp_path)))["api_key"] is None  # unset: null
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWBRIDGE_")}
    r = subprocess.run([sys.executable, "-m", "clawbridge.cli.main", "config", "show", "--json", "--state-dir",
                        str(tmp_path)], capture_output=True, text=True, env=env, timeout=120, check=True)
    conf = json.loads(r.stdout)
    assert conf["backends"]["fireworks"]["api_key"] == "***" and conf["backends"]["fireworks"]["yes"] is False
    assert conf["backends"]["tinker"]["base_url"] == ""
    r = subprocess.run([sys.executable, "-m", "clawbridge.cli.main", "config", "show", "--state-dir", str(tmp_path)],
                       capture_output=True, text=True, env={**env, "COLUMNS": "300"}, timeout=120, check=True)
    table = " ".join(r.stdout.split())
    assert "backends.fireworks.api_key" in table and "FIREWORKS_API_KEY" in table
    assert "fw-live-secret" not in r.stdout + r.stderr


def test_the_checkpoint_identity_names_tinkers_own_base_model(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(state_dir=tmp_path, model="tok-and-model")
    assert trained_model(settings, "tinker") == "tok-and-model"
    monkeypatch.setenv("CLAWBRIDGE_TINKER_BASE_MODEL", "Qwen/Qwen3-8B")
    assert checkpoint_identity(settings, "tinker")["model"] == "Qwen/Qwen3-8B"
    assert checkpoint_identity(settings, "fireworks")["model"] == "tok-and-model"  # fireworks trains `model`
    assert checkpoint_identity(settings, "fake-training")["model"] == "tok-and-model"
