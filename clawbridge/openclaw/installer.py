"""`clawbridge openclaw install | uninstall | status`: wire OpenClaw to clawbridge through its config.

What install does to `openclaw.json` (found like OpenClaw finds it: `$OPENCLAW_CONFIG_PATH`, else
`$OPENCLAW_STATE_DIR/openclaw.json`, else `~/.openclaw/openclaw.json`; created when missing):
- `models.providers.<provider_id>`: `baseUrl` of clawbridge, `apiKey` = the client key,
  `api: "openai-completions"`, one model whose `contextWindow` / `maxTokens` come from the server;
- `plugins.load.paths` += the extension's directory (a copy under `<state_dir>/openclaw/extension`);
- `plugins.entries.clawbridge`: enabled, `hooks.allowConversationAccess: true` (the extension
  reads the session key and trigger from agent hooks), `config.providerId` when not the default,
  `config.agentAsUser: true` with `agent_as_user` (the agent id sent as X-User-Id);
- `plugins.allow` += `clawbridge`, only when the user already has an allowlist;
- with `set_default`: `agents.defaults.model.primary` = `<provider_id>/<model_id>`.

Invariants:
- Comments, formatting and every other setting in `openclaw.json` are kept (`json5edit` splices).
- The file is backed up (`<name>.clawbridge-backup-<time>`, same mode) before any write, written
  atomically (temp file + rename, mode kept; a new file is 0600 since it holds the client key).
- Install is idempotent: a second identical install changes nothing and writes nothing.
- Every change is recorded, in order, in `<state_dir>/openclaw/install.json` with the value before
  and after; uninstall undoes them in reverse, and leaves alone (and reports) anything the user has
  changed since.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clawbridge.openclaw import json5edit

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
    from clawbridge.keys import CLIENT_KEY_FILE, ensure_key

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
    backup_path: Path | None = None
    created_config: bool = False


@dataclass
class UninstallResult:
    config_path: Path
    restored: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    """Paths left alone because the user changed them after install."""
    backup_path: Path | None = None
    was_installed: bool = True


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


def _key(config_path: Path) -> str:
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


def _read_config(config_path: Path) -> str | None:
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
def install(state_dir: Path, opts: InstallOptions) -> InstallResult:
    """Install (or update) the clawbridge provider and extension in openclaw.json."""
    state_dir = Path(os.path.expanduser(str(state_dir)))
    config_path = resolve_config_path(opts.config_path)
    old_text = _read_config(config_path)
    extension_dir = _copy_extension(state_dir)

    text = old_text if old_text is not None else ""
    changes: list[dict[str, Any]] = []
    text = _apply_set(text, ["models", "providers", opts.provider_id], provider_entry(opts), changes)
    text = _apply_append(text, ["plugins", "load", "paths"], str(extension_dir), changes)
    text = _apply_set(text, ["plugins", "entries", PLUGIN_ID], plugin_entry(opts.provider_id, opts.agent_as_user), changes)
    if isinstance(json5edit.get(text, ["plugins", "allow"]), list):
        text = _apply_append(text, ["plugins", "allow"], PLUGIN_ID, changes)
    if opts.set_default:
        text = _apply_set(text, _default_model_path(text), f"{opts.provider_id}/{opts.model_id}", changes)

    result = InstallResult(config_path, extension_dir, created_config=old_text is None)
    records = load_records(state_dir)
    record = records["installs"].setdefault(
        _key(config_path), {"changes": [], "backups": [], "installed_at": time.time()}
    )
    record.update(
        provider_id=opts.provider_id,
        extension_dir=str(extension_dir),
        model_id=opts.model_id,
        base_url=opts.base_url,
        created_config=record.get("created_config", old_text is None),
    )
    if changes:
        result.backup_path = _write_config(config_path, old_text, text)
        result.changed = [".".join(c["path"]) for c in changes]
        record["changes"].extend(changes)
        if result.backup_path is not None:
            record["backups"].append(str(result.backup_path))
        record["updated_at"] = time.time()
    _save_records(state_dir, records)
    return result


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


def uninstall(state_dir: Path, config_path: Path | None = None) -> UninstallResult:
    """Undo what install changed in openclaw.json (newest first) and remove the extension copy."""
    state_dir = Path(os.path.expanduser(str(state_dir)))
    config_path = resolve_config_path(config_path)
    records = load_records(state_dir)
    record = records["installs"].get(_key(config_path))
    result = UninstallResult(config_path)
    if record is None:
        result.was_installed = False
        return result
    old_text = _read_config(config_path)
    if old_text is not None:
        text = old_text
        for change in reversed(record["changes"]):
            path = list(change["path"])
            if change["op"] == "append":
                current = json5edit.get(text, path)
                if isinstance(current, list) and change["item"] in current:
                    text = json5edit.remove(text, path, change["item"])
                    result.restored.append(".".join(path))
                continue
            before_undo = text
            text = _undo_set(text, path, change, result.kept)
            if text != before_undo:
                result.restored.append(".".join(path))
        if text != old_text:
            result.backup_path = _write_config(config_path, old_text, text)
    extension_dir = record.get("extension_dir")
    if extension_dir and Path(extension_dir).parent == (state_dir / RECORD_DIR).resolve():
        shutil.rmtree(extension_dir, ignore_errors=True)
    del records["installs"][_key(config_path)]
    _save_records(state_dir, records)
    return result


# ---------------------------------------------------------------------------- status
def recent_header_stats(state_dir: Path, limit: int = 50) -> dict[str, Any] | None:
    """How many of the last `limit` recorded turns carried the extension's headers.

    Reads the store read-only (never creates or migrates it). A turn carried the turn headers
    when the proxy recorded `X-Turn-Trigger` / `X-Turn-Id` in its meta; its session carried
    `X-Session-Id` when the session's source is `header`. None when there is no store yet.
    """
    from clawbridge.store import DB_FILENAME

    db = Path(os.path.expanduser(str(state_dir))) / DB_FILENAME
    if not db.is_file():
        return None
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5.0)
    try:
        rows = conn.execute(
            "SELECT t.meta_json, s.source, t.turn_type, t.completed_at FROM turns t "
            "JOIN sessions s ON s.session_id = t.session_id ORDER BY t.completed_at DESC LIMIT ?",
            (limit,),
        ).fetchall()
    except sqlite3.Error:
        return None
    finally:
        conn.close()
    stats: dict[str, Any] = {
        "turns": len(rows),
        "with_turn_headers": 0,
        "in_header_sessions": 0,
        "main": 0,
        "side": 0,
        "by_session_source": {},
        "triggers": {},
        "last_turn_at": rows[0][3] if rows else None,
    }
    for meta_json, source, turn_type, _ in rows:
        meta = json.loads(meta_json) if meta_json else {}
        if meta.get("trigger") or meta.get("turn_id_header"):
            stats["with_turn_headers"] += 1
        if meta.get("trigger"):
            stats["triggers"][meta["trigger"]] = stats["triggers"].get(meta["trigger"], 0) + 1
        if source == "header":
            stats["in_header_sessions"] += 1
        stats["by_session_source"][source] = stats["by_session_source"].get(source, 0) + 1
        if turn_type in ("main", "side"):
            stats[turn_type] += 1
    return stats


def _extension_current(ext_dir: Path | None) -> bool | None:
    """Whether the installed copy matches the extension this clawbridge ships (None: no source)."""
    try:
        source = find_extension_source()
    except InstallError:
        return None
    return ext_dir is not None and all(
        (ext_dir / n).read_bytes() == (source / n).read_bytes() for n in EXTENSION_FILES
    )


def status(state_dir: Path, config_path: Path | None = None) -> dict[str, Any]:
    """What is installed in openclaw.json, whether the extension copy is current, and whether
    recent calls carried the headers."""
    state_dir = Path(os.path.expanduser(str(state_dir)))
    config_path = resolve_config_path(config_path)
    record = load_records(state_dir)["installs"].get(_key(config_path))
    provider_id = record.get("provider_id", DEFAULT_PROVIDER_ID) if record else DEFAULT_PROVIDER_ID
    report: dict[str, Any] = {
        "config_path": str(config_path),
        "config_exists": config_path.is_file(),
        "recorded_install": record is not None,
        "provider_id": provider_id,
    }
    text = _read_config(config_path) if config_path.is_file() else ""
    text = text or ""
    provider = json5edit.get(text, ["models", "providers", provider_id])
    entry = json5edit.get(text, ["plugins", "entries", PLUGIN_ID])
    paths = json5edit.get(text, ["plugins", "load", "paths"])
    allow = json5edit.get(text, ["plugins", "allow"])
    default = json5edit.get(text, ["agents", "defaults", "model"])
    if isinstance(default, dict):
        default = default.get("primary", json5edit.MISSING)
    ext_dir = Path(record["extension_dir"]) if record and record.get("extension_dir") else None
    report["provider"] = (
        {
            "baseUrl": provider.get("baseUrl"),
            "api": provider.get("api"),
            "models": [m.get("id") for m in provider.get("models", []) if isinstance(m, dict)],
        }
        if isinstance(provider, dict)
        else None
    )
    report["plugin_enabled"] = isinstance(entry, dict) and entry.get("enabled") is not False
    report["conversation_access"] = (
        isinstance(entry, dict) and (entry.get("hooks") or {}).get("allowConversationAccess") is True
    )
    report["load_path"] = str(ext_dir) if ext_dir else None
    report["load_path_configured"] = ext_dir is not None and isinstance(paths, list) and str(ext_dir) in paths
    report["extension_present"] = ext_dir is not None and all(
        (ext_dir / n).is_file() for n in EXTENSION_FILES
    )
    report["extension_current"] = _extension_current(ext_dir) if report["extension_present"] else False
    report["allowlist"] = None if not isinstance(allow, list) else PLUGIN_ID in allow
    report["default_model"] = None if default is json5edit.MISSING else default
    report["installed"] = bool(
        report["provider"]
        and report["plugin_enabled"]
        and report["conversation_access"]
        and report["load_path_configured"]
        and report["extension_present"]
        and report["allowlist"] is not False
    )
    report["recent_calls"] = recent_header_stats(state_dir)
    return report
