"""`clawbridge openclaw status`: what is installed in openclaw.json, and whether recent calls
carried the extension's headers.

Invariants:
- Read-only: reads openclaw.json, the install record and the store (opened read-only, never
  created or migrated); writes nothing.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from clawbridge.openclaw import json5edit
from clawbridge.openclaw.installer import (
    DEFAULT_PROVIDER_ID,
    EXTENSION_FILES,
    PLUGIN_ID,
    InstallError,
    find_extension_source,
    load_records,
    read_config,
    record_key,
    resolve_config_path,
)


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
    record = load_records(state_dir)["installs"].get(record_key(config_path))
    provider_id = record.get("provider_id", DEFAULT_PROVIDER_ID) if record else DEFAULT_PROVIDER_ID
    report: dict[str, Any] = {
        "config_path": str(config_path),
        "config_exists": config_path.is_file(),
        "recorded_install": record is not None,
        "provider_id": provider_id,
    }
    text = read_config(config_path) if config_path.is_file() else ""
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
    report["plugin_managed_by_openclaw"] = bool(record and record.get("plugin_managed_by_openclaw"))
    # OpenClaw loads a plugin it installed itself from its own extensions folder, with no load path.
    report["load_path_configured"] = ext_dir is not None and (
        report["plugin_managed_by_openclaw"] or (isinstance(paths, list) and str(ext_dir) in paths)
    )
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
