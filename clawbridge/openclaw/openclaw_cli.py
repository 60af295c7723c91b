"""OpenClaw's own CLI, for the plugin part of `clawbridge openclaw install | uninstall`.

OpenClaw installs a plugin with `openclaw plugins install <path | .tgz | npm spec>`; `--link`
adds the directory to `plugins.load.paths` (what the installer otherwise writes by hand), records
the install in OpenClaw's own state and enables the plugin. When `openclaw` is on PATH, the
installer uses it for that part and writes only the rest (the provider block and the plugin's
`hooks.allowConversationAccess`, which OpenClaw leaves to the user) itself.

Invariants:
- Only two commands are run, each with `OPENCLAW_CONFIG_PATH` set to the file clawbridge edits
  (so both tools edit the same openclaw.json):
  `openclaw plugins install --link <dir> --force --accept-capabilities` (the user asked for this
  plugin by running `clawbridge openclaw install`: the flags confirm that source and its declared
  capabilities, which an unattended run cannot answer at a prompt), and
  `openclaw plugins uninstall <id> --force`.
- OpenClaw rewrites openclaw.json as plain JSON (it says "Config write will strip JSON5
  comments"); the installer backs the file up before calling it and says so.
- A command that fails or runs past its timeout raises `OpenClawCliError` with the command and the
  tail of its output; nothing is retried.

`FakeOpenClawCli` (below) edits the config file the way OpenClaw 2026.9.x does, for fast tests of
the installer; tests/test_openclaw_cli_install.py runs the real one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from clawbridge.openclaw import json5edit

CLI_TIMEOUT_S = 300.0
"""One OpenClaw command takes 15-60 s on a loaded 2-core machine (it loads every bundled plugin)."""


class OpenClawCliError(RuntimeError):
    """An `openclaw` command failed (the message has the command and its output's tail)."""


class OpenClawCli(Protocol):
    """The two plugin commands of OpenClaw's CLI that the installer uses."""

    def describe(self) -> str:
        """What runs (the executable's path), for the user."""
        ...

    def install_plugin(self, plugin_dir: Path, config_path: Path) -> list[str]:
        """Link-install the plugin in `plugin_dir` into `config_path`; return the argv it ran."""
        ...

    def uninstall_plugin(self, plugin_id: str, config_path: Path) -> list[str]:
        """Uninstall the plugin from `config_path`; return the argv it ran."""
        ...


def install_argv(plugin_dir: Path) -> list[str]:
    return ["plugins", "install", "--link", str(plugin_dir), "--force", "--accept-capabilities"]


def uninstall_argv(plugin_id: str) -> list[str]:
    return ["plugins", "uninstall", plugin_id, "--force"]


@dataclass
class SubprocessOpenClawCli:
    """The `openclaw` executable, run as a child process."""

    executable: Path
    timeout_s: float = CLI_TIMEOUT_S

    def describe(self) -> str:
        return str(self.executable)

    def _run(self, args: list[str], config_path: Path) -> list[str]:
        argv = [str(self.executable), *args]
        env = {**os.environ, "OPENCLAW_CONFIG_PATH": str(config_path)}
        try:
            proc = subprocess.run(
                argv, env=env, capture_output=True, text=True, timeout=self.timeout_s, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            raise OpenClawCliError(f"`openclaw {' '.join(args)}` ran past {self.timeout_s:.0f} s") from None
        except OSError as exc:
            raise OpenClawCliError(f"cannot run {self.executable}: {exc}") from None
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip()[-2000:]
            raise OpenClawCliError(f"`openclaw {' '.join(args)}` exited {proc.returncode}:\n{tail}")
        return ["openclaw", *args]

    def install_plugin(self, plugin_dir: Path, config_path: Path) -> list[str]:
        return self._run(install_argv(plugin_dir), config_path)

    def uninstall_plugin(self, plugin_id: str, config_path: Path) -> list[str]:
        return self._run(uninstall_argv(plugin_id), config_path)


def find_openclaw_cli(choice: str = "auto", path: str | None = None) -> OpenClawCli | None:
    """The CLI to use: `auto` = `openclaw` on PATH (None when absent), `none` = never, else a path."""
    if choice == "none":
        return None
    if choice == "auto":
        found = shutil.which("openclaw", path=path)
        return SubprocessOpenClawCli(Path(found)) if found else None
    executable = Path(os.path.expanduser(choice))
    if not executable.is_file():
        raise OpenClawCliError(f"--openclaw-cli {choice}: no such file")
    return SubprocessOpenClawCli(executable)


@dataclass
class FakeOpenClawCli:
    """Does to openclaw.json what OpenClaw 2026.9.x does (seen with the real CLI): rewrites it as
    plain JSON (comments dropped), adds/removes the load path and `plugins.entries.<id>`."""

    calls: list[list[str]] = field(default_factory=list)
    fail: str | None = None
    """Raise OpenClawCliError with this message instead of editing."""
    linked: list[str] = field(default_factory=list)
    """The folders it has link-installed (what uninstall takes out of the load paths)."""

    def describe(self) -> str:
        return "fake openclaw"

    def _load(self, config_path: Path) -> dict[str, object]:
        text = config_path.read_text() if config_path.is_file() else ""
        data = json5edit.loads(text)
        return data if isinstance(data, dict) else {}

    def _save(self, config_path: Path, data: dict[str, object]) -> None:
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(json.dumps(data, indent=2) + "\n")

    def install_plugin(self, plugin_dir: Path, config_path: Path) -> list[str]:
        argv = install_argv(plugin_dir)
        self.calls.append(argv)
        if self.fail:
            raise OpenClawCliError(self.fail)
        manifest = json.loads((plugin_dir / "openclaw.plugin.json").read_text())
        data = self._load(config_path)
        plugins = data.setdefault("plugins", {})
        assert isinstance(plugins, dict)
        paths = plugins.setdefault("load", {}).setdefault("paths", [])
        if str(plugin_dir) not in paths:
            paths.append(str(plugin_dir))
        self.linked.append(str(plugin_dir))
        plugins.setdefault("entries", {})[manifest["id"]] = {"enabled": True}
        self._save(config_path, data)
        return ["openclaw", *argv]

    def uninstall_plugin(self, plugin_id: str, config_path: Path) -> list[str]:
        argv = uninstall_argv(plugin_id)
        self.calls.append(argv)
        if self.fail:
            raise OpenClawCliError(self.fail)
        data = self._load(config_path)
        plugins = data.get("plugins")
        if isinstance(plugins, dict):
            load = plugins.get("load")
            if isinstance(load, dict) and isinstance(load.get("paths"), list):
                load["paths"] = [p for p in load["paths"] if p not in self.linked]
                if not load["paths"]:
                    del load["paths"]
                if not load:
                    del plugins["load"]
            entries = plugins.get("entries")
            if isinstance(entries, dict) and plugin_id in entries:
                entries[plugin_id] = {"enabled": False}
        self._save(config_path, data)
        return ["openclaw", *argv]
