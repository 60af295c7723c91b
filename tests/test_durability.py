"""Durable on power loss, not only on `kill -9` (`clawbridge.runtime.durable`): every file something else
names (a checkpoint the store commits, the key files, `server.json`) is flushed, with the folder
that names it, before it is named; a checkpoint torn anyway is skipped at the restart.

A power loss cannot be simulated in a test, so the claim is checked where it is decided: which
files and folders went through `fsync` (by inode, so a file flushed under its temporary name and
then renamed counts) at the moment the store commits the step that names the checkpoint. A torn
checkpoint is made by truncating its files, as a power loss between the rename and the data
reaching the disk leaves them.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clawbridge.backend import CheckpointDamaged
from clawbridge.runtime import durable
from clawbridge.runtime.address import ADDRESS_FILE, read_address, write_address
from clawbridge.runtime.keys import ensure_key
from clawbridge.store import Store
from clawbridge.store.training import TrainingStore
from clawbridge.store.versions import VersionStore
from tests.test_trainer_loop import rewarded_session

Inode = tuple[int, int]


class Flushes:
    """Every `os.fsync` of this process, in order, by the inode of what it flushed."""

    def __init__(self) -> None:
        self.order: list[Inode] = []
        self._lock = threading.Lock()

    def seq(self, path: Path) -> int | None:
        """When `path` (as it is named now) was last flushed (None: never)."""
        st = path.stat()
        key = (st.st_dev, st.st_ino)
        with self._lock:
            hits = [i for i, k in enumerate(self.order) if k == key]
        return hits[-1] if hits else None


@pytest.fixture
def flushes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Flushes]:
    seen = Flushes()
    real = os.fsync

    def fsync(fd: Any) -> None:
        st = os.fstat(fd)
        with seen._lock:
            seen.order.append((st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    yield seen


def test_key_files_and_server_json_are_flushed_with_their_folder(flushes: Flushes, tmp_path: Path) -> None:
    key = ensure_key(tmp_path, "admin_key", None, "cba")
    path = tmp_path / "admin_key"
    assert path.read_text().strip() == key.value and oct(path.stat().st_mode & 0o777) == "0o600"
    file_seq, dir_seq = flushes.seq(path), flushes.seq(tmp_path)
    assert file_seq is not None and dir_seq is not None and dir_seq > file_seq, (file_seq, dir_seq)
    assert ensure_key(tmp_path, "admin_key", None, "cba").value == key.value  # the first writer's key stays
    assert [p.name for p in tmp_path.iterdir()] == ["admin_key"]  # no temporary file left behind

    write_address(tmp_path, "http://127.0.0.1:8400/")
    server = tmp_path / ADDRESS_FILE
    file_seq, dir_seq = flushes.seq(server), flushes.seq(tmp_path)
    assert file_seq is not None and dir_seq is not None and dir_seq > file_seq, (file_seq, dir_seq)
    addr = read_address(tmp_path)
    assert addr is not None and addr.url == "http://127.0.0.1:8400" and addr.pid == os.getpid()


def test_write_atomic_leaves_the_old_file_when_writing_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "server.json"
    durable.write_atomic(target, "old")

    def full(fd: int, data: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError):
        durable.write_atomic(target, "new")
    monkeypatch.undo()
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["server.json"]


# ----------------------------------------------------------------- checkpoints, the local backend


def _commit_order(store: Store, flushes: Flushes, root: Path, seen: dict[int, dict[str, Any]]) -> None:
    """Wrap `TrainingStore.commit_step`: at the moment a step commits, note for its checkpoint
    folder when each file, the folder and its parent were last flushed."""
    real = TrainingStore.commit_step

    def commit_step(self: TrainingStore, step: int, policy_version: int, metrics: dict[str, Any],
                    turn_ids: Any, checkpoint: str | None = None, identity: Any = None) -> None:
        assert checkpoint is not None
        folder = Path(checkpoint)
        files = {p.name: flushes.seq(p) for p in folder.iterdir()}
        seen[policy_version] = {"files": files, "folder": flushes.seq(folder), "parent": flushes.seq(folder.parent)}
        real(self, step, policy_version, metrics, turn_ids, checkpoint, identity)

    TrainingStore.commit_step = commit_step  # type: ignore[method-assign]


def test_a_checkpoint_is_on_disk_before_the_store_commits_it(flushes: Flushes, tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    from tests.test_checkpoints import _local_loop

    state = tmp_path / "state"
    seen: dict[int, dict[str, Any]] = {}
    real = TrainingStore.commit_step

    async def train() -> None:
        backend, store, loop = await _local_loop(tiny_model_dir, state)
        _commit_order(store, flushes, state / "checkpoints" / "local", seen)
        try:
            rewarded_session(store, "s0")
            report = await loop.run_once()
            assert report is not None and report.ok
        finally:
            TrainingStore.commit_step = real  # type: ignore[method-assign]
            await backend.close()
            store.close()

    asyncio.run(train())
    (at_commit,) = seen.values()
    files = at_commit["files"]
    assert set(files) == {"model.safetensors", "optimizer.pt", "trainer_state.json"}, files
    assert all(seq is not None for seq in files.values()), files
    assert at_commit["folder"] is not None and at_commit["folder"] > max(files.values())
    assert at_commit["parent"] is not None and at_commit["parent"] > at_commit["folder"], at_commit


def _truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)


def test_resume_skips_a_torn_newest_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    """v2's checkpoint is cut short (as a power loss before its data was flushed leaves it): the
    restart serves v1's weights with v1's optimizer state under a new version, kind `restore`,
    and trains on; with every checkpoint torn it refuses, naming the damage."""
    from clawbridge_local.trainer.intact import check_intact
    from safetensors.torch import load_file

    from tests.test_checkpoints import _local_loop

    state = tmp_path / "state"

    async def steps(n: int) -> None:
        backend, store, loop = await _local_loop(tiny_model_dir, state)
        try:
            for i in range(n):
                rewarded_session(store, f"s{len(TrainingStore(store).steps(100))}-{i}")
                report = await loop.run_once()
                assert report is not None and report.ok
        finally:
            await backend.close()
            store.close()

    asyncio.run(steps(2))
    store = Store.open(state)
    rows = {r.version: r for r in VersionStore(store).listing(10)}
    store.close()
    assert sorted(rows) == [0, 1, 2]
    v1, v2 = Path(str(rows[1].checkpoint)), Path(str(rows[2].checkpoint))
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
        copy = tmp_path / f"whole-{name}"
        copy.write_bytes((v2 / name).read_bytes())
        _truncate(v2 / name)
        with pytest.raises(CheckpointDamaged, match=re.escape(name)):
            check_intact(v2)
        (v2 / name).write_bytes(copy.read_bytes())
    check_intact(v2)
    _truncate(v2 / "model.safetensors")

    async def resume() -> dict[str, Any]:
        backend, store, loop = await _local_loop(tiny_model_dir, state)
        try:
            out: dict[str, Any] = {"served": backend.sampler().policy_version, "trained": loop.keeper.trained}
            out["row"] = VersionStore(store).get(out["served"])
            out["probe"] = await backend.save_checkpoint("probe")  # the trainer's weights now
            rewarded_session(store, "after")
            report = await loop.run_once()
            assert report is not None and report.ok
            out["next"] = report.policy_version
            return out
        finally:
            await backend.close()
            store.close()

    out = asyncio.run(resume())
    row = out["row"]
    assert out["served"] == 3 and row is not None and (row.kind, row.source_version, row.status) == ("restore", 1,
                                                                                                     "committed")
    assert row.checkpoint == str(v1) and out["trained"] == (3, str(v1)) and out["next"] == 4
    probe, want = load_file(str(Path(out["probe"]) / "model.safetensors")), load_file(str(v1 / "model.safetensors"))
    assert set(probe) == set(want) and all(probe[k].equal(want[k]) for k in want)

    for folder in (state / "checkpoints" / "local").iterdir():  # every checkpoint left, torn
        _truncate(folder / "trainer_state.json")

    async def refused() -> None:
        from clawbridge_local.backend import LocalBackend

        from clawbridge.trainer.checkpoints import CheckpointKeeper
        from clawbridge.trainer.identity import checkpoint_identity
        from tests.test_local_training import settings_for

        settings = settings_for(tiny_model_dir, state, 8)
        backend = LocalBackend(settings, progress=False)
        await backend.start()
        store = Store.open(state)
        try:
            await CheckpointKeeper(store, backend, checkpoint_identity(settings, backend.name)).resume()
        finally:
            await backend.close()
            store.close()

    with pytest.raises(CheckpointDamaged, match=r"trainer_state\.json"):
        asyncio.run(refused())


PROBE = """
import os, sys, time
from pathlib import Path
from clawbridge.store import Store, TurnRecord
from clawbridge.store.versions import VersionStore

