"""Numbers the store gives once, ever: policy versions and training steps.

A number is taken from a persisted counter (`counters` table), never from the rows that exist, so
deleting rows (forgetting a user deletes their lane's versions and steps, which may be the newest)
never hands out a number again. Operates inside the caller's transaction.

Invariants:
- `take` returns a number greater than every number of that name given before in this store,
  across restarts (the counter is a committed row) and whatever rows were deleted since.
- The counter only grows: it is set to the number given, in the same transaction that uses it, so
  a rolled-back transaction gives nothing out (its number is given again, to nobody else before).
- The migration that created the table (schema v8) seeded each counter with the highest number the
  store had seen until then (versions: reserved, recorded on turns and on steps).
"""

from __future__ import annotations

import sqlite3
from typing import Literal

CounterName = Literal["policy_version", "step"]


def take(c: sqlite3.Connection, name: CounterName, above: int | None = None) -> int:
    """Inside an open write transaction: the next number of `name`, also greater than `above` when
    given (a number seen elsewhere in the store); the counter moves to the number returned."""
    row = c.execute("SELECT value FROM counters WHERE name=?", (name,)).fetchone()
    number = max(int(row[0]) if row is not None else 0, above if above is not None else 0) + 1
    c.execute("INSERT INTO counters(name, value) VALUES(?, ?) ON CONFLICT(name) DO UPDATE SET value=excluded.value",
              (name, number))
    return number
