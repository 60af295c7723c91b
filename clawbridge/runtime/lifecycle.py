"""Ending sessions: one service used by every path that ends one.

`/rl/end_session`, the dashboard's end action, Claw-R1's complete_trajectory, a session key's
refresh (`/rl/start_session` with the key of an active session), `clawbridge sessions end` and the
idle reaper all go through `SessionLifecycle`, so ending a session means one thing:
- the session ends once (`end_reason` says how), and
- a session its client manages (a session key's, a trajectory's) that ends with no reward at all
  gets `default_reward_value` on its last ok turn, in the same transaction
  (`default_session_reward`; AReaL's "a default reward of 0 is assigned"; never when a judge is
  configured: its verdicts are the reward; `clawbridge.store.lifecycle` keeps the rule), and
- in the server, the trainer loop is woken after a session ended (`ProxyState.end_session`,
  `ProxyState.end_idle`), so its turns are looked at now instead of at the next poll; the CLI
  cannot wake it: a running server's trainer finds the session at its next poll.

Invariant: every method commits before it returns; in the server they run on the store writer's
thread, and the trainer is woken on the event loop afterwards (its wake-up is an asyncio event).
"""

from __future__ import annotations

from clawbridge.config import Settings
from clawbridge.store import Store
from clawbridge.store.lifecycle import DefaultReward


def default_reward(settings: Settings) -> DefaultReward | None:
    """The default reward `settings` ask for (None: off, or a judge gives the rewards)."""
    if not settings.default_session_reward or settings.judge != "off":
        return None
    return DefaultReward(settings.default_reward_value)


class SessionLifecycle:
    """Ends sessions by the module's rule (the default reward of `settings`)."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store = store
        self.default = default_reward(settings)
        """What an unrewarded managed session gets when it ends (None: nothing)."""

    def end(self, session_id: str, reason: str = "end_session") -> bool:
        """End `session_id`; False when it was unknown or already ended."""
        return self.store.end_session(session_id, reason, self.default)

    def end_idle(self, idle_s: float) -> list[str]:
        """End every active session untouched for `idle_s` seconds; their ids."""
        return self.store.end_idle_sessions(idle_s, self.default)

    def start_keyed(self, key: str, task_id: str | None, user_id: str | None) -> str:
        """A new session on session key `key`; the session it replaces (if any) ends ("replaced")."""
        return self.store.start_keyed_session(key, task_id, user_id, self.default)
