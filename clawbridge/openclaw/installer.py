"""`clawbridge openclaw install | uninstall`: wire OpenClaw to clawbridge through its config.

What install does to `openclaw.json` (found like OpenClaw finds it: `$OPENCLAW_CONFIG_PATH`, else
`$OPENCLAW_STATE_DIR/openclaw.json`, else `~/.openclaw/openclaw.json`; created when missing):
- the extension is copied to `<state_dir>/openclaw/extension` and installed from there: with
  OpenClaw's own CLI when one is given (`openclaw plugins install --link`, see `openclaw_cli`),
  else by hand: `plugins.load.paths` += that directory;
- `models.providers.<provider_id>`: `baseUrl` of clawbridge, `apiKey` = the client key,
  `api: "openai-completions"`, one model whose `contextWindow` / `maxTokens` come from the server;
- `plugins.entries.clawbridge`: enabled, `hooks.allowConversationAccess: true` (the extension
  reads the session key and trigger from agent hooks), `config.providerId` when not the default,
  `config.agentAsUser: true` with `agent_as_user` (the agent id sent as X-User-Id);
- `plugins.allow` += `clawbridge`, only when the user already has an allowlist;
- with `set_default`: `agents.defaults.model.primary` = `<provider_id>/<model_id>`.

Invariants:
- Comments, formatting and every other setting in `openclaw.json` are kept by our own edits
  (`json5edit` splices); OpenClaw's CLI, when used, rewrites the file as plain JSON (comments
  dropped: the result says so, and the backup has them).
- The file is backed up (`<name>.clawbridge-backup-<time>`, same mode) before any write (ours or
  OpenClaw's), written atomically (temp file + rename, mode kept; a new file is 0600 since it holds
  the client key).
- Install is idempotent: a second identical install changes nothing, writes nothing and runs no
  OpenClaw command.
- Every change is recorded, in order, in `<state_dir>/openclaw/install.json` with the value before
  and after (OpenClaw's plugin install as one change); uninstall undoes them in reverse, and leaves
  alone (and reports) anything the user has changed since. A config file (and its folder) that
  install created is deleted by uninstall when nothing else is left in it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clawbridge.openclaw import json5edit
from clawbridge.openclaw.openclaw_cli import OpenClawCli, OpenClawCliError

PLUGIN_ID = "clawbridge"
DEFAULT_PROVIDER_ID = "clawbridge"
DEFAULT_BASE_URL = "http://127.0.0.1:8400/v1"
DEFAULT_MODEL_ID = "default"
DEFAULT_CONTEXT_WINDOW = 32768
DEFAULT_MAX_TOKENS = 4096
RECORD_DIR = "openclaw"
RECORD_FILE = "install.json"
EXTENSION_FILES = ("package.json", "openclaw.plugin.json", "index.js")


class InstallError(RuntimeError):
    """Install/uninstall cannot proceed (message says why and what to do)."""


# ---------------------------------------------------------------------------- locating things
def resolve_config_path(explicit: Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """Where OpenClaw reads its config: explicit path, `$OPENCLAW_CONFIG_PATH`,
    `$OPENCLAW_STATE_DIR/openclaw.json`, else `~/.openclaw/openclaw.json`."""
    env = os.environ if env is None else env
    if explicit is not None:
        return Path(os.path.expanduser(str(explicit)))
    if env.get("OPENCLAW_CONFIG_PATH"):
        return Path(os.path.expanduser(env["OPENCLAW_CONFIG_PATH"]))
    if env.get("OPENCLAW_STATE_DIR"):
        return Path(os.path.expanduser(env["OPENCLAW_STATE_DIR"])) / "openclaw.json"
    home = env.get("HOME") or os.path.expanduser("~")
    return Path(home) / ".openclaw" / "openclaw.json"


def find_extension_source() -> Path:
    """The built extension: packaged next to this module, else the repo's `extensions/openclaw`."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "extension", here.parents[1] / "extensions" / "openclaw"):
        if all((candidate / name).is_file() for name in EXTENSION_FILES):
            return candidate
    raise InstallError(
        "the OpenClaw extension files (package.json, openclaw.plugin.json, index.js) were not found "
        f"in {here / 'extension'} or the repository's extensions/openclaw"
    )


