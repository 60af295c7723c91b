"""Files that survive a power loss, not only a `kill -9`: written whole or not at all, and on the
disk before anything names them (a store row, a reader polling for them).

A rename alone is atomic for a crashed process but not for a crashed machine: until the file's
data and the folder that names it are flushed, a power loss can leave the new name pointing at
an empty or truncated file. So every writer here does: write a temporary file in the same
folder, fsync it, rename it into place, fsync the folder. The store commits the row that names a
checkpoint only after `replace_dir` returned (`clawbridge.trainer.checkpoints`).

Invariants:
- After `write_atomic`, `create_exclusive` or `replace_dir` returns, the new contents and the
  name that points at them are on the disk; before it returns a reader sees the old file (or
  none), never a partial one.
- `create_exclusive` never replaces a file that exists (the first writer wins, as with
  `O_CREAT | O_EXCL`), and the file appears with its whole contents (a hard link of a finished,
  flushed temporary file), so a second process never reads it empty.
- Temporary files and folders are hidden siblings (`.NAME.*`) and are removed when writing fails.
- This module imports nothing of clawbridge (every layer may use it).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

__all__ = ["create_exclusive", "fsync_dir", "fsync_tree", "replace_dir", "write_atomic"]


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (the names created, renamed or deleted in it) to the disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file under `root` and every folder, `root` included (children first)."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _write_flushed(tmp: Path, data: bytes, mode: int) -> None:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str, mode: int = 0o600) -> None:
    """Replace `path` with `data` (module invariants); a new file gets `mode`."""
    raw = data.encode() if isinstance(data, str) else data
    tmp = _tmp_name(path)
    try:
        _write_flushed(tmp, raw, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def create_exclusive(path: Path, data: bytes | str, mode: int = 0o600) -> None:
    """Create `path` holding `data` unless it exists (`FileExistsError`; module invariants)."""
    raw = data.encode() if isinstance(data, str) else data
    tmp = _tmp_name(path)
    try:
        _write_flushed(tmp, raw, mode)
        os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished folder `tmp` to `final`, replacing an older `final`, once everything in
    it is on the disk; the parent folder is flushed before this returns."""
    fsync_tree(tmp)
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)
