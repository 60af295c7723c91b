"""Durable SQLite store shared by the proxy, rewards and trainer."""

from clawbridge.store.store import DB_FILENAME, RewardRow, SessionRow, Store, StoreError, TurnRecord, new_id

__all__ = ["DB_FILENAME", "RewardRow", "SessionRow", "Store", "StoreError", "TurnRecord", "new_id"]