def resolve_client_key(state_dir: Path, env: Mapping[str, str] | None = None) -> str:
    """The client key: `$CLAWBRIDGE_API_KEY`, else `<state_dir>/client_key` (generated if missing,
    exactly as the server would, so the server started later uses the same key)."""
    from clawbridge.runtime.keys import CLIENT_KEY_FILE, ensure_key

    env = os.environ if env is None else env
    return ensure_key(state_dir, CLIENT_KEY_FILE, env.get("CLAWBRIDGE_API_KEY") or None, "cb").value


# ---------------------------------------------------------------------------- options and results
@dataclass
class InstallOptions:
    """What to install. `api_key` is written into openclaw.json as the provider's key."""

    api_key: str
    config_path: Path | None = None
    base_url: str = DEFAULT_BASE_URL
    provider_id: str = DEFAULT_PROVIDER_ID
    model_id: str = DEFAULT_MODEL_ID
    context_window: int = DEFAULT_CONTEXT_WINDOW
    max_tokens: int = DEFAULT_MAX_TOKENS
    set_default: bool = False
    agent_as_user: bool = False
    """The extension sends each OpenClaw agent's id as X-User-Id (`config.agentAsUser`; the
    server records each agent as its own user when `trust_user_header` is on)."""


@dataclass
class InstallResult:
    config_path: Path
    extension_dir: Path
    changed: list[str] = field(default_factory=list)
    """Dotted paths written by this run (empty: everything was already in place)."""
    backups: list[Path] = field(default_factory=list)
    """Copies of openclaw.json taken before this run's writes (oldest first)."""
    created_config: bool = False
    """This run created openclaw.json (it did not exist)."""
    record_path: Path | None = None
    """Where the changes are recorded (what `clawbridge openclaw uninstall` undoes)."""
    openclaw_command: list[str] | None = None
    """The OpenClaw command this run used for the plugin, if any."""
    plugin_managed_by_openclaw: bool = False
    """OpenClaw had installed the plugin itself (`extension_dir` is its copy, left alone)."""

    @property
    def backup_path(self) -> Path | None:
        """The copy of the file as it was before this run."""
        return self.backups[0] if self.backups else None


@dataclass
class UninstallResult:
    config_path: Path
    restored: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    """Paths left alone because the user changed them after install."""
    backup_path: Path | None = None
    was_installed: bool = True
    deleted_config: bool = False
    """openclaw.json was created by install and is gone again (nothing else was in it)."""
    openclaw_command: list[str] | None = None
    """The OpenClaw command run to uninstall the plugin, if any."""
    leftover: list[str] = field(default_factory=list)
    """What could not be undone here, and the command that does it."""


# ---------------------------------------------------------------------------- desired state
def provider_entry(opts: InstallOptions) -> dict[str, Any]:
    """The `models.providers.<id>` value for clawbridge."""
    return {
        "baseUrl": opts.base_url.rstrip("/"),
        "apiKey": opts.api_key,
        "api": "openai-completions",
        "models": [
            {
                "id": opts.model_id,
                "name": f"{opts.model_id} (clawbridge)",
                "reasoning": False,
                "input": ["text"],
                "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                "contextWindow": int(opts.context_window),
                "maxTokens": int(opts.max_tokens),
            }
        ],
    }


def plugin_entry(provider_id: str, agent_as_user: bool = False) -> dict[str, Any]:
    """The `plugins.entries.clawbridge` value."""
    entry: dict[str, Any] = {"enabled": True, "hooks": {"allowConversationAccess": True}}
    config: dict[str, Any] = {}
    if provider_id != DEFAULT_PROVIDER_ID:
        config["providerId"] = provider_id
    if agent_as_user:
        config["agentAsUser"] = True
    if config:
        entry["config"] = config
    return entry


# ---------------------------------------------------------------------------- record file
def _record_path(state_dir: Path) -> Path:
    return state_dir / RECORD_DIR / RECORD_FILE


def load_records(state_dir: Path) -> dict[str, Any]:
    path = _record_path(state_dir)
    if not path.is_file():
        return {"version": 1, "installs": {}}
    data = json.loads(path.read_text())
    data.setdefault("installs", {})
    return data


def _save_records(state_dir: Path, records: dict[str, Any]) -> None:
    path = _record_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, json.dumps(records, indent=2) + "\n", 0o600)


def record_key(config_path: Path) -> str:
    return str(config_path.expanduser().resolve())


