"""Users being forgotten, and what a call that began before that may no longer record.

A forget deletes a user's rows; a call of hers that was running then would record its turn
afterwards and bring her back (`Store.record_turns` creates the session again). So each call
notes the forget epoch when it begins (`clawbridge.proxy.inflight`), and the store checks every
turn against these tombstones before writing it.

Invariants:
- The epoch counts forget events (each `bury` and each `buried` adds one); it only grows.
- From `bury(user)` until `buried(user)` no turn of `user` is recorded, whatever its epoch.
- After `buried(user)` at epoch D, a turn of `user` from a call that began at an epoch < D (the
  forgotten user's) is refused; a call that began at D or later is a new user of that name's.
- Below `clawbridge.store.store` (which holds one `Tombstones`): it imports nothing of the store.
- Kept in memory only: a restart ends every call, so nothing older than the process can write.
  A finished grave is dropped (`sweep`) once no call that began before it runs, so a forgotten
  name stays in memory no longer than a call of hers could. Thread safe (the store's writer thread
  checks, the event loop buries and sweeps).
"""

from __future__ import annotations

import threading


class UserForgotten(RuntimeError):
    """A turn of a user who was forgotten (or is being forgotten) since its call began."""


class Tombstones:
    """The store's graves (module invariants)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch = 0
        self._graves: dict[str, int | None] = {}
        """User -> the epoch their forget finished at (None: being forgotten now)."""

    @property
    def epoch(self) -> int:
        """Now: what a call notes when it begins."""
        return self._epoch

    def bury(self, user: str) -> int:
        """`user` is being forgotten from now on; returns the new epoch."""
        with self._lock:
            self._epoch += 1
            self._graves[user] = None
            return self._epoch

    def buried(self, user: str) -> int:
        """`user`'s forget is over (her rows are deleted); returns the new epoch."""
        with self._lock:
            self._epoch += 1
            self._graves[user] = self._epoch
            return self._epoch

    def refuses(self, user: str | None, epoch: int | None) -> bool:
        """Whether a turn of `user` from a call that began at `epoch` (None: unknown, treated as
        now) may not be recorded."""
        if user is None:
            return False
        with self._lock:
            if user not in self._graves:
                return False
            at = self._graves[user]
            return at is None or (epoch is not None and epoch < at)

    def check(self, user: str | None, epoch: int | None) -> None:
        """`UserForgotten` when `refuses(user, epoch)`."""
        if self.refuses(user, epoch):
            raise UserForgotten(f"user {user!r} was forgotten after this call began; its turn is not recorded")

    def sweep(self, oldest_running: int | None) -> None:
        """Drop the finished graves no running call can reach: those finished at or before
        `oldest_running`, the epoch of the oldest call still running (None: no call runs)."""
        with self._lock:
            for user, at in list(self._graves.items()):
                if at is not None and (oldest_running is None or at <= oldest_running):
                    del self._graves[user]

    def __len__(self) -> int:
        return len(self._graves)
