"""Training you can trust (clawbridge.trainer.checkpoints): a process killed at any moment of a
step restarts on the last committed version with its optimizer state, no version number is used
for two sets of weights, and every consumed sample is in the weights exactly once.

A "kill" here is a `SimulatedCrash` (a BaseException nothing catches) raised at a chosen moment,
after which everything in memory is thrown away and a new backend and loop are built on the same
state dir (the store file, and the checkpoints "on disk"), just as after `kill -9`: fast, so many
random kill sequences run. The real thing (a process, SIGKILL, every backend) is in
`tests/test_kill.py` and `tests/test_kill_hosted.py`. Checkpoint retention is tested here too.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest

from clawbridge.config import Settings
from clawbridge.serving.sampler import FakeSampler
from clawbridge.store import Store
from clawbridge.store.training import TrainingStore
from clawbridge.store.versions import VersionStore
from clawbridge.trainer import FakeTrainingBackend, TrainerConfig, TrainerLoop
from clawbridge.trainer.checkpoints import CheckpointKeeper
from clawbridge.trainer.fake import SimulatedCrash
from clawbridge.trainer.identity import CheckpointMismatch, checkpoint_identity
from tests.test_trainer_loop import INFO, consumed, rewarded_session

CRASH_POINTS = ("train", "publish", "checkpoint", "commit")


class Process:
    """One server process's trainer: a fresh backend over the shared disk, a keeper and a loop."""

    def __init__(self, store: Store, disk: dict[str, Any], backend: Any = None) -> None:
        self.backend = backend or FakeTrainingBackend(FakeSampler(script=[7, 8]), INFO, disk=disk)
        self.keeper = CheckpointKeeper(store, self.backend, {"backend": "fake", "model": "m"})
        self.loop = TrainerLoop(store, self.backend, TrainerConfig(batch_size=1, baseline="none", stale_policy="importance_weight"), self.keeper)
        asyncio.run(self.keeper.resume())

    def crash_at(self, where: str) -> None:
        if where == "commit":
            def boom(*_: Any) -> None:
                raise SimulatedCrash("simulated kill during the commit transaction")

            self.loop.tstore.commit_step = boom  # type: ignore[method-assign]
        else:
            self.backend.crash_at = where


def committed_version(store: Store) -> int:
    """The newest committed version (0, the base, before anything committed)."""
    row = VersionStore(store).last_committed()
    return 0 if row is None else row.version


@pytest.mark.parametrize("where", CRASH_POINTS)
def test_kill_during_a_step_restarts_on_the_last_committed_version(tmp_path: Path, where: str) -> None:
    store = Store.open(tmp_path)
    disk: dict[str, Any] = {}
    first = Process(store, disk)
    s1 = rewarded_session(store, "s1")
    assert asyncio.run(first.loop.run_once()).ok
    assert first.backend.sampler().policy_version == 1 == committed_version(store)

    s2 = rewarded_session(store, "s2")
    first.crash_at(where)
    with pytest.raises(SimulatedCrash):
        asyncio.run(first.loop.run_once())
    seen_first = set(first.backend.published)

    second = Process(store, disk)  # "restarted": nothing of the first process's memory survives
    assert second.backend.sampler().policy_version == 1  # serving = the last committed version
    assert second.backend.applied == s1  # the uncommitted update is not in the weights
    report = asyncio.run(second.loop.run_once())
    assert report is not None and report.ok and report.policy_version is not None
    assert report.policy_version not in seen_first  # a number once served is never reused
    assert second.backend.applied == s1 + s2  # every consumed sample trained exactly once
    assert consumed(store) == {s1[0]: 1, s2[0]: report.step}
    store.close()


def test_random_kills_keep_versions_unique_and_samples_trained_once(tmp_path: Path) -> None:
    rng = random.Random(20261123)
    store = Store.open(tmp_path)
    disk: dict[str, Any] = {}
    proc = Process(store, disk)
    served: dict[int, tuple[str, ...]] = {0: ()}  # version -> the weights (applied samples) it named
    kills = 0
    for i in range(12):
        rewarded_session(store, f"s{i}")
        where = rng.choice((None, None, *CRASH_POINTS))
        if where is not None:
            proc.crash_at(where)
        try:
            report = asyncio.run(proc.loop.run_once())
            assert report is not None and report.ok and report.policy_version is not None
            v = report.policy_version
            assert served.setdefault(v, tuple(proc.backend.applied)) == tuple(proc.backend.applied)
        except SimulatedCrash:
            kills += 1
            for v in proc.backend.published:  # what the killed process served, uncommitted or not
                served.setdefault(v, ("uncommitted", str(v)))
            proc = Process(store, disk)
            v = proc.backend.sampler().policy_version
            assert v == committed_version(store)
            assert served[v] == tuple(proc.backend.applied)  # the restored weights are v's
    while (report := asyncio.run(proc.loop.run_once())) is not None:
        assert report.ok
    assert kills >= 3
    done = consumed(store)
    assert all(step is not None for step in done.values())
    assert sorted(proc.backend.applied) == sorted(done)  # each consumed sample in the weights once
    steps = [s for s in TrainingStore(store).steps(100) if s.status == "ok"]
    versions = [s.policy_version for s in steps]
    assert len(versions) == len(set(versions))
    store.close()