# ---------------------------------------------------------------------------- file helpers
def _atomic_write(path: Path, text: str, mode: int) -> None:
    target = path.resolve() if path.is_symlink() else path
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _backup(config_path: Path) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%S")
    backup = config_path.with_name(f"{config_path.name}.clawbridge-backup-{stamp}")
    n = 1
    while backup.exists():
        backup = config_path.with_name(f"{config_path.name}.clawbridge-backup-{stamp}-{n}")
        n += 1
    shutil.copy2(config_path, backup)
    return backup


def _write_config(config_path: Path, old_text: str | None, new_text: str) -> Path | None:
    """Back up (when the file exists), then write atomically keeping the mode. Returns the backup."""
    backup = None
    if old_text is not None:
        backup = _backup(config_path)
        mode = config_path.stat().st_mode & 0o777
    else:
        config_path.parent.mkdir(parents=True, exist_ok=True)
        mode = 0o600
    _atomic_write(config_path, new_text, mode)
    return backup


def read_config(config_path: Path) -> str | None:
    try:
        text = config_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        json5edit.parse(text)
    except json5edit.Json5Error as exc:
        raise InstallError(f"{config_path} is not valid JSON5 ({exc}); fix it and try again") from None
    return text


def _copy_extension(state_dir: Path) -> Path:
    source = find_extension_source()
    dest = state_dir / RECORD_DIR / "extension"
    dest.mkdir(parents=True, exist_ok=True)
    for name in EXTENSION_FILES:
        src = source / name
        if not (dest / name).is_file() or (dest / name).read_bytes() != src.read_bytes():
            shutil.copyfile(src, dest / name)
    return dest.resolve()


# ---------------------------------------------------------------------------- edit planning
def _plan_set(text: str, path: list[str], value: Any) -> tuple[list[str], Any]:
    """The path and value actually written: the shortest missing prefix gets a nested value, so
    that undoing the change also removes the parents it created."""
    for depth in range(1, len(path)):
        if json5edit.get(text, path[:depth]) is json5edit.MISSING:
            nested: Any = value
            for part in reversed(path[depth:]):
                nested = {part: nested}
            return path[:depth], nested
    return path, value


def _apply_set(text: str, path: list[str], value: Any, changes: list[dict[str, Any]]) -> str:
    current = json5edit.get(text, path)
    if current is not json5edit.MISSING and current == value:
        return text
    op_path, op_value = _plan_set(text, path, value)
    before = json5edit.get(text, op_path)
    change: dict[str, Any] = {"op": "set", "path": op_path, "after": op_value}
    if before is not json5edit.MISSING:
        change["before"] = before
        change["before_source"] = json5edit.source(text, op_path)  # restored verbatim on uninstall
    changes.append(change)
    return json5edit.set_value(text, op_path, op_value)


def _apply_append(text: str, path: list[str], item: Any, changes: list[dict[str, Any]]) -> str:
    current = json5edit.get(text, path)
    if current is json5edit.MISSING:
        return _apply_set(text, path, [item], changes)
    if not isinstance(current, list):
        raise InstallError(f"{'.'.join(path)} in openclaw.json is not a list")
    if item in current:
        return text
    changes.append({"op": "append", "path": path, "item": item})
    return json5edit.append(text, path, item)


def _default_model_path(text: str) -> list[str]:
    model = json5edit.get(text, ["agents", "defaults", "model"])
    return (
        ["agents", "defaults", "model"]
        if isinstance(model, str)
        else ["agents", "defaults", "model", "primary"]
    )


# ---------------------------------------------------------------------------- install / uninstall
def openclaw_managed_plugin(config_path: Path, env: Mapping[str, str] | None = None) -> Path | None:
    """The plugin's folder when OpenClaw itself installed it (`openclaw plugins install <tarball |
    dir>` copies it to `<OpenClaw state dir>/extensions/clawbridge`), else None. OpenClaw's state
    dir is `$OPENCLAW_STATE_DIR`, else the folder of openclaw.json."""
    env = os.environ if env is None else env
    root = Path(os.path.expanduser(env["OPENCLAW_STATE_DIR"])) if env.get("OPENCLAW_STATE_DIR") else config_path.parent
    folder = root / "extensions" / PLUGIN_ID
    return folder.resolve() if (folder / "openclaw.plugin.json").is_file() else None


def _plugin_linked(text: str, extension_dir: Path) -> bool:
    paths = json5edit.get(text, ["plugins", "load", "paths"])
    return isinstance(paths, list) and str(extension_dir) in paths


