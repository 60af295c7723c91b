"""WAL checkpoints on a thread of their own, so a commit never waits for one.

SQLite in WAL mode appends each commit to the -wal file; a checkpoint copies those pages back into
the database file (and syncs it). By default the connection that commits runs a checkpoint itself
whenever the WAL passes 1000 pages, inside that COMMIT. For the proxy that connection is the store
writer's: every few group commits one of them took ~15 ms longer, and every model call waiting on
that commit waited with it (`bench/proxy_overhead.py`, docs/benchmarks.md "Proxy overhead").

Invariants:
- While a `WalCheckpointer` runs, its store's connection does not checkpoint on commit
  (`wal_autocheckpoint=0`); the checkpointer runs PASSIVE checkpoints on its own connection,
  which never block a writer or a reader. `stop` restores the default and runs a last one.
- Each commit wakes it (`committed`); it checkpoints at most once per `min_interval_s`, so bursts of
  commits share one checkpoint, and an idle store runs none.
- Durability is unchanged: a commit is in the WAL before it returns, checkpoint or not.
- A failed checkpoint is logged and retried at the next wake; it never fails a commit.
- `lock` is held for each checkpoint: whoever holds it (`Store.vacuum`, whose TRUNCATE checkpoint
  a running one would make busy) knows none runs. The PRAGMA's statement is stepped to its end, so
  the checkpointer's connection holds no read snapshot between checkpoints.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

log = logging.getLogger("clawbridge.store")

DEFAULT_AUTOCHECKPOINT_PAGES = 1000
"""SQLite's own `wal_autocheckpoint`, restored by `stop`."""


class WalCheckpointer:
    """A daemon thread running `PRAGMA wal_checkpoint(PASSIVE)` after commits (module invariants)."""

    def __init__(self, path: Path, min_interval_s: float = 0.25) -> None:
        self.path = path
        self.min_interval_s = min_interval_s
        self.checkpoints = 0
        """Checkpoints run so far (for tests and the log)."""
        self.lock = threading.Lock()
        """Held while a checkpoint runs."""
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="clawbridge-wal-checkpoint", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        """A transaction committed: there may be pages to copy back."""
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread after a last checkpoint of what was committed."""
        self._stopping.set()
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=30.0)
        try:
            while True:
                self._wake.wait()
                self._wake.clear()
                self._checkpoint(conn)
                if self._stopping.is_set():
                    return
                # Rate limit, not a wait for a condition: commits meanwhile set `_wake` and share
                # the next checkpoint; `stop` cuts the pause short.
                self._stopping.wait(self.min_interval_s)
        finally:
            conn.close()

    def _checkpoint(self, conn: sqlite3.Connection) -> None:
        try:
            with self.lock:
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            self.checkpoints += 1
        except sqlite3.Error as exc:
            log.warning("background WAL checkpoint failed (retried after the next commit): %s", exc)