def turn(sid):
    return TurnRecord(session_id=sid, turn_type="main", status="ok", model="m", prompt_token_ids=[1],
                      completion_token_ids=[2], completion_logprobs=[-0.1], policy_version=0, finish_reason="stop",
                      request_json="{}", response_json=None, created_at=time.time(), completed_at=time.time())

store = Store.open(Path(sys.argv[1]))
store.record_turn(turn("warm"))
os.write(1, b"MARK turn\\n")
store.record_turn(turn("a"))
os.write(1, b"MARK reserve\\n")
VersionStore(store).reserve("step")
os.write(1, b"MARK turn\\n")
store.record_turn(turn("b"))
os.write(1, b"MARK end\\n")
os._exit(0)
"""


def test_a_reserved_version_reaches_the_disk_and_a_turn_does_not_wait_for_it(tmp_path: Path) -> None:
    """Seen in the system calls (strace): reserving a version flushes the WAL before it returns
    (a power loss never hands its number out again); recording a turn does not (it stays as fast
    as before: durable against `kill -9`, the project's rule for turns)."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (it shows which commits flush the WAL)")
    (tmp_path / "probe.py").write_text(PROBE)
    trace = tmp_path / "trace.txt"
    done = subprocess.run([strace, "-f", "-y", "-e", "trace=fsync,fdatasync,write", "-o", str(trace),
                           sys.executable, str(tmp_path / "probe.py"), str(tmp_path / "state")],
                          capture_output=True, text=True, timeout=120, env={**os.environ})
    if done.returncode != 0 and "ptrace" in done.stderr.lower():
        pytest.skip(f"strace cannot trace processes here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr
    phase, flushed = "start", {}
    for line in trace.read_text().splitlines():
        if '"MARK ' in line:
            phase = line.split('"MARK ', 1)[1].split("\\n", 1)[0]
            flushed.setdefault(phase, 0)
        elif ("fdatasync(" in line or "fsync(" in line) and "clawbridge.db-wal" in line:
            flushed[phase] = flushed.get(phase, 0) + 1
    assert flushed.get("reserve", 0) >= 1 and flushed.get("turn", 0) == 0, flushed
