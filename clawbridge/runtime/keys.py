"""Client and admin keys: from the environment, else generated once into 0600 files in the state dir.

Invariants:
- A key file is created with mode 0600, whole, once (`clawbridge.runtime.durable.create_exclusive`: a
  flushed temporary file hard-linked to its name, then the state dir flushed): a second process
  never reads it empty or replaces it, and a power loss never leaves it empty. An existing file
  with looser permissions is refused rather than used.
- Keys are compared in constant time (`keys_equal`) and never logged; what gets printed is the
  file path.
"""

from __future__ import annotations

import hmac
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from clawbridge.runtime.durable import create_exclusive

CLIENT_KEY_FILE = "client_key"
ADMIN_KEY_FILE = "admin_key"


class KeyFileError(RuntimeError):
    """A key file exists but is unsafe or unreadable."""


@dataclass(frozen=True)
class ResolvedKey:
    """A key and where it came from."""

    value: str
    source: str
    """'env' or the path of the file it was read from or written to."""


def keys_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def read_key_file(path: Path) -> str | None:
    """The key in `path`, or None when there is no file. Refuses group/world-readable files."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"{path} is readable by others (mode {oct(st.st_mode & 0o777)}); chmod 600 it")
    value = path.read_text().strip()
    if not value:
        raise KeyFileError(f"{path} is empty; delete it to generate a new key")
    return value


def ensure_key(state_dir: Path, filename: str, env_value: str | None, prefix: str) -> ResolvedKey:
    """Use the environment's key when set; else the state dir's file, generating it if missing."""
    if env_value:
        return ResolvedKey(env_value, "env")
    path = state_dir / filename
    existing = read_key_file(path)
    if existing is not None:
        return ResolvedKey(existing, str(path))
    state_dir.mkdir(parents=True, exist_ok=True)
    value = f"{prefix}-{secrets.token_urlsafe(32)}"
    try:
        create_exclusive(path, value + "\n", 0o600)
    except FileExistsError:  # another process won the race: use its key
        existing = read_key_file(path)
        assert existing is not None
        return ResolvedKey(existing, str(path))
    return ResolvedKey(value, str(path))
