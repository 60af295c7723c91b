"""`clawbridge openclaw install/uninstall/status` logic and the JSON5 editor under it."""

from __future__ import annotations

import json
import sqlite3
import stat
from pathlib import Path

import pytest

from clawbridge.openclaw import install_status, installer, json5edit
from clawbridge.openclaw.runtime_line import parse_runtime_session, validate_session_headers
from clawbridge.runtime.address import base_url_for

USER_CONFIG = """// my OpenClaw config
{
  // the gateway I use every day
  gateway: { port: 18789, bind: 'loopback' }, /* keep this */
  agents: {
    defaults: {
      model: { primary: 'anthropic/claude-opus-4-6' }, // my usual model
    },
  },
  models: {
    providers: {
      ollama: { baseUrl: 'http://127.0.0.1:11434', apiKey: 'ollama-local', models: [] },
    },
  },
  plugins: {
    allow: ['voice-call'],
    entries: { 'voice-call': { enabled: true } },
  },
}
"""


def _opts(cfg: Path, **kw: object) -> installer.InstallOptions:
    base: dict[str, object] = {
        "api_key": "cb-test-key",
        "config_path": cfg,
        "base_url": "http://127.0.0.1:9999/v1",
        "model_id": "tiny",
        "context_window": 4096,
        "max_tokens": 256,
    }
    base.update(kw)
    return installer.InstallOptions(**base)  # type: ignore[arg-type]


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    path = tmp_path / "oc" / "openclaw.json"
    path.parent.mkdir()
    path.write_text(USER_CONFIG)
    path.chmod(0o640)
    return path


def test_json5_reader_accepts_openclaw_style() -> None:
    text = "{a: 1, 'b': [0x10, +1.5, .5, Infinity,], /* c */ \"c\": {d: null, e: 'x\\ny'}, // t\n}"
    value = json5edit.loads(text)
    assert value["a"] == 1 and value["b"][:3] == [16, 1.5, 0.5] and value["b"][3] == float("inf")
    assert value["c"] == {"d": None, "e": "x\ny"}
    assert json5edit.loads("") == {}
    with pytest.raises(json5edit.Json5Error, match="line 1"):
        json5edit.loads("{a: }")


def test_json5_edits_round_trip_and_keep_comments() -> None:
    text = USER_CONFIG
    edited = json5edit.set_value(text, ["models", "providers", "x"], {"baseUrl": "u"})
    edited = json5edit.append(edited, ["plugins", "allow"], "x")
    edited = json5edit.set_value(edited, ["gateway", "mode"], "local")
    assert json5edit.loads(edited)["models"]["providers"]["x"] == {"baseUrl": "u"}
    for fragment in (
        "// my OpenClaw config",
        "/* keep this */",
        "// my usual model",
        "'anthropic/claude-opus-4-6'",
    ):
        assert fragment in edited
    back = json5edit.delete(edited, ["models", "providers", "x"])
    back = json5edit.remove(back, ["plugins", "allow"], "x")
    back = json5edit.delete(back, ["gateway", "mode"])
    assert back == text


