"""Where the running server listens, kept in the state dir so other commands can find it.

`clawbridge up --port 8499` and a later `clawbridge status` (with no `--port`) must agree on where
the server is. `up` writes `server.json` (root URL and pid) into the state dir once it is listening,
and removes it on a clean exit; a file left by a killed server is harmless: readers try its URL, and
fall back to the configured address when nothing answers there.

Invariants:
- The file is replaced atomically and durably (`clawbridge.durable.write_atomic`: temp file,
  fsync, rename, fsync of the state dir): a reader sees the old or new one, also after a power loss.
- A server writes the file only once it is listening (a failed bind leaves another server's file
  alone) and removes it only while it still names its pid, so a second server on the same state
  dir is not forgotten when the first one exits.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from clawbridge.durable import write_atomic

ADDRESS_FILE = "server.json"


@dataclass(frozen=True)
class ServerAddress:
    """What `up` recorded about itself."""

    url: str
    """Root URL without `/v1`, e.g. `http://127.0.0.1:8400`."""
    pid: int


def root_url_for(host: str, port: int) -> str:
    """The URL clients reach a server bound to `host:port` at (a wildcard bind is reached on loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def base_url_for(host: str, port: int) -> str:
    """clawbridge's OpenAI base URL (`.../v1`) for a bind address."""
    return f"{root_url_for(host, port)}/v1"


def write_address(state_dir: Path, url: str) -> None:
    """Record `url` (a root URL, no `/v1`) and this process's pid as `state_dir`'s running server."""
    state_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(state_dir / ADDRESS_FILE, json.dumps({"url": url.rstrip("/"), "pid": os.getpid()}), mode=0o644)


def read_address(state_dir: Path) -> ServerAddress | None:
    """The recorded address, or None when there is none or it cannot be read."""
    try:
        raw = json.loads((state_dir / ADDRESS_FILE).read_text())
        return ServerAddress(url=str(raw["url"]), pid=int(raw["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_address(state_dir: Path) -> None:
    """Remove the file if it names this process (another server may have written it since)."""
    addr = read_address(state_dir)
    if addr is not None and addr.pid == os.getpid():
        (state_dir / ADDRESS_FILE).unlink(missing_ok=True)


def candidate_urls(state_dir: Path, configured: str) -> list[str]:
    """URLs to try, most likely first: the recorded one, then the configured one."""
    addr = read_address(state_dir)
    urls = [addr.url] if addr is not None else []
    if configured.rstrip("/") not in urls:
        urls.append(configured.rstrip("/"))
    return urls