def _install_plugin_with_cli(
    cli: OpenClawCli, config_path: Path, text: str | None, extension_dir: Path, result: InstallResult
) -> str:
    """Run OpenClaw's plugin install (backing the file up first); return the config text after it."""
    if text is not None:
        result.backups.append(_backup(config_path))
    else:
        config_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        result.openclaw_command = cli.install_plugin(extension_dir, config_path)
    except OpenClawCliError as exc:
        raise InstallError(
            f"OpenClaw could not install the plugin ({exc}); openclaw.json is as it was "
            "(rerun with --openclaw-cli none to write it by hand)"
        ) from None
    after = read_config(config_path)
    if after is None:
        raise InstallError(f"`{cli.describe()}` reported success but {config_path} does not exist")
    if text is None and config_path.stat().st_mode & 0o077:
        config_path.chmod(0o600)  # OpenClaw created it; it will hold the client key
    return after


def install(state_dir: Path, opts: InstallOptions, openclaw_cli: OpenClawCli | None = None) -> InstallResult:
    """Install (or update) the clawbridge provider and extension in openclaw.json; the plugin part
    through `openclaw_cli` when given (see the module doc), else by hand."""
    state_dir = Path(os.path.expanduser(str(state_dir)))
    config_path = resolve_config_path(opts.config_path)
    old_text = read_config(config_path)
    created_dir = None if config_path.parent.exists() else _first_missing_parent(config_path)
    managed = openclaw_managed_plugin(config_path)
    extension_dir = managed or _copy_extension(state_dir)
    result = InstallResult(config_path, extension_dir, created_config=old_text is None)
    result.plugin_managed_by_openclaw = managed is not None
    changes: list[dict[str, Any]] = []
    text = old_text if old_text is not None else ""
    if managed is not None:
        pass  # `openclaw plugins install <tarball | dir>` put it there: it is OpenClaw's, left alone
    elif openclaw_cli is not None and not _plugin_linked(text, extension_dir):
        text = _install_plugin_with_cli(openclaw_cli, config_path, old_text, extension_dir, result)
        changes.append({"op": "openclaw-plugin", "plugin": PLUGIN_ID, "path": ["plugins", "load", "paths"],
                        "item": str(extension_dir)})  # fmt: skip
    else:
        text = _apply_append(text, ["plugins", "load", "paths"], str(extension_dir), changes)
    text = _apply_set(text, ["models", "providers", opts.provider_id], provider_entry(opts), changes)
    text = _apply_set(text, ["plugins", "entries", PLUGIN_ID], plugin_entry(opts.provider_id, opts.agent_as_user), changes)
    if isinstance(json5edit.get(text, ["plugins", "allow"]), list):
        text = _apply_append(text, ["plugins", "allow"], PLUGIN_ID, changes)
    if opts.set_default:
        text = _apply_set(text, _default_model_path(text), f"{opts.provider_id}/{opts.model_id}", changes)

    records = load_records(state_dir)
    record = records["installs"].setdefault(
        record_key(config_path), {"changes": [], "backups": [], "installed_at": time.time()}
    )
    record.update(
        provider_id=opts.provider_id,
        extension_dir=str(extension_dir),
        model_id=opts.model_id,
        base_url=opts.base_url,
        created_config=record.get("created_config", old_text is None),
    )
    if created_dir is not None and "created_dir" not in record:
        record["created_dir"] = str(created_dir)
    if managed is not None:
        record["plugin_managed_by_openclaw"] = True
    if changes:
        if result.openclaw_command is not None:  # OpenClaw wrote it after our backup: no second copy
            _atomic_write(config_path, text, config_path.stat().st_mode & 0o777)
        else:
            backup = _write_config(config_path, old_text, text)
            if backup is not None:
                result.backups.append(backup)
        result.changed = [".".join(c["path"]) for c in changes]
        record["changes"].extend(changes)
        record["backups"].extend(str(b) for b in result.backups)
        record["updated_at"] = time.time()
    _save_records(state_dir, records)
    result.record_path = _record_path(state_dir)
    return result


def _first_missing_parent(config_path: Path) -> Path:
    """The outermost folder above config_path that does not exist yet (install creates it)."""
    missing = config_path.parent
    while not missing.parent.exists():
        missing = missing.parent
    return missing


