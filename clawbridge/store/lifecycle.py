"""Ending a session, with the default reward, in one transaction (the SQL under `clawbridge.runtime.lifecycle`).

Invariants:
- A session ends once: ending an ended or unknown session changes nothing and says so (False).
- The default reward (`DefaultReward`) commits in the same transaction as the end, so a crash
  never leaves a session ended without the reward it was owed.
- It goes on the last ok turn of a session whose `source` is one of `DefaultReward.sources` and
  that has no reward at all when it ends; a session without an ok turn gets none.
- These functions run inside a caller's write transaction (`Store.write()`) and never open one.
"""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass

log = logging.getLogger("clawbridge.store")

DEFAULT_REWARD_SOURCE = "default"
"""`rewards.source` of a default reward."""
MANAGED_SOURCES = ("session_key", "trajectory")
"""Session sources whose client ends its sessions and rewards them: AReaL's /rl/start_session
sessions and Claw-R1's trajectories. Sessions recorded from headers (OpenClaw) are rewarded by the
judge or explicitly, never by default."""


@dataclass(frozen=True)
class DefaultReward:
    """The reward an unrewarded managed session gets when it ends (`default_session_reward`)."""

    value: float
    sources: tuple[str, ...] = MANAGED_SOURCES


def give_default_in(c: sqlite3.Connection, session_id: str, default: DefaultReward | None, now: float) -> str | None:
    """Add `default` to an ended session that is owed it (module invariants); the turn it went on."""
    if default is None:
        return None
    row = c.execute("SELECT source FROM sessions WHERE session_id=?", (session_id,)).fetchone()
    if row is None or row[0] not in default.sources:
        return None
    if c.execute("SELECT 1 FROM rewards WHERE session_id=? LIMIT 1", (session_id,)).fetchone() is not None:
        return None
    last = c.execute("SELECT turn_id FROM turns WHERE session_id=? AND status='ok' ORDER BY seq DESC LIMIT 1",
                     (session_id,)).fetchone()
    if last is None:
        return None
    c.execute("INSERT INTO rewards(session_id, turn_id, value, source, created_at) VALUES(?,?,?,?,?)",
              (session_id, last[0], default.value, DEFAULT_REWARD_SOURCE, now))
    log.info("session %s ended without a reward: default reward %g on %s", session_id, default.value, last[0])
    return str(last[0])


def end_in(c: sqlite3.Connection, session_id: str, reason: str, default: DefaultReward | None, now: float) -> bool:
    """End an active session (`end_reason` `reason`) and give it its default reward; False when it
    was unknown or already ended."""
    cur = c.execute(
        "UPDATE sessions SET status='ended', end_reason=?, ended_at=?, updated_at=?, key_hash=NULL "
        "WHERE session_id=? AND status='active'",
        (reason, now, now, session_id),
    )
    if cur.rowcount == 0:
        return False
    give_default_in(c, session_id, default, now)
    return True
