"""The SQLite store: schema and migrations, exact blobs, concurrent readers, refusing newer schemas."""

from __future__ import annotations

import math
import sqlite3
import struct
import time
from pathlib import Path

import pytest

from clawbridge.store import Store, StoreError, TurnRecord
from clawbridge.store.schema import SCHEMA_VERSION


def turn(session_id: str, logprobs: list[float], **kw: object) -> TurnRecord:
    now = time.time()
    values: dict[str, object] = dict(
        session_id=session_id, turn_type="main", status="ok", model="m", prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4_000_000_000, 5, 6][: len(logprobs)], completion_logprobs=logprobs,
        policy_version=2, finish_reason="stop", request_json='{"messages": []}', response_json='{"ok": true}',
        created_at=now, completed_at=now + 0.01)
    values.update(kw)
    return TurnRecord(**values)  # type: ignore[arg-type]


def test_schema_is_versioned_and_wal(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    assert store.schema_version == SCHEMA_VERSION
    mode = sqlite3.connect(store.path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    tables = {r[0] for r in sqlite3.connect(store.path).execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"sessions", "turns", "rewards", "samples", "steps", "meta"} <= tables
    store.close()
    # Re-opening runs no migration twice.
    assert Store.open(tmp_path).schema_version == SCHEMA_VERSION


def test_refuses_a_newer_schema(tmp_path: Path) -> None:
    Store.open(tmp_path).close()
    conn = sqlite3.connect(tmp_path / "clawbridge.db")
    conn.execute("UPDATE meta SET value='999' WHERE key='schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="newer"):
        Store.open(tmp_path)


def test_ids_and_logprobs_are_stored_bit_exact(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    lps = [-1e-300, -0.1 + 1e-17, -math.pi]
    tid = store.record_turn(turn("s", lps), "header")
    t = store.session_view("s")["turns"][0]  # type: ignore[index]
    assert t["turn_id"] == tid
    assert t["completion_token_ids"] == [4_000_000_000, 5, 6]
    assert [struct.pack("<d", x) for x in t["completion_logprobs"]] == [struct.pack("<d", x) for x in lps]
    assert t["prompt_token_ids"] == [1, 2, 3] and t["policy_version"] == 2


def test_turns_are_ordered_and_sessions_reopen(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    store.record_turn(turn("s", [-1.0]), "header")
    store.record_turn(turn("s", [-1.0]), "header", end_reason="done_header")
    assert store.get_session("s").status == "ended"  # type: ignore[union-attr]
    store.record_turn(turn("s", [-1.0]), "header")
    s = store.get_session("s")
    assert s is not None and s.status == "active" and s.turn_count == 3
    assert [t["seq"] for t in store.session_turns("s")] == [0, 1, 2]


def test_rewards_validate_their_target(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    tid = store.record_turn(turn("s", [-1.0]), "header")
    store.record_turn(turn("other", [-1.0]), "header")
    with pytest.raises(StoreError):
        store.add_reward("nope", 1.0, "api")
    with pytest.raises(StoreError):
        store.add_reward("other", 1.0, "api", tid)
    store.add_reward("s", 1.0, "api", tid)
    store.add_reward("s", 0.5, "api")
    assert [(r.turn_id, r.value) for r in store.session_rewards("s")] == [(tid, 1.0), (None, 0.5)]
    stats = store.stats()
    assert stats["rewards"] == 2 and stats["turns"]["main"] == 2


def test_a_second_process_reads_while_one_writes(tmp_path: Path) -> None:
    writer = Store.open(tmp_path)
    reader = Store.open(tmp_path)
    for i in range(20):
        writer.record_turn(turn(f"s{i % 3}", [-1.0]), "header")
        assert len(reader.list_sessions()) == min(i + 1, 3)
    assert sum(s.turn_count for s in reader.list_sessions()) == 20


def test_session_keys_are_stored_hashed(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    sid = store.start_keyed_session("secret-session-key-123", "task")
    assert store.session_for_key("secret-session-key-123") == sid
    raw = (tmp_path / "clawbridge.db").read_bytes() + (tmp_path / "clawbridge.db-wal").read_bytes()
    assert b"secret-session-key-123" not in raw
    assert store.end_session(sid, "end_session") is True
    assert store.session_for_key("secret-session-key-123") is None
    assert store.end_session(sid, "end_session") is False


def test_a_group_commit_writes_each_turn_or_reports_it_alone(tmp_path: Path) -> None:
    """`record_turns` (the proxy writer's group commit): one transaction, a savepoint per turn; a
    turn SQLite refuses (a duplicate id) is rolled back alone and the others are committed."""
    store = Store.open(tmp_path)
    first = turn("s1", [-1.0])
    results = store.record_turns([(first, "header", None), (turn("s2", [-0.5]), "header", "done_header"),
                                  (turn("s1", [-2.0], turn_id=first.turn_id), "header", None),
                                  (turn("s1", [-3.0]), "header", None)])
    assert results[0] is None and results[1] is None and results[3] is None
    assert isinstance(results[2], sqlite3.IntegrityError)
    other = Store.open(tmp_path)  # another connection sees them committed
    assert [t["completion_logprobs"] for t in other.session_turns("s1")] == [[-1.0], [-3.0]]
    s2 = other.get_session("s2")
    assert s2 is not None and s2.status == "ended" and s2.end_reason == "done_header"


def test_the_writer_groups_waiting_turns_and_answers_each_after_its_commit(tmp_path: Path) -> None:
    """Turns that queue while the store is busy are written in one transaction; each caller's
    `record_turn` returns only once that transaction committed."""
    import asyncio
    import threading

    from clawbridge.proxy.state import StoreWriter
    from tests.support import wait_for

    store = Store.open(tmp_path)
    groups: list[int] = []
    real = store.record_turns

    def spy(turns: list[tuple[TurnRecord, str, str | None]]) -> list[Exception | None]:
        groups.append(len(turns))
        return real(turns)

    store.record_turns = spy  # type: ignore[method-assign]
    writer = StoreWriter(store)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # a trainer commit holding the store's lock
        with store.write():
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30)
    reader = Store.open(tmp_path)

    async def main() -> None:
        first = asyncio.ensure_future(writer.record_turn(turn("a", [-1.0]), "header", None))
        await asyncio.to_thread(wait_for, lambda: groups == [1], 30.0, "the first turn to wait for the lock")
        rest = [asyncio.ensure_future(writer.record_turn(turn("a", [-float(i)]), "header", None))
                for i in range(2, 6)]
        await asyncio.sleep(0)
        assert not first.done() and reader.session_turns("a") == []
        release.set()
        await asyncio.gather(first, *rest)
        assert [t["completion_logprobs"][0] for t in reader.session_turns("a")] == [-1.0, -2.0, -3.0, -4.0, -5.0]

    try:
        asyncio.run(main())
    finally:
        release.set()
        holder.join(30)
        writer.close()
    assert groups == [1, 4]


def test_wal_checkpoints_run_in_the_background(tmp_path: Path) -> None:
    """`checkpoint_in_background` (what the proxy's store writer turns on): commits no longer
    checkpoint (the connection's wal_autocheckpoint is 0), yet the committed pages reach the
    database file, copied by the checkpointer's thread; every turn stays readable, also by another
    connection; `checkpoint_on_commit` restores SQLite's default after a last checkpoint."""
    from tests.support import wait_for

    store = Store.open(tmp_path)
    db = store.path

    def autocheckpoint() -> int:
        with store.read() as c:
            return int(c.execute("PRAGMA wal_autocheckpoint").fetchone()[0])

    assert autocheckpoint() == 1000
    store.checkpoint_in_background()
    assert autocheckpoint() == 0
    checkpointer = store._checkpointer
    assert checkpointer is not None
    size_before = db.stat().st_size
    big = '{"messages": [{"role": "user", "content": "' + "x" * 100_000 + '"}]}'
    for i in range(100):  # ~10 MB through the WAL
        store.record_turn(turn(f"s{i % 4}", [-0.5], request_json=big))
    wait_for(lambda: checkpointer.checkpoints > 0, 30, "a background checkpoint")
    wait_for(lambda: db.stat().st_size - size_before > 5_000_000, 30, "the committed pages in the database file")
    other = Store.open(tmp_path)
    assert sum(len(other.session_turns(f"s{i}")) for i in range(4)) == 100
    other.close()
    store.checkpoint_on_commit()
    assert autocheckpoint() == 1000 and store._checkpointer is None
    assert not checkpointer._thread.is_alive()
    store.close()


def test_without_background_checkpoints_a_commit_still_checkpoints(tmp_path: Path) -> None:
    """The control for the test above: with the default, the same writes reach the database file
    through SQLite's own checkpoints on commit (so the background thread is what replaced them)."""
    store = Store.open(tmp_path)
    size_before = store.path.stat().st_size
    big = '{"messages": [{"role": "user", "content": "' + "x" * 100_000 + '"}]}'
    for i in range(100):
        store.record_turn(turn(f"s{i % 4}", [-0.5], request_json=big))
    assert store.path.stat().st_size - size_before > 5_000_000
    store.close()


def test_vacuum_truncates_the_wal_while_checkpoints_run_in_the_background(tmp_path: Path) -> None:
    """`vacuum` (what forgetting a user ends with) holds the background checkpointer off, so its
    TRUNCATE checkpoint is never made busy by one running: the WAL is truncated every time."""
    store = Store.open(tmp_path)
    store.checkpoint_in_background()
    assert store._checkpointer is not None
    store._checkpointer.min_interval_s = 0.0  # a checkpoint after every commit: one runs when vacuum starts
    big = '{"messages": [{"role": "user", "content": "' + "x" * 50_000 + '"}]}'
    for i in range(40):
        for j in range(5):
            store.record_turn(turn(f"s{i}-{j}", [-0.5], request_json=big))
        assert store.vacuum(), f"round {i}: the WAL was not truncated"
        assert Path(f"{store.path}-wal").stat().st_size == 0
    store.close()
