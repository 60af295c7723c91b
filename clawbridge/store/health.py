"""Is the state dir usable, and is the store in it intact? Checked before the server announces itself.

Invariants:
- The state dir is private: created 0700; an existing dir readable by others is tightened to 0700
  (and said so); the store's files (`clawbridge.db`, `-wal`, `-shm`) are 0600. SQLite creates the
  WAL and shm files with the database file's mode, so a 0600 db keeps them private too.
- A state dir that cannot be written is refused before anything is served (`StateDirError`).
- A store that is not a valid SQLite database (0 bytes, truncated, corrupted mid-file) is refused,
  never served or written to (`StoreCorrupt`), with a message naming the file and the recovery:
  `clawbridge store recover` (salvage every readable row into a fresh file, keeping the corrupt
  one beside it) or a backup from `clawbridge store backup`.
- Free space: `disk_problem` says when the state dir's disk has less than a floor free, so a model
  call is refused (507) before sampling rather than failing to record after.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from clawbridge.store.files import DB_FILENAME, STORE_SUFFIXES, create_private

log = logging.getLogger("clawbridge.store")

BACKUP_DIR = "backups"


class StateDirError(RuntimeError):
    """The state dir cannot be used (not writable, not a directory)."""


class StoreCorrupt(RuntimeError):
    """The store file is not a healthy SQLite database."""


def recovery_hint(db: Path) -> str:
    return (f"stop clawbridge, then run `clawbridge store recover --state-dir {db.parent}` to salvage every readable "
            f"row into a fresh {db.name} (the damaged file is kept beside it), or copy the latest backup from "
            f"{db.parent / BACKUP_DIR} (made by `clawbridge store backup`) over it")


def prepare_state_dir(state_dir: Path) -> list[str]:
    """Create or tighten the state dir (0700) and its store files (0600); check it is writable.

    Returns what was changed, for the log. Raises `StateDirError` when it cannot be used.
    """
    notes: list[str] = []
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise StateDirError(f"cannot create the state dir {state_dir}: {exc.strerror or exc}") from None
    if not state_dir.is_dir():
        raise StateDirError(f"the state dir {state_dir} is not a directory")
    mode = stat.S_IMODE(state_dir.stat().st_mode)
    if mode & 0o077:
        try:
            state_dir.chmod(0o700)
            notes.append(f"tightened {state_dir} from {oct(mode)} to 0o700 (it holds every recorded conversation)")
        except OSError as exc:
            notes.append(f"could not tighten {state_dir} ({oct(mode)}) to 0o700: {exc.strerror or exc}")
    probe = state_dir / f".write-check-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)
        probe.unlink()
    except OSError as exc:
        raise StateDirError(f"the state dir {state_dir} is not writable ({exc.strerror or exc}); "
                            "fix its permissions or pass another --state-dir") from None

    for suffix in STORE_SUFFIXES:
        f = state_dir / f"{DB_FILENAME}{suffix}"
        if f.exists():
            fmode = stat.S_IMODE(f.stat().st_mode)
            if fmode & 0o077:
                f.chmod(0o600)
                notes.append(f"tightened {f} from {oct(fmode)} to 0o600")
    return notes


def check_store_file(db: Path) -> None:
    """Raise `StoreCorrupt` unless `db` is absent or a SQLite database whose quick_check passes."""
    if not db.exists():
        return
    size = db.stat().st_size
    if size == 0:
        raise StoreCorrupt(f"the store {db} is 0 bytes (truncated, or never written); clawbridge will not treat it "
                           f"as a new store. If it is new, delete it; otherwise {recovery_hint(db)}")
    problems = quick_check(db)
    if problems:
        raise StoreCorrupt(f"the store {db} is damaged ({'; '.join(problems[:3])}); {recovery_hint(db)}")


def quick_check(db: Path, full: bool = False) -> list[str]:
    """SQLite's quick_check (or integrity_check when `full`) of `db`: [] when healthy, else the problems."""
    try:
        conn = sqlite3.connect(str(db), timeout=30.0)
    except sqlite3.Error as exc:
        return [str(exc)]
    try:
        pragma = "integrity_check" if full else "quick_check"
        rows = conn.execute(f"PRAGMA {pragma}").fetchall()
        out = [str(r[0]) for r in rows]
        return [] if out == ["ok"] else out
    except sqlite3.Error as exc:
        return [str(exc)]
    finally:
        conn.close()


