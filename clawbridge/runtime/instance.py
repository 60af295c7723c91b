"""One server per state dir, and a port that is free before anything loads.

`clawbridge up` takes an exclusive `flock` on `<state_dir>/server.lock` before the backend loads
a model, and binds its listening socket right after; a second `up` on the same state dir (or on a
port in use) exits at once with a message naming what is in the way, instead of loading a model
for minutes and then training from the same store.

Invariants:
- The lock is held for the life of the process and released by the kernel when it ends, however
  it ends (`kill -9` included): a stale lock file never blocks a restart.
- The lock file names the holder (pid, and its URL once bound), written after the lock is taken;
  a reader that finds the lock held reports what the file says.
- The listening socket handed to uvicorn is the one bound here, so nothing can take the port
  between the check and the serve.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from pathlib import Path

LOCK_FILE = "server.lock"


class StateDirBusy(RuntimeError):
    """Another clawbridge server holds this state dir."""


class PortInUse(RuntimeError):
    """The address to listen on is taken."""


class StateDirLock:
    """An exclusive, process-lifetime lock on a state dir (see the module invariants)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.path = state_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise `StateDirBusy` naming the holder's pid and URL. Never waits."""
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # it will hold every conversation
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise StateDirBusy(self._busy_message()) from None
        self._fd = fd
        self.record(url=None)

    def record(self, url: str | None) -> None:
        """Write this process's pid (and URL, once known) into the held lock file."""
        if self._fd is None:
            raise RuntimeError("the state dir lock is not held")
        data = json.dumps({"pid": os.getpid(), "url": url}).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        """Release the lock (idempotent); the file stays, naming nobody who holds it."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _busy_message(self) -> str:
        holder = read_holder(self.path)
        who = f"pid {holder[0]}" if holder and holder[0] else "another process"
        where = f" at {holder[1]}" if holder and holder[1] else " (still starting: not listening yet)"
        return (
            f"state dir {self.state_dir} is in use by the clawbridge server {who}{where}. "
            "One server per state dir: stop that one first (its pid above), or pass another --state-dir."
        )


def read_holder(path: Path) -> tuple[int | None, str | None] | None:
    """(pid, url) as the lock file names them, or None when it names nobody."""
    try:
        raw = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    pid = raw.get("pid")
    url = raw.get("url")
    return (int(pid) if isinstance(pid, int) else None, str(url) if url else None)


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (not yet listening), or `PortInUse` saying which port."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6 and host == "::":
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(
                f"port {port} on {host} is already in use (another clawbridge or another program); "
                "pass --port to choose another",
            ) from None
        raise
    sock.set_inheritable(True)
    return sock