def _undo_set(text: str, path: list[str], change: dict[str, Any], kept: list[str]) -> str:
    current = json5edit.get(text, path)
    after = change["after"]
    if current is not json5edit.MISSING and current == after:
        if "before" in change:
            raw = change.get("before_source")
            if isinstance(raw, str) and json5edit.loads("{v: " + raw + "}")["v"] == change["before"]:
                return json5edit.replace_source(text, path, raw)
            return json5edit.set_value(text, path, change["before"])
        return json5edit.delete(text, path)
    if "before" not in change and isinstance(after, dict) and isinstance(current, dict):
        # We created this object and the user added to it since: remove only what we put there.
        for key, value in after.items():
            text = _undo_set(text, [*path, key], {"op": "set", "after": value}, kept)
        if json5edit.get(text, path) == {}:
            text = json5edit.delete(text, path)
        return text
    if "before" not in change and isinstance(after, list) and isinstance(current, list):
        for item in after:
            text = json5edit.remove(text, path, item)
        if json5edit.get(text, path) == []:
            text = json5edit.delete(text, path)
        return text
    if current is not json5edit.MISSING:
        kept.append(".".join(path))
    return text


def uninstall(
    state_dir: Path, config_path: Path | None = None, openclaw_cli: OpenClawCli | None = None
) -> UninstallResult:
    """Undo what install changed in openclaw.json (newest first) and remove the extension copy.
    A plugin that OpenClaw's CLI installed is uninstalled with `openclaw_cli`; without one, its load
    path is removed by hand and `leftover` says what is left in OpenClaw's own records."""
    state_dir = Path(os.path.expanduser(str(state_dir)))
    config_path = resolve_config_path(config_path)
    records = load_records(state_dir)
    record = records["installs"].get(record_key(config_path))
    result = UninstallResult(config_path)
    if record is None:
        result.was_installed = False
        return result
    on_disk = read_config(config_path)
    if on_disk is not None:
        text = on_disk

        def flush() -> None:
            """Write `text` (backing the file up once, before the first write of this run)."""
            nonlocal on_disk
            if text == on_disk:
                return
            if result.backup_path is None:
                result.backup_path = _write_config(config_path, on_disk, text)
            else:
                _atomic_write(config_path, text, config_path.stat().st_mode & 0o777)
            on_disk = text

        for change in reversed(record["changes"]):
            path = list(change["path"])
            if change["op"] == "openclaw-plugin" and openclaw_cli is not None:
                flush()  # ours first, then OpenClaw's: the reverse of install
                if result.backup_path is None:
                    result.backup_path = _backup(config_path)
                try:
                    result.openclaw_command = openclaw_cli.uninstall_plugin(change["plugin"], config_path)
                except OpenClawCliError as exc:
                    raise InstallError(f"OpenClaw could not uninstall the plugin ({exc})") from None
                on_disk = text = read_config(config_path) or ""
                result.restored.append(".".join(path))
            elif change["op"] in ("append", "openclaw-plugin"):
                current = json5edit.get(text, path)
                if isinstance(current, list) and change["item"] in current:
                    text = json5edit.remove(text, path, change["item"])
                    result.restored.append(".".join(path))
                if change["op"] == "openclaw-plugin":
                    result.leftover.append(
                        f"OpenClaw's own record of the plugin (no `openclaw` to run): "
                        f"`openclaw plugins uninstall {change['plugin']}` removes it"
                    )
            else:
                before_undo = text
                text = _undo_set(text, path, change, result.kept)
                if text != before_undo:
                    result.restored.append(".".join(path))
        if record.get("created_config") and json5edit.loads(text) == {}:
            config_path.unlink()  # install created it and nothing else is in it: no backup either
            result.deleted_config = True
            if record.get("created_dir"):
                _remove_empty_dirs(config_path.parent, Path(record["created_dir"]))
        else:
            flush()
    if record.get("plugin_managed_by_openclaw"):
        result.leftover.append(
            f"the plugin OpenClaw installed itself ({record.get('extension_dir')}): "
            f"`openclaw plugins uninstall {PLUGIN_ID}` removes it"
        )
    extension_dir = record.get("extension_dir")
    if extension_dir and Path(extension_dir).parent == (state_dir / RECORD_DIR).resolve():
        shutil.rmtree(extension_dir, ignore_errors=True)
    del records["installs"][record_key(config_path)]
    _save_records(state_dir, records)
    return result


def _remove_empty_dirs(folder: Path, outermost: Path) -> None:
    """Remove `folder` and its parents up to `outermost` (folders install created), while empty."""
    folder, outermost = folder.resolve(), outermost.resolve()
    if folder != outermost and outermost not in folder.parents:
        return
    while True:
        try:
            folder.rmdir()  # only an empty folder
        except OSError:
            return
        if folder == outermost:
            return
        folder = folder.parent