def test_failed_update_is_rolled_back_before_the_retry(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    proc = Process(store, {})
    ids = rewarded_session(store, "s1")
    proc.backend.fail_train, proc.backend.fail_after_apply = 1, True  # e.g. a hosted step that timed out
    failed = asyncio.run(proc.loop.run_once())
    assert failed is not None and not failed.ok
    assert proc.backend.applied == []  # undone from the base checkpoint
    assert asyncio.run(proc.loop.run_once()).ok
    assert proc.backend.applied == ids
    store.close()


def test_rollback_serves_an_old_checkpoint_under_a_new_version(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    proc = Process(store, {})
    s1 = rewarded_session(store, "s1")
    asyncio.run(proc.loop.run_once())
    rewarded_session(store, "s2")
    asyncio.run(proc.loop.run_once())
    assert proc.backend.sampler().policy_version == 2
    new = asyncio.run(proc.loop.rollback(1))
    assert new == 3 and proc.backend.sampler().policy_version == 3 and proc.backend.applied == s1
    row = VersionStore(store).get(3)
    assert row is not None and (row.kind, row.source_version, row.status) == ("rollback", 1, "committed")
    s3 = rewarded_session(store, "s3")
    report = asyncio.run(proc.loop.run_once())
    assert report is not None and report.policy_version == 4 and proc.backend.applied == s1 + s3
    store.close()


def test_mismatched_model_refuses_before_the_backend_starts(tiny_model_dir: Path, tmp_path: Path) -> None:
    from clawbridge.devtools.tinymodel import build_tiny_model
    from clawbridge.server import build_state

    other = build_tiny_model(tmp_path / "other", seed=1)
    state = tmp_path / "state"
    trained = Settings(model=str(tiny_model_dir), state_dir=state, lora_rank=8)
    store = Store.open(state)
    VersionStore(store).commit_base("fake://v00000000-base", checkpoint_identity(trained, "fake-training"))
    store.close()

    backend = FakeTrainingBackend(FakeSampler(script=[7, 8]), INFO)
    for settings, differs in (
        (Settings(model=str(other), state_dir=state, lora_rank=8), "model_hash"),
        (Settings(model=str(tiny_model_dir), state_dir=state, lora_rank=16), "lora_rank"),
    ):
        with pytest.raises(CheckpointMismatch) as info:
            asyncio.run(build_state(settings, backend))
        assert differs in str(info.value) and "--state-dir" in str(info.value)
        assert not backend.started


# ----------------------------------------------------------------- the local backend, real torch


async def _local_loop(model: Path, state: Path) -> tuple[Any, Store, TrainerLoop]:
    from clawbridge_local.backend import LocalBackend

    from tests.test_local_training import settings_for

    settings = settings_for(model, state, 8)
    backend = LocalBackend(settings, progress=False)
    await backend.start()
    store = Store.open(state)
    keeper = CheckpointKeeper(store, backend, checkpoint_identity(settings, backend.name))
    await keeper.resume()
    cfg = TrainerConfig(batch_size=1, baseline="none", stale_policy="importance_weight")
    return backend, store, TrainerLoop(store, backend, cfg, keeper)


# The same claims with a real process and a real SIGKILL, on every backend: tests/test_kill.py and
# tests/test_kill_hosted.py.


# ----------------------------------------------------------------- capabilities, checked at start-up


def test_unsupported_training_settings_refuse_before_anything_loads(tmp_path: Path) -> None:
    from clawbridge_fireworks.backend import FireworksBackend
    from clawbridge_tinker.backend import TinkerBackend

    from clawbridge.backend import UnsupportedSettings, check_capabilities
    from clawbridge.server import build_state

    cases = [
        (TinkerBackend, {"kl_coef": 0.1}, "kl_coef = 0"),
        (TinkerBackend, {"lora_rank": 0}, "LoRA only"),
        (FireworksBackend, {"kl_coef": 0.05}, "kl_coef = 0"),
    ]
    for cls, extra, says in cases:
        settings = Settings(model="Qwen/Qwen3-8B", tokenizer=str(tmp_path), state_dir=tmp_path / "s", **extra)
        backend = cls(settings)
        with pytest.raises(UnsupportedSettings, match=says):
            asyncio.run(build_state(settings, backend))
        # --no-train only serves and records: nothing to refuse
        assert not check_capabilities(settings.model_copy(update={"train": False}), backend)


# ----------------------------------------------------------------- retention (keep_checkpoints)


def _pruned(store: Store) -> dict[int, bool]:
    return {r.version: r.pruned_at is not None for r in VersionStore(store).listing(100)}


def test_retention_keeps_the_newest_and_what_a_rollback_serves(tmp_path: Path) -> None:
    from clawbridge.trainer.checkpoints import NoCheckpoint

    store = Store.open(tmp_path)
    disk: dict[str, Any] = {}
    proc = Process(store, disk)
    proc.keeper.keep = 2
    for i in range(3):
        rewarded_session(store, f"s{i}")
        assert asyncio.run(proc.loop.run_once()).ok
    # v0 (base) v1 v2 v3 committed; the newest two keep their checkpoints, and the base is never pruned
    assert sorted(disk) == ["v00000000-base", "v00000002-step", "v00000003-step"]
    assert _pruned(store) == {0: False, 1: True, 2: False, 3: False}
    with pytest.raises(NoCheckpoint, match="pruned"):
        asyncio.run(proc.loop.rollback(1))

    assert asyncio.run(proc.loop.rollback(2)) == 4  # serves v2's checkpoint as v4
    rewarded_session(store, "s3")
    assert asyncio.run(proc.loop.run_once()).policy_version == 5
    # newest two: v5 and v4 (= v2's checkpoint): v3 goes, v2's checkpoint stays for the rollback
    assert sorted(disk) == ["v00000000-base", "v00000002-step", "v00000005-step"]
    assert _pruned(store) == {0: False, 1: True, 2: False, 3: True, 4: False, 5: False}
    rewarded_session(store, "s4")
    assert asyncio.run(proc.loop.run_once()).policy_version == 6
    assert sorted(disk) == ["v00000000-base", "v00000005-step", "v00000006-step"]  # the rollback is old now
    # a restart restores the newest committed version, whose checkpoint was never pruned
    again = Process(store, disk)
    assert again.backend.sampler().policy_version == 6
    store.close()


def test_retention_never_deletes_the_checkpoint_being_restored(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    disk: dict[str, Any] = {}
    proc = Process(store, disk)
    proc.keeper.keep = 1
    for i in range(2):
        rewarded_session(store, f"s{i}")
        asyncio.run(proc.loop.run_once())
    assert sorted(disk) == ["v00000000-base", "v00000002-step"]  # the base is never pruned
    proc.keeper.restoring = "fake://v00000002-step"  # as during a restore of it
    versions = VersionStore(store)
    versions.commit(versions.reserve("rollback", None, 2), "fake://v00000002-step", None)
    v = versions.reserve("step")
    disk["v-new"] = (v, ())
    versions.commit(v, "fake://v-new", None)
    assert asyncio.run(proc.keeper.prune()) == []  # only v2's checkpoint is prunable, and it is restoring
    proc.keeper.restoring = None
    assert asyncio.run(proc.keeper.prune()) == ["fake://v00000002-step"]
    store.close()


def test_retention_deletes_local_checkpoint_folders(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Real files: after three steps with keep_checkpoints 2, only the newest two folders and the
    base's are on disk; the store marks the others pruned and `checkpoints list` says so."""
    from tests.test_cli import cli

    state = tmp_path / "state"

    async def train() -> None:
        backend, store, loop = await _local_loop(tiny_model_dir, state)
        loop.keeper.keep = 2
        try:
            for i in range(3):
                rewarded_session(store, f"s{i}")
                report = await loop.run_once()
                assert report is not None and report.ok
        finally:
            await backend.close()
            store.close()

    asyncio.run(train())
    root = state / "checkpoints" / "local"
    assert sorted(p.name for p in root.iterdir()) == ["v00000000-base", "v00000002-step", "v00000003-step"]
    store = Store.open(state)
    assert _pruned(store) == {0: False, 1: True, 2: False, 3: False}  # the base is never pruned
    store.close()
    listed = json.loads(cli("checkpoints", "list", "--json", "--state-dir", str(state)).stdout)
    assert [(r["version"], r["pruned_at"] is not None) for r in listed] == [(3, False), (2, False), (1, True), (0, False)]
    table = cli("checkpoints", "list", "--state-dir", str(state)).stdout
    assert "pruned" in table and "1 pruned" in table
    refused = cli("rollback", "1", "--state-dir", str(state), check=False)
    assert refused.returncode == 1 and "pruned" in refused.stderr


def test_a_step_failing_after_publish_burns_its_version_number(tmp_path: Path) -> None:
    """The chosen rule (clawbridge.store.versions): a number once reserved is never handed back.
    Here the checkpoint write fails (a full disk) after v2 was published and served a turn: v2 is
    abandoned, the committed v1 weights are served again as v3 (kind restore), the retried step
    publishes v4. Committed versions have a gap, and v2 names only what it served."""
    from tests.test_trainer_loop import record

    store = Store.open(tmp_path)
    proc = Process(store, {})
    s1 = rewarded_session(store, "s1")
    assert asyncio.run(proc.loop.run_once()).ok
    s2 = rewarded_session(store, "s2")
    real_save = proc.backend.save_checkpoint
    served_at_v2: list[str] = []

    async def disk_full(name: str) -> str:
        served_at_v2.append(record(store, "agent", version=proc.backend.sampler().policy_version))
        proc.backend.save_checkpoint = real_save  # type: ignore[method-assign]
        raise OSError(28, "No space left on device")

    proc.backend.save_checkpoint = disk_full  # type: ignore[method-assign]
    failed = asyncio.run(proc.loop.run_once())
    assert failed is not None and not failed.ok and "No space left" in (failed.error or "")
    versions = VersionStore(store)
    assert store.session_turns("agent")[0]["policy_version"] == 2
    assert versions.get(2).status == "abandoned"  # type: ignore[union-attr]
    restore = versions.get(3)
    assert restore is not None and (restore.kind, restore.source_version, restore.status) == ("restore", 1, "committed")
    assert proc.backend.sampler().policy_version == 3 and proc.backend.applied == s1

    report = asyncio.run(proc.loop.run_once())
    assert report is not None and report.ok and report.policy_version == 4
    assert proc.backend.applied == s1 + s2
    assert [r.version for r in versions.listing()] == [4, 3, 1, 0]  # 2 is a gap, never reused
    store.close()


def test_retention_deletes_a_checkpoint_whose_step_never_committed(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    disk: dict[str, Any] = {}
    first = Process(store, disk)
    rewarded_session(store, "s1")
    first.crash_at("commit")  # killed after v1's checkpoint was written, before the commit
    with pytest.raises(SimulatedCrash):
        asyncio.run(first.loop.run_once())
    assert "v00000001-step" in disk
    second = Process(store, disk)  # v1 abandoned; its checkpoint is now garbage
    assert VersionStore(store).get(1).checkpoint == "fake://v00000001-step"  # type: ignore[union-attr]
    assert asyncio.run(second.loop.run_once()).policy_version == 2
    assert sorted(disk) == ["v00000000-base", "v00000002-step"]
    store.close()


def test_running_mean_baselines_survive_a_restart(tmp_path: Path) -> None:
    """The running-mean baseline is trainer state too: step 2 after a restart gets the advantages
    it gets without one (the means come back from step 1's row)."""

    def new_loop(store: Store, disk: dict[str, Any]) -> TrainerLoop:
        backend = FakeTrainingBackend(FakeSampler(script=[7, 8]), INFO, disk=disk)
        keeper = CheckpointKeeper(store, backend)
        asyncio.run(keeper.resume())
        cfg = TrainerConfig(batch_size=1, baseline="running_mean", stale_policy="importance_weight")
        return TrainerLoop(store, backend, cfg, keeper)

    def second_step_advantages(state: Path, restart: bool) -> list[float]:
        store = Store.open(state)
        disk: dict[str, Any] = {}
        loop = new_loop(store, disk)
        rewarded_session(store, "s1", reward=1.0)
        assert asyncio.run(loop.run_once()).ok
        if restart:
            loop = new_loop(store, disk)
        rewarded_session(store, "s2", reward=3.0)
        assert asyncio.run(loop.run_once()).ok
        backend = loop.backend
        assert isinstance(backend, FakeTrainingBackend)
        store.close()
        return list(backend.batches[-1][0].advantages)

    want = second_step_advantages(tmp_path / "a", restart=False)
    assert max(want) > 0  # return 3 minus the mean of 1 and 3
    assert second_step_advantages(tmp_path / "b", restart=True) == want
