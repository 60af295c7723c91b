"""Where the running server listens, kept in the state dir so other commands can find it.

`clawbridge up --port 8499` and a later `clawbridge status` (with no `--port`) must agree on where
the server is. `up` writes `server.json` (base URL and pid) into the state dir once it is bound, and
removes it on a clean exit; a file left by a killed server is harmless: readers try its URL, and
fall back to the configured address when nothing answers there.

Invariants:
- The file is replaced atomically (temp file + `os.replace`): a reader sees the old or new one.
- A server removes the file only while it still names that server's pid, so a second server on
  the same state dir is not forgotten when the first one exits.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

ADDRESS_FILE = "server.json"


@dataclass(frozen=True)
class ServerAddress:
    """What `up` recorded about itself."""

    url: str
    """Base URL without `/v1`, e.g. `http://127.0.0.1:8400`."""
    pid: int


def write_address(state_dir: Path, url: str, pid: int | None = None) -> ServerAddress:
    """Record `url` (and this process's pid) as the running server of `state_dir`."""
    addr = ServerAddress(url=url.rstrip("/"), pid=os.getpid() if pid is None else pid)
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / f".{ADDRESS_FILE}.{addr.pid}.tmp"
    tmp.write_text(json.dumps({"url": addr.url, "pid": addr.pid}))
    os.replace(tmp, state_dir / ADDRESS_FILE)
    return addr


def read_address(state_dir: Path) -> ServerAddress | None:
    """The recorded address, or None when there is none or it cannot be read."""
    try:
        raw = json.loads((state_dir / ADDRESS_FILE).read_text())
        return ServerAddress(url=str(raw["url"]), pid=int(raw["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_address(state_dir: Path, pid: int | None = None) -> bool:
    """Remove the file if it names `pid` (default: this process). True when removed."""
    addr = read_address(state_dir)
    if addr is None or addr.pid != (os.getpid() if pid is None else pid):
        return False
    try:
        (state_dir / ADDRESS_FILE).unlink()
    except FileNotFoundError:
        return False
    return True


def candidate_urls(state_dir: Path, configured: str) -> list[str]:
    """URLs to try, most likely first: the recorded one, then the configured one."""
    addr = read_address(state_dir)
    urls = [addr.url] if addr is not None else []
    if configured.rstrip("/") not in urls:
        urls.append(configured.rstrip("/"))
    return urls
