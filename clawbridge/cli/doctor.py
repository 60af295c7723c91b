"""`clawbridge doctor`: one line per check, each saying what is wrong and how to fix it.

Backends add their own checks through the `clawbridge.doctor` entry-point group: a callable
`(settings) -> list[tuple[bool, str]]`. The core imports no backend package directly.
"""

from __future__ import annotations

import socket
import sys
from importlib import metadata
from pathlib import Path

from clawbridge.config import Settings
from clawbridge.plugins import KNOWN_BACKEND_PACKAGES, available_backends
from clawbridge.runtime.keys import ADMIN_KEY_FILE, CLIENT_KEY_FILE, KeyFileError, read_key_file

DOCTOR_GROUP = "clawbridge.doctor"

Check = tuple[bool, str]


def core_checks(settings: Settings) -> list[Check]:
    out: list[Check] = []
    v = sys.version_info
    out.append((v >= (3, 11), f"python {v.major}.{v.minor}" + ("" if v >= (3, 11) else ": clawbridge needs 3.11+")))
    state = settings.state_path
    try:
        state.mkdir(parents=True, exist_ok=True)
        probe = state / ".doctor-probe"
        probe.write_text("ok")
        probe.unlink()
        out.append((True, f"state dir {state} is writable"))
    except OSError as exc:
        out.append((False, f"state dir {state} is not writable ({exc}): pass --state-dir or fix permissions"))
    out.append(store_check(state))
    for name, env in ((CLIENT_KEY_FILE, settings.api_key), (ADMIN_KEY_FILE, settings.admin_key)):
        if env is not None:
            out.append((True, f"{name} comes from the environment"))
            continue
        try:
            present = read_key_file(state / name) is not None
            out.append((True, f"{name}: {'in ' + str(state / name) if present else 'will be generated on first up'}"))
        except KeyFileError as exc:
            out.append((False, str(exc)))
    with socket.socket() as s:
        try:
            s.bind((settings.host, settings.port))
            out.append((True, f"port {settings.host}:{settings.port} is free"))
        except OSError:
            out.append((True, f"port {settings.host}:{settings.port} is in use (a running clawbridge, or pick --port)"))
    return out


def store_check(state_dir: Path) -> Check:
    """The state dir's store: none yet, intact (SQLite's quick_check), or damaged (with the fix)."""
    from clawbridge.store import DB_FILENAME
    from clawbridge.store.health import quick_check, recovery_hint

    db = state_dir / DB_FILENAME
    if not db.exists():
        return (True, f"store {db}: none yet (the first `clawbridge up` on this state dir creates it)")
    size = db.stat().st_size
    problems = ["the file is 0 bytes"] if size == 0 else quick_check(db)
    if problems:
        return (False, f"store {db} is damaged ({'; '.join(problems[:3])}): {recovery_hint(db)}")
    return (True, f"store {db}: intact ({size:,} bytes, quick_check ok)")


def backend_checks(settings: Settings, backend: str) -> list[Check]:
    if backend not in available_backends():
        hint = KNOWN_BACKEND_PACKAGES.get(backend, "its package")
        return [(False, f"backend {backend!r} is not installed: install {hint}")]
    checks = {ep.name: ep for ep in metadata.entry_points(group=DOCTOR_GROUP)}
    if backend not in checks:
        return [(True, f"backend {backend!r} installed (it offers no extra checks)")]
    try:
        return list(checks[backend].load()(settings))
    except Exception as exc:  # a broken check must not hide the others
        return [(False, f"{backend} checks failed to run: {exc}")]


def run_doctor(settings: Settings, backend: str | None) -> list[Check]:
    name = backend or settings.backend
    return core_checks(settings) + backend_checks(settings, name)
