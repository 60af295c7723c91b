"""Training you can trust (clawbridge.trainer.checkpoints): a process killed at any moment of a
step restarts on the last committed version with its optimizer state, no version number is used
for two sets of weights, and every consumed sample is in the weights exactly once.

A "kill" here is a `SimulatedCrash` (a BaseException nothing catches) raised at a chosen moment,
after which everything in memory is thrown away and a new backend and loop are built on the same
state dir (the store file, and the checkpoints "on disk"), just as after `kill -9`.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from clawbridge.config import Settings
from clawbridge.sampler import FakeSampler
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


def _crash_local(backend: Any, where: str) -> None:
    """Make the backend 'die' at `where`: after the real work of that call, before the commit."""
    name = {"train": "train_step", "publish": "publish", "checkpoint": "save_checkpoint"}[where]
    real = getattr(backend, name)

    async def then_die(*args: Any) -> Any:
        await real(*args)
        raise SimulatedCrash(f"simulated kill after {name}")

    setattr(backend, name, then_die)


@pytest.mark.parametrize("where", ["train", "publish", "checkpoint"])
def test_local_kill_restores_weights_and_optimizer_state(tiny_model_dir: Path, tmp_path: Path, where: str) -> None:
    """After a kill during step 2, the retried step 2 and the next step 3 have exactly the losses of
    a run that was never interrupted: weights AND optimizer moments came back from v1's checkpoint."""

    async def uninterrupted() -> list[float]:
        backend, store, loop = await _local_loop(tiny_model_dir, tmp_path / "a")
        losses = []
        try:
            for i in range(3):
                rewarded_session(store, f"s{i}")
                report = await loop.run_once()
                assert report is not None and report.ok
                losses.append(float(report.metrics["loss"]))
        finally:
            await backend.close()
            store.close()
        return losses

    async def interrupted() -> tuple[list[float], int, int]:
        state = tmp_path / "b"
        backend, store, loop = await _local_loop(tiny_model_dir, state)
        losses = []
        try:
            rewarded_session(store, "s0")
            report = await loop.run_once()
            assert report is not None and report.ok
            losses.append(float(report.metrics["loss"]))
            rewarded_session(store, "s1")
            _crash_local(backend, where)
            with pytest.raises(SimulatedCrash):
                await loop.run_once()
            killed_served = backend.sampler().policy_version
        finally:
            await backend.close()  # stands in for the dead process: nothing is saved on close
            store.close()
        backend, store, loop = await _local_loop(tiny_model_dir, state)
        try:
            restored = backend.sampler().policy_version
            rewarded_session(store, "s2")
            for _ in range(2):
                report = await loop.run_once()
                assert report is not None and report.ok and report.policy_version is not None
                assert report.policy_version > killed_served  # never a number the dead process served
                losses.append(float(report.metrics["loss"]))
        finally:
            await backend.close()
            store.close()
        return losses, restored, killed_served

    want = asyncio.run(uninterrupted())
    got, restored, _ = asyncio.run(interrupted())
    assert restored == 1  # the last committed version, not the base and not the killed one
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert len({round(x, 6) for x in want}) == 3  # the steps differ, so equal losses mean equal state


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
