"""The training side of the CLI: --version, training options on `up`, `sessions end`,
`checkpoints list` and `rollback` (a new version, never a reused one), on a real store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clawbridge.runtime.instance import StateDirLock
from clawbridge.store import Store
from clawbridge.store.versions import VersionStore
from tests.test_cli import _seed_store, cli

IDENTITY = {"backend": "local", "model": "tiny", "model_hash": "abc", "lora_rank": 8}


def _seed_versions(state: Path) -> None:
    store = Store.open(state)
    versions = VersionStore(store)
    versions.commit_base("/ckpt/v00000000-base", IDENTITY)
    for _ in range(2):
        v = versions.reserve("step")
        versions.commit(v, f"/ckpt/v{v:08d}-step", IDENTITY)
    versions.reserve("step")  # left reserved, as by a killed server: its number stays used
    store.close()


def test_version_flag() -> None:
    out = cli("--version").stdout
    assert out.startswith("clawbridge ") and len(out.split()) >= 2


@pytest.mark.parametrize("cmd", [["checkpoints", "list"], ["rollback"], ["sessions", "end"]])
def test_training_commands_have_help(cmd: list[str]) -> None:
    out = cli(*cmd, "--help").stdout
    assert "Usage" in out and len(out) > 200


def test_up_takes_training_options() -> None:
    out = " ".join(cli("up", "--help").stdout.split())
    for flag in ("--batch-size", "--learning-rate", "--lora-rank", "--train", "--no-train", "--method"):
        assert flag in out, flag


def test_up_training_options_reach_the_settings(tmp_path: Path) -> None:
    # The options are validated like every setting: a bad --method is a configuration error.
    bad = cli("up", "--model", str(tmp_path), "--state-dir", str(tmp_path), "--method", "nope", check=False)
    assert bad.returncode == 2 and "method" in bad.stderr


def test_sessions_end(tmp_path: Path) -> None:
    _seed_store(tmp_path)
    assert "ended session cli-s" in cli("sessions", "end", "cli-s", "--state-dir", str(tmp_path)).stdout
    assert "already ended" in cli("sessions", "end", "cli-s", "--state-dir", str(tmp_path)).stdout
    missing = cli("sessions", "end", "nope", "--state-dir", str(tmp_path), check=False)
    assert missing.returncode == 1 and "no session" in missing.stderr
    view = json.loads(cli("sessions", "show", "cli-s", "--json", "--state-dir", str(tmp_path)).stdout)
    assert view["status"] == "ended" and view["end_reason"] == "end_session"


def test_checkpoints_list_and_rollback_makes_a_new_version(tmp_path: Path) -> None:
    _seed_versions(tmp_path)
    listed = json.loads(cli("checkpoints", "list", "--json", "--state-dir", str(tmp_path)).stdout)
    assert [r["version"] for r in listed] == [2, 1, 0]
    table = cli("checkpoints", "list", "--state-dir", str(tmp_path)).stdout
    assert "v2" in table and "base" in table

    done = cli("rollback", "1", "--state-dir", str(tmp_path))
    assert "v4" in done.stdout and "v1" in done.stdout  # v3 was reserved once: never reused
    store = Store.open(tmp_path)
    last = VersionStore(store).last_committed()
    store.close()
    assert last is not None and (last.version, last.kind, last.source_version) == (4, "rollback", 1)
    assert last.checkpoint == "/ckpt/v00000001-step"

    missing = cli("rollback", "3", "--state-dir", str(tmp_path), check=False)
    assert missing.returncode == 1 and "no committed checkpoint" in missing.stderr


def test_rollback_stays_in_its_lane(tmp_path: Path) -> None:
    """Offline, `rollback N` with N of alice's adapter is refused (it would serve her adapter to
    everyone from the next `up`), and changes nothing; `--user alice` rolls her lane back, and
    `--user alice` with a shared version is refused too."""
    _seed_versions(tmp_path)  # shared v0-v2, v3 reserved
    store = Store.open(tmp_path)
    alice = VersionStore(store, "alice")
    alice.commit_base("/ckpt/users/alice/base", IDENTITY)  # v4
    hers = alice.reserve("step")  # v5
    alice.commit(hers, "/ckpt/users/alice/v5", IDENTITY)
    store.close()

    refused = cli("rollback", str(hers), "--state-dir", str(tmp_path), check=False)
    assert refused.returncode == 1 and "user alice's adapter" in refused.stderr and "--user alice" in refused.stderr
    crossed = cli("rollback", "1", "--user", "alice", "--state-dir", str(tmp_path), check=False)
    assert crossed.returncode == 1 and "shared policy" in crossed.stderr
    store = Store.open(tmp_path)
    shared_last, alice_last = VersionStore(store).last_committed(), VersionStore(store, "alice").last_committed()
    store.close()
    assert shared_last is not None and shared_last.version == 2 and alice_last is not None and alice_last.version == hers

    done = cli("rollback", "4", "--user", "alice", "--state-dir", str(tmp_path))
    assert "alice" in done.stdout and "v6" in done.stdout
    store = Store.open(tmp_path)
    shared_last, alice_last = VersionStore(store).last_committed(), VersionStore(store, "alice").last_committed()
    store.close()
    assert shared_last is not None and shared_last.version == 2  # the shared policy is untouched
    assert alice_last is not None and (alice_last.version, alice_last.kind, alice_last.source_version) == (
        6, "rollback", 4) and alice_last.checkpoint == "/ckpt/users/alice/base"


def test_rollback_refuses_while_a_server_holds_the_state_dir(tmp_path: Path) -> None:
    _seed_versions(tmp_path)
    lock = StateDirLock(tmp_path)
    lock.acquire()
    lock.record("http://127.0.0.1:8400")
    try:
        busy = cli("rollback", "1", "--state-dir", str(tmp_path), check=False)
    finally:
        lock.release()
    assert busy.returncode == 1 and "http://127.0.0.1:8400" in " ".join(busy.stderr.split())


def test_status_says_what_training_waits_for(tmp_path: Path) -> None:
    _seed_store(tmp_path)  # one active session with two answered turns, no reward

    def waiting() -> tuple[dict[str, object], str]:
        info = json.loads(cli("status", "--json", "--state-dir", str(tmp_path)).stdout)
        text = " ".join(cli("status", "--state-dir", str(tmp_path)).stdout.split())
        return info["trainer"]["waiting"], text

    w, text = waiting()
    assert (w["active_sessions"], w["active_session_turns"], w["unrewarded_turns"]) == (1, 2, 0)
    assert w["datums_until_next_step"] == 8 and "1 active session(s) to end" in text
    cli("sessions", "end", "cli-s", "--state-dir", str(tmp_path))
    w, text = waiting()
    assert (w["active_sessions"], w["unrewarded_turns"]) == (0, 2)
    assert w["first_unrewarded_drop_at"] is not None and "rewards for 2 turn(s)" in text
    cli("reward", "cli-s", "1", "--state-dir", str(tmp_path))
    w, _ = waiting()
    assert w["unrewarded_turns"] == 0
