"""What `clawbridge users forget` costs: `UserStore.forget` (delete every row of the user's
sessions, VACUUM, truncate the WAL) on a store of N turns (10% of them the forgotten user's),
beside `Store.vacuum()` alone on an identical copy of the store (the baseline: the rebuild that
forget adds to the delete). Recording turns waits for the store lock this long.

Run (seconds):
    . .venv/bin/activate && OMP_NUM_THREADS=1 python bench/forget_user.py --turns 5000
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from clawbridge.store import DB_FILENAME, Store, TurnRecord
from clawbridge.store.users import UserStore


def build(state: Path, turns: int) -> None:
    store = Store.open(state)
    users = UserStore(store)
    for user in ("alice", "bob"):
        users.add(user)
    text = "x" * 8000  # an 8 KB request, 2000 prompt and 200 completion tokens per turn
    for i in range(turns):
        user = "alice" if i % 10 == 0 else "bob"
        store.record_turn(TurnRecord(
            session_id=f"{user}:s{i // 20}", turn_type="main", status="ok", model="m",
            prompt_token_ids=list(range(2000)), completion_token_ids=list(range(200)),
            completion_logprobs=[-0.1] * 200, policy_version=0, finish_reason="stop",
            request_json=json.dumps({"messages": [{"role": "user", "content": text}]}), response_json=None,
            created_at=1.0, completed_at=2.0, user_id=user))
    store.vacuum()
    store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=5000)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="forget-bench-"))
    a, b = root / "a", root / "b"
    build(a, args.turns)
    b.mkdir()
    shutil.copyfile(a / DB_FILENAME, b / DB_FILENAME)
    size_mb = (a / DB_FILENAME).stat().st_size / 1e6
    store_a, store_b = Store.open(a), Store.open(b)
    t0 = time.perf_counter()
    report = UserStore(store_a).forget("alice")
    forget_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    store_b.vacuum()
    vacuum_s = time.perf_counter() - t0
    after_mb = store_a.path.stat().st_size / 1e6
    store_a.close()
    store_b.close()
    print(f"store {size_mb:.1f} MB, {args.turns} turns; forget alice ({report.deleted.get('turns', 0)} turns, "
          f"{report.deleted.get('sessions', 0)} sessions): {forget_s:.2f} s (store then {after_mb:.1f} MB, "
          f"WAL truncated: {report.wal_truncated}); baseline VACUUM alone of the same store: {vacuum_s:.2f} s")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
