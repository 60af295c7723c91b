"""`clawbridge openclaw install` on each path a user can be on: no OpenClaw at all (the newcomer),
OpenClaw's CLI on PATH (the plugin part goes through `openclaw plugins install --link`), and a
plugin that OpenClaw installed itself from our tarball. OpenClaw's CLI is `FakeOpenClawCli` here
(it edits the file as the real one does); tests/test_openclaw_plugin_package.py runs the real one.
"""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clawbridge.cli.openclaw_cmd import app
from clawbridge.openclaw import install_status, installer, json5edit
from clawbridge.openclaw.openclaw_cli import FakeOpenClawCli

COMMENTED = "// my OpenClaw config\n{\n  gateway: { port: 18789 }, // keep\n}\n"


def _opts(cfg: Path, **kw: object) -> installer.InstallOptions:
    base: dict[str, object] = {"api_key": "cb-test-key", "config_path": cfg, "model_id": "tiny"}
    base.update(kw)
    return installer.InstallOptions(**base)  # type: ignore[arg-type]


@pytest.fixture
def newcomer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME with no OpenClaw in it and no `openclaw` on PATH."""
    home = tmp_path / "home"
    home.mkdir()
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PATH", str(empty_bin))
    for name in ("OPENCLAW_CONFIG_PATH", "OPENCLAW_STATE_DIR", "CLAWBRIDGE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    return home


def test_newcomer_install_says_what_it_wrote_where_and_how_to_undo(newcomer: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    runner = CliRunner()
    result = runner.invoke(app, ["install", "--state-dir", str(state), "--base-url", "http://127.0.0.1:9/v1"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())  # rich wraps long lines
    cfg = newcomer / ".openclaw" / "openclaw.json"
    key = (state / "client_key").read_text().strip()
    assert json5edit.loads(cfg.read_text())["models"]["providers"]["clawbridge"]["apiKey"] == key
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600
    assert key not in result.output
    assert "`openclaw`) is not on PATH" in out and "edited by hand" in out
    assert f"created {cfg}" in out and "client key" in out and "models.providers.clawbridge.apiKey" in out
    assert f"extension files copied to {(state / 'openclaw' / 'extension').resolve()}" in out
    assert f"recorded in {state / 'openclaw' / 'install.json'}" in out
    assert "to undo: `clawbridge openclaw uninstall`" in out and "deletes the file it created" in out

    undo = runner.invoke(app, ["uninstall", "--state-dir", str(state)])
    assert undo.exit_code == 0, undo.output
    assert f"deleted {cfg}" in " ".join(undo.output.split())
    assert not cfg.exists() and not (newcomer / ".openclaw").exists()
    assert not (state / "openclaw" / "extension").exists()


def test_the_plugin_part_goes_through_openclaws_cli(tmp_path: Path) -> None:
    state, cfg = tmp_path / "state", tmp_path / "oc" / "openclaw.json"
    cfg.parent.mkdir()
    cfg.write_text(COMMENTED)
    cli = FakeOpenClawCli()
    result = installer.install(state, _opts(cfg), cli)
    ext = (state / "openclaw" / "extension").resolve()
    assert cli.calls == [["plugins", "install", "--link", str(ext), "--force", "--accept-capabilities"]]
    assert result.openclaw_command == ["openclaw", *cli.calls[0]]
    data = json5edit.loads(cfg.read_text())
    assert data["plugins"]["load"]["paths"] == [str(ext)]
    # OpenClaw enables the plugin; the conversation-hook grant and the provider are ours to write.
    assert data["plugins"]["entries"]["clawbridge"] == {"enabled": True, "hooks": {"allowConversationAccess": True}}
    assert data["models"]["providers"]["clawbridge"]["apiKey"] == "cb-test-key"
    assert data["gateway"] == {"port": 18789}
    # OpenClaw drops comments; the one backup is the file as the user had it.
    assert result.backups and result.backups[0].read_text() == COMMENTED and len(result.backups) == 1
    assert install_status.status(state, cfg)["installed"] is True

    again = installer.install(state, _opts(cfg), cli)
    assert len(cli.calls) == 1 and again.changed == [] and again.openclaw_command is None

    undone = installer.uninstall(state, cfg, cli)
    assert cli.calls[-1] == ["plugins", "uninstall", "clawbridge", "--force"]
    assert undone.openclaw_command == ["openclaw", *cli.calls[-1]] and undone.kept == []
    data = json5edit.loads(cfg.read_text())
    assert "providers" not in data.get("models", {}) and "load" not in data["plugins"]
    assert data["plugins"]["entries"]["clawbridge"] == {"enabled": False}  # what OpenClaw leaves
    assert not ext.exists()


def test_openclaw_failing_leaves_the_config_as_it_was(tmp_path: Path) -> None:
    state, cfg = tmp_path / "state", tmp_path / "openclaw.json"
    cfg.write_text(COMMENTED)
    cli = FakeOpenClawCli(fail="`openclaw plugins install ...` exited 1: capability consent required")
    with pytest.raises(installer.InstallError, match=r"capability consent required.*--openclaw-cli none"):
        installer.install(state, _opts(cfg), cli)
    assert cfg.read_text() == COMMENTED
    assert installer.load_records(state)["installs"] == {}


def test_uninstall_without_openclaw_after_a_cli_install_says_what_is_left(tmp_path: Path) -> None:
    state, cfg = tmp_path / "state", tmp_path / "openclaw.json"
    cfg.write_text("{}\n")
    installer.install(state, _opts(cfg), FakeOpenClawCli())
    result = installer.uninstall(state, cfg, None)
    data = json5edit.loads(cfg.read_text())
    assert data["plugins"].get("load", {}).get("paths", []) == []  # the load path is removed by hand
    assert any("openclaw plugins uninstall clawbridge" in item for item in result.leftover)


def test_a_plugin_openclaw_installed_itself_is_left_alone(tmp_path: Path) -> None:
    """`openclaw plugins install ./clawbridge-openclaw-0.1.0.tgz`, then `clawbridge openclaw install`."""
    state, cfg = tmp_path / "state", tmp_path / "oc" / "openclaw.json"
    managed = cfg.parent / "extensions" / "clawbridge"
    managed.mkdir(parents=True)
    for name in installer.EXTENSION_FILES:
        shutil.copyfile(installer.find_extension_source() / name, managed / name)
    cfg.write_text(json.dumps({"plugins": {"entries": {"clawbridge": {"enabled": True}}}}))
    cli = FakeOpenClawCli()
    result = installer.install(state, _opts(cfg), cli)
    assert cli.calls == [] and result.plugin_managed_by_openclaw and result.extension_dir == managed.resolve()
    data = json5edit.loads(cfg.read_text())
    assert "load" not in data["plugins"] and not (state / "openclaw" / "extension").exists()
    assert data["plugins"]["entries"]["clawbridge"]["hooks"] == {"allowConversationAccess": True}
    report = install_status.status(state, cfg)
    assert report["installed"] is True and report["extension_current"] is True

    undone = installer.uninstall(state, cfg, cli)
    assert cli.calls == [] and managed.is_dir()
    assert json5edit.loads(cfg.read_text()) == {"plugins": {"entries": {"clawbridge": {"enabled": True}}}}
    assert any("openclaw plugins uninstall clawbridge" in item for item in undone.leftover)


def test_which_openclaw_cli_is_used(tmp_path: Path) -> None:
    from clawbridge.openclaw.openclaw_cli import OpenClawCliError, SubprocessOpenClawCli, find_openclaw_cli

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    assert find_openclaw_cli("auto", path=str(bin_dir)) is None  # none on PATH: edit by hand
    exe = bin_dir / "openclaw"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    found = find_openclaw_cli("auto", path=str(bin_dir))
    assert isinstance(found, SubprocessOpenClawCli) and found.executable == exe
    assert find_openclaw_cli("none", path=str(bin_dir)) is None
    assert find_openclaw_cli(str(exe)) == SubprocessOpenClawCli(exe)
    with pytest.raises(OpenClawCliError, match="no such file"):
        find_openclaw_cli(str(tmp_path / "missing"))


def test_a_failing_openclaw_executable_is_reported_with_its_output(tmp_path: Path) -> None:
    from clawbridge.openclaw.openclaw_cli import SubprocessOpenClawCli

    exe = tmp_path / "openclaw"
    exe.write_text('#!/bin/sh\necho "config is $OPENCLAW_CONFIG_PATH" >&2\necho "Install cancelled" >&2\nexit 3\n')
    exe.chmod(0o755)
    state, cfg = tmp_path / "state", tmp_path / "oc" / "openclaw.json"
    cfg.parent.mkdir()
    cfg.write_text(COMMENTED)
    with pytest.raises(installer.InstallError) as raised:
        installer.install(state, _opts(cfg), SubprocessOpenClawCli(exe, timeout_s=60))
    message = str(raised.value)
    assert "exited 3" in message and "Install cancelled" in message and f"config is {cfg}" in message
    assert cfg.read_text() == COMMENTED
