"""Where the running servers listen, so other commands find the one they mean.

`clawbridge up --port 8499` and a later `clawbridge status` (with no `--port`) must agree on where
the server is. `up` writes `server.json` (root URL, pid, model) into the state dir once it is
listening, and removes it on a clean exit. It also leaves a pointer to its state dir in the OS
user's index of running servers (`servers_dir()`: `~/.clawbridge/servers/`, one small file per
server), so a command given no state dir finds the one server that runs (`running_servers`).

Invariants:
- A server is running only when its state dir's `server.json` names a live pid of this OS user
  AND that process listens at its URL (`server_for`; where /proc shows sockets, the listening
  socket must be one of that pid's own, elsewhere something must accept connections there): a
  file left by a killed server (its pid gone, or reused by a process that does not listen there)
  is never taken for a running server, nor is another program that took its port, so the admin
  key is never sent there. A reader never falls back to some other address: a command talks to
  the server of the state dir it chose, or to none.
- Files are replaced atomically and durably (`clawbridge.runtime.durable.write_atomic`: temp file, fsync,
  rename, fsync of the folder), created 0600 (the index folder 0700): a reader sees the old or the
  new one, also after a power loss, and no other OS user reads them.
- A server writes them only once it is listening (a failed bind leaves another server's alone)
  and removes them only while they still name its pid, so a second server on the same state dir
  is not forgotten when the first one exits. An index entry is named by state dir AND pid, so a
  reader that removes a stale entry never removes a newer server's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from clawbridge.runtime.durable import write_atomic

ADDRESS_FILE = "server.json"
LIVENESS_TIMEOUT_S = 0.5
"""How long `server_for` waits for the recorded URL to accept a connection."""


@dataclass(frozen=True)
class ServerAddress:
    """What `up` recorded about itself."""

    url: str
    """Root URL without `/v1`, e.g. `http://127.0.0.1:8400`."""
    pid: int
    model: str = ""
    """The name the served model answers to ('' when the file does not say)."""


@dataclass(frozen=True)
class RunningServer:
    """A live server (`server_for`) and the state dir it holds."""

    state_dir: Path
    address: ServerAddress

    @property
    def url(self) -> str:
        return self.address.url

    def describe(self) -> str:
        """`http://127.0.0.1:8400 (pid 12, model 'tiny-model')`."""
        model = f", model {self.address.model!r}" if self.address.model else ""
        return f"{self.url} (pid {self.address.pid}{model})"


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


def _write_private(path: Path, data: dict[str, object]) -> None:
    """`data` as JSON at `path`, atomically and durably, mode 0600."""
    write_atomic(path, json.dumps(data), mode=0o600)


def write_address(state_dir: Path, url: str, model: str = "") -> None:
    """Record `url` (a root URL, no `/v1`), this process's pid and the served `model` as
    `state_dir`'s running server, and point the OS user's index at it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    _write_private(state_dir / ADDRESS_FILE, {"url": url.rstrip("/"), "pid": os.getpid(), "model": model})
    try:
        index = servers_dir()
        index.parent.mkdir(mode=0o700, exist_ok=True)  # ~/.clawbridge: the default state dir, private
        index.mkdir(mode=0o700, exist_ok=True)
        _write_private(_entry_path(state_dir, os.getpid()),
                       {"state_dir": str(state_dir.expanduser().resolve()), "pid": os.getpid()})
    except OSError:  # an unwritable home: the server still runs; commands then need --state-dir
        pass


def read_address(state_dir: Path) -> ServerAddress | None:
    """The recorded address, or None when there is none or it cannot be read."""
    try:
        raw = json.loads((state_dir / ADDRESS_FILE).read_text())
        return ServerAddress(url=str(raw["url"]), pid=int(raw["pid"]), model=str(raw.get("model") or ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def clear_address(state_dir: Path) -> None:
    """Remove the file and the index entry if they name this process (another server may have
    written the file since)."""
    _entry_path(state_dir, os.getpid()).unlink(missing_ok=True)
    addr = read_address(state_dir)
    if addr is not None and addr.pid == os.getpid():
        (state_dir / ADDRESS_FILE).unlink(missing_ok=True)


def servers_dir() -> Path:
    """The OS user's index of running servers: `~/.clawbridge/servers/` (HOME decides, so a test
    with its own HOME has its own index)."""
    return Path.home() / ".clawbridge" / "servers"


def _entry_path(state_dir: Path, pid: int) -> Path:
    key = hashlib.sha256(str(state_dir.expanduser().resolve()).encode()).hexdigest()[:16]
    return servers_dir() / f"{key}-{pid}.json"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists and is this OS user's (a zombie counts; `listening`
    tells those apart)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or another OS user's: not our server
        return False
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()  # root may signal anyone's process
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # no /proc here: the signal is all we can tell
    except OSError:
        return False


def owns_listener(pid: int, url: str) -> bool | None:
    """Whether process `pid` holds a socket listening on `url`'s port (Linux /proc: the listening
    sockets' inodes in /proc/net/tcp*, against the pid's open files); None where /proc cannot tell."""
    port = urlsplit(url).port
    if port is None or not Path("/proc/net/tcp").exists():
        return None
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return False
    fds = Path(f"/proc/{pid}/fd")
    try:
        names = os.listdir(fds)
    except OSError:
        return False  # not ours to read: not our server
    for name in names:
        with contextlib.suppress(OSError):
            if os.readlink(fds / name) in inodes:
                return True
    return False


def listening(url: str, timeout_s: float = LIVENESS_TIMEOUT_S) -> bool:
    """Whether something accepts a TCP connection at `url`'s host and port."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        return False
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            return True
    except OSError:
        return False


def server_for(state_dir: Path) -> RunningServer | None:
    """The server running on `state_dir`: its recorded pid is alive and its URL accepts connections
    (see the module invariants); None when no server runs there."""
    addr = read_address(state_dir)
    if addr is None or not pid_alive(addr.pid) or owns_listener(addr.pid, addr.url) is False \
            or not listening(addr.url):
        return None
    return RunningServer(state_dir=state_dir, address=addr)


def running_servers() -> list[RunningServer]:
    """Every live server in the OS user's index, oldest entry first; entries of servers that are
    gone (killed: pid dead or nothing listening) are removed as they are found."""
    try:
        entries = sorted(servers_dir().glob("*.json"), key=lambda p: p.stat().st_mtime)
    except OSError:
        return []
    found: dict[Path, RunningServer] = {}
    for entry in entries:
        try:
            raw = json.loads(entry.read_text())
            state_dir, pid = Path(str(raw["state_dir"])), int(raw["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours: leave it
        live = server_for(state_dir)
        if live is None or live.address.pid != pid:
            with contextlib.suppress(OSError):
                entry.unlink()
            continue
        found[state_dir] = live
    return list(found.values())