def test_install_edits_config_preserving_everything_else(cfg: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    result = installer.install(state, _opts(cfg))
    text = cfg.read_text()
    data = json5edit.loads(text)
    for fragment in (
        "// my OpenClaw config",
        "/* keep this */",
        "// my usual model",
        "// the gateway I use every day",
    ):
        assert fragment in text
    provider = data["models"]["providers"]["clawbridge"]
    assert provider["baseUrl"] == "http://127.0.0.1:9999/v1"
    assert provider["apiKey"] == "cb-test-key"
    assert provider["api"] == "openai-completions"
    assert provider["models"][0]["id"] == "tiny"
    assert provider["models"][0]["contextWindow"] == 4096 and provider["models"][0]["maxTokens"] == 256
    assert data["models"]["providers"]["ollama"]["apiKey"] == "ollama-local"
    assert data["plugins"]["entries"]["clawbridge"] == {
        "enabled": True,
        "hooks": {"allowConversationAccess": True},
    }
    assert data["plugins"]["entries"]["voice-call"] == {"enabled": True}
    assert data["plugins"]["allow"] == ["voice-call", "clawbridge"]  # user has an allowlist: appended
    ext = result.extension_dir
    assert data["plugins"]["load"]["paths"] == [str(ext)]
    assert {p.name for p in ext.iterdir()} >= {"package.json", "openclaw.plugin.json", "index.js"}
    assert data["agents"]["defaults"]["model"]["primary"] == "anthropic/claude-opus-4-6"  # no --set-default
    assert data["gateway"] == {"port": 18789, "bind": "loopback"}
    # backed up first, byte for byte, and the mode kept
    assert result.backup_path is not None and result.backup_path.read_text() == USER_CONFIG
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o640
    assert result.changed


def test_install_is_idempotent(cfg: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    installer.install(state, _opts(cfg))
    once = cfg.read_text()
    backups = sorted(cfg.parent.glob("openclaw.json.clawbridge-backup-*"))
    again = installer.install(state, _opts(cfg))
    assert again.changed == [] and again.backup_path is None
    assert cfg.read_text() == once
    assert sorted(cfg.parent.glob("openclaw.json.clawbridge-backup-*")) == backups
    assert json5edit.loads(once)["plugins"]["allow"].count("clawbridge") == 1


def test_uninstall_restores_exactly(cfg: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    result = installer.install(state, _opts(cfg, set_default=True))
    assert json5edit.loads(cfg.read_text())["agents"]["defaults"]["model"]["primary"] == "clawbridge/tiny"
    installer.install(state, _opts(cfg, set_default=True, base_url="http://127.0.0.1:8401/v1"))  # an update
    undone = installer.uninstall(state, cfg)
    assert undone.kept == []
    assert cfg.read_text() == USER_CONFIG
    assert not result.extension_dir.exists()
    assert installer.load_records(state)["installs"] == {}
    assert installer.uninstall(state, cfg).was_installed is False


def test_uninstall_keeps_what_the_user_changed_after_install(cfg: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    installer.install(state, _opts(cfg, set_default=True))
    text = json5edit.set_value(cfg.read_text(), ["agents", "defaults", "model", "primary"], "openai/gpt-5")
    cfg.write_text(text)
    undone = installer.uninstall(state, cfg)
    data = json5edit.loads(cfg.read_text())
    assert data["agents"]["defaults"]["model"]["primary"] == "openai/gpt-5"
    assert undone.kept == ["agents.defaults.model.primary"]
    assert "clawbridge" not in data["models"]["providers"]
    assert "clawbridge" not in data["plugins"]["entries"]


def test_install_into_missing_config_creates_it_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = tmp_path / "home" / ".openclaw" / "openclaw.json"
    result = installer.install(state, _opts(cfg, provider_id="cb2", set_default=True))
    assert result.created_config and result.backup_path is None
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600  # it holds the client key
    data = json5edit.loads(cfg.read_text())
    assert "allow" not in data["plugins"]  # no allowlist: none created
    assert data["plugins"]["entries"]["clawbridge"]["config"] == {"providerId": "cb2"}
    assert data["agents"]["defaults"]["model"]["primary"] == "cb2/tiny"
    result = installer.uninstall(state, cfg)
    # What install created (the file and the folders above it) is gone again, nothing else.
    assert result.deleted_config and not cfg.exists() and not (tmp_path / "home").exists()
    assert tmp_path.is_dir() and state.is_dir()


def test_uninstall_keeps_a_created_config_the_user_has_added_to(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = tmp_path / "home" / ".openclaw" / "openclaw.json"
    installer.install(state, _opts(cfg))
    cfg.write_text(json5edit.set_value(cfg.read_text(), ["gateway", "port"], 18789))
    (cfg.parent / "notes.txt").write_text("mine")
    result = installer.uninstall(state, cfg)
    assert not result.deleted_config and json5edit.loads(cfg.read_text()) == {"gateway": {"port": 18789}}


def test_install_agent_as_user_sets_the_extension_option(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = tmp_path / "openclaw.json"
    installer.install(state, _opts(cfg, agent_as_user=True))
    assert json5edit.loads(cfg.read_text())["plugins"]["entries"]["clawbridge"]["config"] == {"agentAsUser": True}
    assert installer.uninstall(state, cfg).deleted_config and not cfg.exists()


def test_user_additions_under_created_objects_survive_uninstall(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = tmp_path / "openclaw.json"
    cfg.write_text("{}\n")
    installer.install(state, _opts(cfg))
    cfg.write_text(json5edit.set_value(cfg.read_text(), ["models", "providers", "mine"], {"baseUrl": "b"}))
    installer.uninstall(state, cfg)
    assert json5edit.loads(cfg.read_text()) == {"models": {"providers": {"mine": {"baseUrl": "b"}}}}


def test_invalid_config_is_refused_untouched(tmp_path: Path) -> None:
    cfg = tmp_path / "openclaw.json"
    cfg.write_text("{ broken: ")
    with pytest.raises(installer.InstallError, match="not valid JSON5"):
        installer.install(tmp_path / "state", _opts(cfg))
    assert cfg.read_text() == "{ broken: "


def test_config_path_resolution(tmp_path: Path) -> None:
    explicit = tmp_path / "x.json"
    env = {
        "HOME": str(tmp_path / "h"),
        "OPENCLAW_STATE_DIR": str(tmp_path / "s"),
        "OPENCLAW_CONFIG_PATH": str(tmp_path / "c.json"),
    }
    assert installer.resolve_config_path(explicit, env) == explicit
    assert installer.resolve_config_path(None, env) == tmp_path / "c.json"
    del env["OPENCLAW_CONFIG_PATH"]
    assert installer.resolve_config_path(None, env) == tmp_path / "s" / "openclaw.json"
    del env["OPENCLAW_STATE_DIR"]
    assert installer.resolve_config_path(None, env) == tmp_path / "h" / ".openclaw" / "openclaw.json"


def test_base_url_and_client_key(tmp_path: Path) -> None:
    assert base_url_for("127.0.0.1", 8400) == "http://127.0.0.1:8400/v1"
    assert base_url_for("0.0.0.0", 9) == "http://127.0.0.1:9/v1"
    assert base_url_for("::1", 9) == "http://[::1]:9/v1"
    assert installer.resolve_client_key(tmp_path, {"CLAWBRIDGE_API_KEY": "from-env"}) == "from-env"
    generated = installer.resolve_client_key(tmp_path, {})
    assert (tmp_path / "client_key").read_text().strip() == generated
    assert installer.resolve_client_key(tmp_path, {}) == generated


def test_status_reports_install_and_recent_headers(cfg: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert install_status.status(state, cfg)["installed"] is False
    installer.install(state, _opts(cfg))
    report = install_status.status(state, cfg)
    assert report["installed"] and report["extension_current"] and report["allowlist"] is True
    assert report["provider"]["baseUrl"] == "http://127.0.0.1:9999/v1"
    assert report["recent_calls"] is None  # no store yet
    from clawbridge.store import DB_FILENAME, Store

    Store(state / DB_FILENAME).close()  # an empty store with the real schema
    db = sqlite3.connect(state / DB_FILENAME)
    db.execute(
        "INSERT INTO sessions(session_id, source, status, created_at, updated_at) "
        "VALUES('agent:main:main','header','active',1,1), ('sess_x','implicit','ended',1,1)"
    )
    rows = [
        ("t1", "agent:main:main", 0, "main", {"trigger": "user", "turn_id_header": "r:model:1"}),
        ("t2", "agent:main:main", 1, "side", {"trigger": "heartbeat"}),
        ("t3", "sess_x", 0, "main", None),
    ]
    for turn_id, sid, seq, ttype, meta in rows:
        db.execute(
            "INSERT INTO turns(turn_id, session_id, seq, turn_type, status, model, prompt_token_ids, "
            "completion_token_ids, completion_logprobs, policy_version, request_json, meta_json, "
            "prompt_tokens, completion_tokens, created_at, completed_at) "
            "VALUES(?,?,?,?, 'ok', 'tiny', x'', x'', x'', 0, '{}', ?, 0, 0, ?, ?)",
            (turn_id, sid, seq, ttype, json.dumps(meta) if meta else None, seq, 10 + seq),
        )
    db.commit()
    db.close()
    calls = install_status.status(state, cfg)["recent_calls"]
    assert calls["turns"] == 3 and calls["with_turn_headers"] == 2 and calls["in_header_sessions"] == 2
    assert calls["triggers"] == {"user": 1, "heartbeat": 1}
    assert calls["main"] == 2 and calls["side"] == 1


def test_parse_runtime_session_from_openclaw_first_user_message() -> None:
    # Shape observed from OpenClaw 2026.9.6 (`agent --local --session-id s1`).
    first = (
        "[Sun 2026-11-22 02:14 UTC] hi there\n\nRuntime: agent=main | session=agent:main:explicit:s1 | "
        "sessionId=s1 | host=vm | repo=/w | os=Linux 6 (x64) | node=v24.19.0 | model=clawbridge/tiny | shell=bash"
    )
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": first},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second"},
    ]
    assert parse_runtime_session(messages) == "agent:main:explicit:s1"
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": first}]}
    ]
    assert parse_runtime_session(parts) == "agent:main:explicit:s1"
    assert (
        parse_runtime_session(
            [{"role": "user", "content": "no runtime here"}, {"role": "user", "content": first}]
        )
        is None
    )
    assert (
        parse_runtime_session([{"role": "user", "content": "x Runtime: session=a | y"}]) is None
    )  # not a line start
    assert parse_runtime_session([{"role": "user", "content": "Runtime: agent=main | sessionId=s1"}]) is None
    assert parse_runtime_session([]) is None


@pytest.mark.parametrize(
    ("session_id", "turn_type", "problem"),
    [
        (None, None, None),
        ("agent:main:main", "main", None),
        ("agent:main:explicit:s1", " Side ", None),
        ("", None, "empty"),
        ("   ", None, "empty"),
        ("x" * 257, None, "limit"),
        ("a\x00b", None, "control"),
        ("a\tb", None, "control"),
        ("a b", None, "characters"),
        ("ok", "primary", "main, side"),
        ("ok", "", "main, side"),
    ],
)
def test_validate_session_headers(session_id: str | None, turn_type: str | None, problem: str | None) -> None:
    message = validate_session_headers(session_id, turn_type)
    if problem is None:
        assert message is None
    else:
        assert message is not None and problem in message


def test_cli_install_status_uninstall(cfg: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from clawbridge.cli.openclaw_cmd import app

    monkeypatch.delenv("CLAWBRIDGE_API_KEY", raising=False)
    state = tmp_path / "state"
    common = ["--openclaw-config", str(cfg), "--state-dir", str(state)]
    runner = CliRunner()
    result = runner.invoke(app, ["install", *common, "--base-url", "http://127.0.0.1:9/v1", "--set-default"])
    assert result.exit_code == 0, result.output
    data = json5edit.loads(cfg.read_text())
    provider = data["models"]["providers"]["clawbridge"]
    assert provider["apiKey"] == (state / "client_key").read_text().strip()
    assert provider["apiKey"] not in result.output  # the key is never printed
    assert provider["models"][0]["contextWindow"] == installer.DEFAULT_CONTEXT_WINDOW  # server not answering
    assert data["agents"]["defaults"]["model"]["primary"] == "clawbridge/default"
    status = runner.invoke(app, ["status", *common, "--json"])
    assert status.exit_code == 0, status.output
    assert json.loads(status.stdout)["installed"] is True  # stdout: the JSON; stderr: which state dir
    assert runner.invoke(app, ["uninstall", *common]).exit_code == 0
    assert cfg.read_text() == USER_CONFIG
