"""The store's files: their names and how they are created private. Below `store` and `health`,
which both need them (so neither imports the other for them).

Invariant: a file made by `create_private` is 0600 from its first byte (SQLite would create it
0644; its -wal and -shm copy the database file's mode).
"""

from __future__ import annotations

import os
from pathlib import Path

DB_FILENAME = "clawbridge.db"
"""The store's database file in the state dir."""
STORE_SUFFIXES = ("", "-wal", "-shm")
"""The database file and SQLite's two companions (`DB_FILENAME + suffix`)."""


def create_private(path: Path) -> None:
    """Create `path` empty with mode 0600 if it does not exist (before SQLite creates it 0644)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
