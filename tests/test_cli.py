"""The CLI as a user runs it: help, config precedence and masking, sessions, rewards, status."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clawbridge.sources import resolve_source
from clawbridge.store import Store, TurnRecord


def cli(*args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWBRIDGE_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "clawbridge.cli.main", *args], capture_output=True, text=True,
                          env=full_env, check=check, timeout=120)


@pytest.mark.parametrize("cmd", [[], ["up"], ["status"], ["sessions"], ["sessions", "show"], ["sessions", "export"],
                                 ["reward"], ["model", "tiny"], ["config", "show"], ["users"], ["users", "forget"]])
def test_every_command_has_help(cmd: list[str]) -> None:
    out = cli(*cmd, "--help").stdout
    assert "Usage" in out and len(out) > 200


def test_config_show_precedence_and_masking(tmp_path: Path) -> None:
    toml = tmp_path / "clawbridge.toml"
    toml.write_text('port = 9001\nhost = "127.0.0.1"\nmodel = "from-toml"\napi_key = "toml-secret-key"\n')
    out = cli("config", "show", "--json", "--config", str(toml), "--state-dir", str(tmp_path),
              env={"CLAWBRIDGE_MODEL": "from-env", "TINKER_API_KEY": "tinker-secret", "FIREWORKS_ACCOUNT_ID": "acct"})
    conf = json.loads(out.stdout)
    assert conf["port"] == 9001 and conf["model"] == "from-env" and conf["state_dir"] == str(tmp_path)
    assert conf["api_key"] == "***" and conf["backends"]["tinker"]["api_key"] == "***"
    assert conf["backends"]["fireworks"]["account_id"] == "acct"
    assert "secret" not in out.stdout + out.stderr
    bad = cli("config", "show", "--config", str(tmp_path / "missing.toml"), check=False)
    assert bad.returncode == 2 and "not found" in bad.stderr
    toml.write_text("port = 'not a number'\n")
    bad = cli("config", "show", "--config", str(toml), check=False)
    assert bad.returncode == 2 and "port" in bad.stderr


def _seed_store(state: Path) -> None:
    store = Store.open(state)
    now = time.time()
    for i in range(2):
        store.record_turn(TurnRecord(
            session_id="cli-s", turn_type="main", status="ok", model="m", prompt_token_ids=[1, 2],
            completion_token_ids=[3, 4], completion_logprobs=[-0.5, -0.25], policy_version=0,
            finish_reason="stop", request_json='{"messages": [{"role": "user", "content": "x"}]}',
            response_json='{"choices": []}', created_at=now + i, completed_at=now + i + 0.1), "header")
    store.close()


def test_sessions_reward_and_status_read_the_store(tmp_path: Path) -> None:
    _seed_store(tmp_path)
    listed = json.loads(cli("sessions", "list", "--json", "--state-dir", str(tmp_path)).stdout)
    assert [s["session_id"] for s in listed] == ["cli-s"] and listed[0]["turn_count"] == 2
    assert "cli-s" in cli("sessions", "list", "--state-dir", str(tmp_path)).stdout

    out = cli("reward", "cli-s", "1.5", "--state-dir", str(tmp_path)).stdout
    assert "1.5" in out
    cli("reward", "cli-s", "-1", "--session", "--state-dir", str(tmp_path))
    view = json.loads(cli("sessions", "show", "cli-s", "--json", "--state-dir", str(tmp_path)).stdout)
    assert set(view) >= {"session_id", "status", "turns", "rewards"}
    assert [t["reward"] for t in view["turns"]] == [None, 1.5]
    assert view["turns"][0]["completion_logprobs"] == [-0.5, -0.25]
    assert [r["value"] for r in view["rewards"]] == [1.5, -1.0]

    bad = cli("reward", "no-such", "1", "--state-dir", str(tmp_path), check=False)
    assert bad.returncode == 1 and "no answered turn" in bad.stderr
    bad = cli("reward", "cli-s", "nan", "--state-dir", str(tmp_path), check=False)
    assert bad.returncode == 2
    assert cli("sessions", "show", "nope", "--state-dir", str(tmp_path), check=False).returncode == 1

    out_file = tmp_path / "export.jsonl"
    cli("sessions", "export", str(out_file), "--state-dir", str(tmp_path))
    lines = out_file.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["session_id"] == "cli-s"

    status = json.loads(cli("status", "--json", "--state-dir", str(tmp_path), env={"CLAWBRIDGE_PORT": "1"}).stdout)
    assert status["running"] is False and status["store"]["turns"]["main"] == 2 and status["store"]["rewards"] == 2
    assert "2 main" in cli("status", "--state-dir", str(tmp_path), env={"CLAWBRIDGE_PORT": "1"}).stdout


def test_model_tiny_builds_offline(tmp_path: Path) -> None:
    out = cli("model", "tiny", str(tmp_path / "m")).stdout
    assert "parameters" in out
    assert (tmp_path / "m" / "model.safetensors").exists() and (tmp_path / "m" / "tokenizer.json").exists()


def test_up_without_model_or_backend_explains(tmp_path: Path) -> None:
    r = cli("up", "--state-dir", str(tmp_path), check=False)
    assert r.returncode == 2 and "--model" in r.stderr
    r = cli("up", "--backend", "fireworks", "--model", "x", "--state-dir", str(tmp_path), check=False,
            env={"PYTHONPATH": ""})
    if r.returncode != 0:  # fireworks may be installed in a full dev env; when missing, the error names the package
        assert "backends/fireworks" in r.stderr or "cannot start" in r.stderr
    r = cli("up", "--host", "0.0.0.0", "--model", "x", "--state-dir", str(tmp_path), check=False)
    assert r.returncode == 1 and "refusing to bind" in r.stderr
    missing = tmp_path / "no-such-model"
    r = cli("up", "--model", str(missing), "--port", "1", "--state-dir", str(tmp_path), check=False)
    assert r.returncode != 0 and "does not exist" in r.stdout + r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "server.json").exists()


@pytest.mark.parametrize(("value", "problem"), [
    ("./typo-model", "does not exist"), ("~/no/such/dir", "does not exist"), (__file__, "is a file"),
    ("Qwen/Qwen3-8B", None), ("tiny", None),
])
def test_model_source_tells_missing_folders_from_hub_ids(value: str, problem: str | None) -> None:
    if problem is None:
        assert resolve_source(value) == (value, False)
    else:
        with pytest.raises(ValueError, match=problem):
            resolve_source(value)


def test_doctor_names_what_to_fix(tmp_path: Path) -> None:
    r = cli("doctor", "--backend", "tinker", "--state-dir", str(tmp_path), check=False)
    assert r.returncode == 1
    assert "ok   state dir" in r.stdout and "FAIL TINKER_API_KEY is not set: export TINKER_API_KEY" in r.stdout
    r = cli("doctor", "--backend", "fireworks", "--state-dir", str(tmp_path), check=False)
    assert r.returncode == 1 and "FIREWORKS_API_KEY" in r.stdout
    r = cli("doctor", "--backend", "nosuch", "--state-dir", str(tmp_path), check=False)
    assert r.returncode == 1 and "not installed" in r.stdout
    (tmp_path / "client_key").write_text("k")
    (tmp_path / "client_key").chmod(0o644)
    r = cli("doctor", "--backend", "local", "--state-dir", str(tmp_path), check=False)
    assert "chmod 600" in r.stdout and r.returncode == 1


def test_doctor_advice_names_its_own_flags_and_checks_the_store(tmp_path: Path) -> None:
    """Every `--flag` doctor's advice names is one doctor takes, and it says what the store is."""
    r = cli("doctor", "--backend", "tinker", "--state-dir", str(tmp_path), check=False)
    advised = set(re.findall(r"(--[a-z][a-z-]+)", r.stdout))
    assert {"--model", "--tokenizer"} <= advised, r.stdout
    offered = cli("doctor", "--help").stdout
    assert not [flag for flag in advised if flag not in offered], (advised, offered)
    assert f"ok   store {tmp_path / 'clawbridge.db'}: none yet" in r.stdout
    r = cli("doctor", "--backend", "tinker", "--model", "Qwen/Qwen3-8B", "--state-dir", str(tmp_path), check=False)
    assert "no base model" not in r.stdout and "no tokenizer" not in r.stdout, r.stdout
    _seed_store(tmp_path)
    r = cli("doctor", "--backend", "local", "--state-dir", str(tmp_path), check=False)
    assert re.search(r"ok   store .*clawbridge\.db: intact \([\d,]+ bytes, quick_check ok\)", r.stdout), r.stdout
    (tmp_path / "clawbridge.db").write_bytes(b"not a database" * 100)
    r = cli("doctor", "--backend", "local", "--state-dir", str(tmp_path), check=False)
    assert r.returncode == 1 and "FAIL store" in r.stdout and "clawbridge store recover" in r.stdout, r.stdout
