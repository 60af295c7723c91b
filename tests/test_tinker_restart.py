"""The Tinker backend against a service that behaves like SkyRL's Tinker server (skyrl 0.4.0, an
independent implementation): sampler weights answer only while the training client that saved
them is loaded, named sampler weights come back as a path the SDK refuses to delete, the training
call reports no loss. The real, unmodified tinker SDK talks to `tests.tinker_server` on 127.0.0.1.

Covers issue 32 section 3: a restarted server serves every committed version by name; the restore
swaps the served sampler before it releases the old training client; pruning finishes however the
service names or has already removed an object, and a deletion the service refuses stays owed
(durably, in the store) until a retry succeeds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tinker")

from clawbridge_tinker import TinkerBackend
from clawbridge_tinker.manifest import load_manifest, manifest_path

from clawbridge.access import Principal
from clawbridge.backend import LossConfig
from clawbridge.serving.sampler import SamplingParams
from clawbridge.serving.versions import VersionRouter
from clawbridge.store import Store
from clawbridge.store.deletions import OwedDeletionStore
from clawbridge.store.versions import VersionStore
from clawbridge.trainer.checkpoints import CheckpointKeeper
from clawbridge.trainer.deletions import OwedDeletions
from tests.test_tinker_backend import MODEL, PROMPT, datum, make_settings
from tests.tinker_server import TinkerProtocolServer, sample_output

LOSS = LossConfig("importance_sampling")


@pytest.fixture
def skyrl() -> Iterator[TinkerProtocolServer]:
    """The protocol server with SkyRL's behaviours on."""
    srv = TinkerProtocolServer(models=(MODEL,))
    srv.tied_samplers = True
    srv.short_sampler_paths = True
    srv.start()
    yield srv
    srv.stop()


async def tokens_of(sampler: Any, n: int = 3) -> tuple[list[int], int]:
    stream = await sampler.sample(PROMPT, SamplingParams(max_tokens=n))
    return [t.token_id async for t in stream], stream.policy_version


async def train_and_commit(b: TinkerBackend, keeper: CheckpointKeeper, step: int) -> int:
    """One step as the trainer loop takes it: train, reserve, publish, checkpoint, commit."""
    await b.train_step([datum([40 + step])], LOSS)
    version = keeper.reserve_step(step)
    await keeper.publish(version)
    keeper.versions.commit(version, await keeper.save(version), None)
    keeper.committed(version, keeper.versions.get(version).checkpoint)  # type: ignore[union-attr]
    return version


def test_restore_swaps_the_served_sampler_before_releasing_the_old_client(
    skyrl: TinkerProtocolServer, tmp_path: Path
) -> None:
    """A call that arrives between the release of the old training client and the new sampler
    would sample from weights the service no longer serves: the restore swaps first."""

    async def main() -> dict[str, Any]:
        b = TinkerBackend(make_settings(skyrl, tmp_path))
        await b.start()
        try:
            await b.train_step([datum([40])], LOSS)
            await b.publish(1)
            ckpt = await b.save_checkpoint("v1")
            skyrl.faults.try_again["SaveWeightsForSampler"] = 40  # the new sampling client takes a while
            restore = asyncio.create_task(b.restore_checkpoint(ckpt, 2))
            while "unload_model" not in skyrl.routes() and not restore.done():
                await asyncio.sleep(0.002)
            out = {"window": await tokens_of(b.sampler())}
            out["restored"] = await restore
            out["after"] = await tokens_of(b.sampler())
            return out
        finally:
            await b.close()

    out = asyncio.run(main())
    expected = sample_output(PROMPT, 1, 3, None)[0]  # the weights after the one step, either client
    assert out["window"][0] == expected
    assert out["restored"] == 2 and out["after"] == (expected, 2)
    assert skyrl.loaded() == []


def test_restoring_the_served_version_rebinds_it_to_the_new_training_client(
    skyrl: TinkerProtocolServer, tmp_path: Path
) -> None:
    """Undoing an uncommitted step restores the served version's own checkpoint under its own
    number; the served sampler must not stay on the training client that restore released."""

    async def main() -> tuple[int, tuple[list[int], int]]:
        b = TinkerBackend(make_settings(skyrl, tmp_path))
        await b.start()
        try:
            await b.train_step([datum([40])], LOSS)
            await b.publish(1)
            ckpt = await b.save_checkpoint("v1")
            await b.train_step([datum([41])], LOSS)  # an update that never commits
            served = await b.restore_checkpoint(ckpt)
            return served, await tokens_of(b.sampler())
        finally:
            await b.close()

    served, sampled = asyncio.run(main())
    assert served == 1
    assert sampled == (sample_output(PROMPT, 1, 3, None)[0], 1)