def disk_problem(state_dir: Path, min_free_bytes: int) -> str | None:
    """A sentence when the state dir's disk has less than `min_free_bytes` free, else None."""
    if min_free_bytes <= 0:
        return None
    try:
        free = shutil.disk_usage(state_dir).free
    except OSError as exc:
        return f"cannot read free space of {state_dir}: {exc.strerror or exc}"
    if free < min_free_bytes:
        return (f"only {free // (1024 * 1024)} MiB free on the disk of {state_dir} (min_free_disk_bytes is "
                f"{min_free_bytes // (1024 * 1024)} MiB); free some space so calls can be recorded")
    return None


@dataclass(frozen=True)
class RecoverReport:
    """What `recover_store` salvaged."""

    recovered: Path
    damaged_kept_at: Path
    rows: dict[str, int]
    lost: dict[str, int]


def backup_store(db: Path) -> Path:
    """A consistent copy of `db` (SQLite's online backup; safe while the server runs), 0600."""
    out_dir = db.parent / BACKUP_DIR
    out_dir.mkdir(mode=0o700, exist_ok=True)
    out = out_dir / f"{db.stem}-{time.strftime('%Y%m%d-%H%M%S')}.db"
    create_private(out)
    src = sqlite3.connect(str(db), timeout=30.0)
    dst = sqlite3.connect(str(out))
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()
    return out


def recover_store(db: Path) -> RecoverReport:
    """Copy every readable row of a damaged `db` into a fresh store, and put it in `db`'s place.

    The damaged file (and its -wal/-shm) is renamed `<name>.damaged-<time>` beside it. Rows that
    cannot be read are counted in `lost`. Run it with the server stopped.
    """
    from clawbridge.store.store import Store

    stamp = time.strftime("%Y%m%d-%H%M%S")
    fresh_path = db.with_name(f"{db.name}.recovering-{stamp}")
    fresh = Store(fresh_path)
    fresh.close()
    rows: dict[str, int] = {}
    lost: dict[str, int] = {}
    src = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30.0) if db.stat().st_size else None
    dst = sqlite3.connect(str(fresh_path), isolation_level=None)
    try:
        tables = [str(r[0]) for r in dst.execute("SELECT name FROM sqlite_master WHERE type='table' "
                                                 "AND name NOT LIKE 'sqlite_%'")]
        for table in tables:
            rows[table], lost[table] = (0, 0) if src is None else _copy_table(src, dst, table)
    finally:
        dst.close()
        if src is not None:
            src.close()
    damaged = db.with_name(f"{db.name}.damaged-{stamp}")
    for suffix in STORE_SUFFIXES:
        f = Path(f"{db}{suffix}")
        if f.exists():
            f.rename(Path(f"{damaged}{suffix}"))
    fresh_path.rename(db)
    for suffix in ("-wal", "-shm"):
        Path(f"{fresh_path}{suffix}").unlink(missing_ok=True)
    return RecoverReport(db, damaged, rows, lost)


def _copy_table(src: sqlite3.Connection, dst: sqlite3.Connection, table: str) -> tuple[int, int]:
    cols = [str(r[1]) for r in dst.execute(f'PRAGMA table_info("{table}")')]
    names = ", ".join(f'"{c}"' for c in cols)
    marks = ", ".join("?" for _ in cols)
    insert = f'INSERT OR IGNORE INTO "{table}" ({names}) VALUES ({marks})'
    if table == "meta":
        insert = f'INSERT OR REPLACE INTO "{table}" ({names}) VALUES ({marks})'
    dst.execute("BEGIN")
    try:
        try:  # the fast path: the whole table reads
            data = src.execute(f'SELECT {names} FROM "{table}"').fetchall()
            dst.executemany(insert, data)
            dst.execute("COMMIT")
            return len(data), 0
        except sqlite3.DatabaseError:
            dst.execute("ROLLBACK")
            dst.execute("BEGIN")
        copied = missing = 0
        try:
            top = src.execute(f'SELECT max(rowid) FROM "{table}"').fetchone()[0] or 0
        except sqlite3.DatabaseError:
            top = 0
        for rowid in range(1, int(top) + 1):  # row by row, skipping what cannot be read
            try:
                row = src.execute(f'SELECT {names} FROM "{table}" WHERE rowid=?', (rowid,)).fetchone()
            except sqlite3.DatabaseError:
                missing += 1
                continue
            if row is not None:
                dst.execute(insert, row)
                copied += 1
        dst.execute("COMMIT")
        return copied, missing
    except BaseException:
        if dst.in_transaction:
            dst.execute("ROLLBACK")
        raise