def test_a_restarted_server_serves_versions_whose_sampler_weights_died_with_their_client(
    skyrl: TinkerProtocolServer, tmp_path: Path
) -> None:
    """After a restart, `NAME@N` of a version trained before it loads N again from its training
    checkpoint (its saved sampler weights died with the released client), once, and the extra
    training client is released at close."""
    store = Store.open(tmp_path / "store")

    async def first() -> None:
        b = TinkerBackend(make_settings(skyrl, tmp_path))
        await b.start()
        keeper = CheckpointKeeper(store, b, keep=5)
        try:
            await keeper.ensure_base()
            for step in (1, 2):
                await train_and_commit(b, keeper, step)
        finally:
            await b.close()

    async def second() -> dict[str, Any]:
        b = TinkerBackend(make_settings(skyrl, tmp_path))
        await b.start()
        keeper = CheckpointKeeper(store, b, keep=5)
        try:
            out: dict[str, Any] = {"served": await keeper.resume()}
            router = VersionRouter(b, VersionStore(store), ("tiny", "default"))
            for name in ("tiny@1", "tiny@1", "tiny@0", "tiny@2"):
                out[name] = await tokens_of((await router.route(name, None, Principal("client"))).sampler)
            out["loaded_while_serving"] = len(skyrl.loaded())
            return out
        finally:
            await b.close()

    try:
        asyncio.run(first())
        assert skyrl.loaded() == []
        out = asyncio.run(second())
    finally:
        store.close()
    assert out["served"] == 2
    for version, steps in ((1, 1), (0, 0), (2, 2)):
        assert out[f"tiny@{version}"] == (sample_output(PROMPT, steps, 3, None)[0], version)
    # v1 and v0 each loaded from their training state once (the second tiny@1 was served from the cache)
    loads = [body["path"] for body in skyrl.bodies("load_weights")]
    assert sum(p.endswith("/weights/v00000001-step") for p in loads) == 1
    assert sum(p.endswith("/weights/v00000000-base") for p in loads) == 1
    assert out["loaded_while_serving"] == 3  # the resumed trainer and the two versions
    assert skyrl.loaded() == []  # all released at close


def test_pruning_finishes_with_paths_the_sdk_refuses_and_objects_already_gone(
    skyrl: TinkerProtocolServer, tmp_path: Path
) -> None:
    """Retention deletes the training state and the sampler weights of old checkpoints: a sampler
    path the SDK calls "Invalid tinker path" is deleted by its training run and name, an object the
    service no longer has counts as deleted, and each old version is marked pruned."""
    store = Store.open(tmp_path / "store")

    async def main() -> list[str]:
        b = TinkerBackend(make_settings(skyrl, tmp_path))
        await b.start()
        keeper = CheckpointKeeper(store, b, keep=1)
        try:
            await keeper.ensure_base()
            await train_and_commit(b, keeper, 1)
            gone = next(p for p in skyrl.checkpoints if p.endswith("/weights/v00000001-step"))
            del skyrl.checkpoints[gone]  # deleted behind our back
            for step in (2, 3):
                await train_and_commit(b, keeper, step)
            return await keeper.prune()
        finally:
            await b.close()

    try:
        pruned = asyncio.run(main())
        rows = {r.version: r.pruned_at is not None for r in VersionStore(store).listing(10)}
        owed = OwedDeletionStore(store).listing()
    finally:
        store.close()
    assert [p.rsplit("/", 1)[1] for p in pruned] == ["v00000001-step", "v00000002-step"]
    assert rows == {0: False, 1: True, 2: True, 3: False}  # the base is never pruned
    assert owed == []
    # the base's and the newest's state and sampler weights
    assert sorted(p.split("/")[-1] for p in skyrl.checkpoints) == ["v00000000-base"] * 2 + ["v00000003-step"] * 2
    assert any("/sampler_weights/v00000002-step" in p for p in skyrl.deleted)
    manifest = load_manifest(manifest_path(tmp_path))
    assert manifest is not None and [c.name for c in manifest.checkpoints] == ["v00000000-base", "v00000003-step"]


def test_a_deletion_the_service_refuses_stays_owed_until_a_retry_succeeds(
    skyrl: TinkerProtocolServer, tmp_path: Path
) -> None:
    """Pruning decides once (the version is marked pruned with its objects owed, in one
    transaction); each object is deleted on its own; what the service refuses stays owed, with
    its error and when it is tried again, and a later retry deletes it."""
    store = Store.open(tmp_path / "store")

    async def main() -> dict[str, Any]:
        b = TinkerBackend(make_settings(skyrl, tmp_path))
        await b.start()
        keeper = CheckpointKeeper(store, b, keep=1)
        try:
            await keeper.ensure_base()
            skyrl.refuse_deletes = True
            for step in (1, 2):
                await train_and_commit(b, keeper, step)
            out: dict[str, Any] = {"pruned": await keeper.prune()}
            owed = OwedDeletionStore(store)
            out["owed"] = owed.listing()
            out["status"] = owed.status()
            out["early"] = await OwedDeletions(store, b).retry_due()  # nothing is due yet
            skyrl.refuse_deletes = False
            out["retried"] = await OwedDeletions(store, b).retry_due(now=store.clock.now() + 3600)
            out["after"] = owed.listing()
            return out
        finally:
            await b.close()

    try:
        out = asyncio.run(main())
        rows = {r.version: r.pruned_at is not None for r in VersionStore(store).listing(10)}
    finally:
        store.close()
    assert rows == {0: False, 1: True, 2: False}  # the base is never pruned
    assert [p.rsplit("/", 1)[1] for p in out["pruned"]] == ["v00000001-step"]
    kinds = sorted((o.kind, o.reason, o.attempts) for o in out["owed"])
    assert kinds == [("sampler", "prune", 1), ("state", "prune", 1)]
    assert all("refused" in (o.last_error or "") for o in out["owed"])
    assert out["status"]["owed"] == 2 and out["status"]["by_reason"] == {"prune": 2}
    assert out["early"] == 0 and out["retried"] == 2 and out["after"] == []
    assert not any("v00000001-step" in p for p in skyrl.checkpoints)


def test_a_training_call_without_a_reported_loss_still_trains(
    skyrl: TinkerProtocolServer, tmp_path: Path
) -> None:
    skyrl.report_loss = False

    async def main() -> dict[str, float]:
        b = TinkerBackend(make_settings(skyrl, tmp_path))
        await b.start()
        try:
            return (await b.train_step([datum([40])], LOSS)).metrics
        finally:
            await b.close()

    metrics = asyncio.run(main())
    assert "loss" not in metrics and metrics["step"] == 1.0
