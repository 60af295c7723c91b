"""Committed versions by name on the hosted backends.

Tinker: the real `tinker` SDK against `tests.tinker_server` (its wire protocol on 127.0.0.1); each
checkpoint also saves sampler weights, and `load_version` samples from them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tinker")

from clawbridge_tinker import TinkerBackend
from clawbridge_tinker.manifest import load_manifest, manifest_path, write_manifest

from clawbridge.access import Principal
from clawbridge.backend import LossConfig
from clawbridge.serving.sampler import SamplingParams
from clawbridge.serving.versions import VersionedServing, VersionNotFound, VersionRouter, VersionUnavailable
from clawbridge.store import Store
from clawbridge.store.versions import VersionStore
from tests.test_tinker_backend import MODEL, PROMPT, datum, make_settings
from tests.tinker_server import TinkerProtocolServer, sample_output

CLIENT = Principal("client")
"""The shared client key (a caller without a user)."""


def test_tinker_serves_a_committed_version_from_its_sampler_weights(tmp_path: Path) -> None:
    server = TinkerProtocolServer(models=(MODEL,))
    server.start()
    store = Store.open(tmp_path / "store")
    versions = VersionStore(store)

    async def main() -> dict[str, Any]:
        b = TinkerBackend(make_settings(server, tmp_path))
        await b.start()
        try:
            assert isinstance(b, VersionedServing)
            out: dict[str, Any] = {}
            for step in (1, 2):  # what the trainer loop does per step: train, publish, checkpoint, commit
                await b.train_step([datum([40 + step])], LossConfig("importance_sampling"))
                v = versions.reserve("step", step)
                await b.publish(v)
                versions.commit(v, await b.save_checkpoint(f"step-{step}"), None)
            router = VersionRouter(b, versions, ("tiny", "default"))
            params = SamplingParams(max_tokens=4)
            for v in (1, 2):
                stream = await (await router.route(f"tiny@{v}", None, CLIENT)).sampler.sample(PROMPT, params)
                out[f"v{v}"] = ([t.token_id async for t in stream], stream.policy_version)
            with pytest.raises(VersionNotFound):
                await router.route("tiny@5", None, CLIENT)
            manifest = load_manifest(manifest_path(tmp_path))
            assert manifest is not None and all(c.sampler_path for c in manifest.checkpoints)
            first = manifest.checkpoints[0]
            out["paths"] = (first.path, first.sampler_path)
            # A restarted server whose manifest was written before sampler weights were kept: v1 is
            # loaded from its training state instead (a training client of its own, released at close).
            manifest.checkpoints[0] = type(first)(first.name, first.path, first.step, first.policy_version,
                                                  first.saved_at)
            write_manifest(manifest_path(tmp_path), manifest)
            again = TinkerBackend(make_settings(server, tmp_path))
            await again.start()
            try:
                stream = await (await again.load_version(1, first.path)).sample(PROMPT, params)
                out["from_state"] = ([t.token_id async for t in stream], stream.policy_version)
                # The manifest names sampler weights the service no longer has: from the state too.
                manifest.checkpoints[0] = first
                write_manifest(manifest_path(tmp_path), manifest)
                assert first.sampler_path is not None
                saved = server.checkpoints.pop(first.sampler_path)
                await again.unload_versions([1])
                stream = await (await again.load_version(1, first.path)).sample(PROMPT, params)
                out["sampler_gone"] = [t.token_id async for t in stream]
                # Neither the sampler weights nor the training state: refused, naming both, not a 500.
                state = server.checkpoints.pop(first.path)
                await again.unload_versions([1])
                with pytest.raises(VersionUnavailable, match=r"its training state .* failed") as err:
                    await again.load_version(1, first.path)
                assert not err.value.only_published and "sampler weights" in str(err.value)
                server.checkpoints[first.sampler_path] = saved
                server.checkpoints[first.path] = state
            finally:
                await again.close()
            out["loaded_after_close"] = server.loaded()
            await b.delete_checkpoint(first.path)
            return out
        finally:
            await b.close()

    try:
        out = asyncio.run(main())
    finally:
        server.stop()
        store.close()
    # Version 1 samples from the weights after one step, version 2 (the published one) after two.
    assert out["v1"] == (sample_output(PROMPT, 1, 4, None)[0], 1)
    assert out["v2"] == (sample_output(PROMPT, 2, 4, None)[0], 2)
    ckpt, sampler = out["paths"]
    assert ckpt.endswith("/weights/step-1") and sampler.endswith("/sampler_weights/step-1")
    assert out["from_state"] == (sample_output(PROMPT, 1, 4, None)[0], 1)
    assert out["sampler_gone"] == sample_output(PROMPT, 1, 4, None)[0]
    # one sampling client per version from its sampler weights: v1 once here (and once, refused,
    # after its weights were gone; then never again: they are known dead)
    assert [b["model_path"] for b in server.bodies("create_sampling_session") if b.get("model_path")] == [sampler] * 2
    assert [b["path"] for b in server.bodies("load_weights")] == [ckpt] * 3  # old manifest, gone weights, both gone
    # the restarted backend (same state dir) released the first one's trainer at its start, as after
    # a kill, and the training clients it loaded versions from at its close
    assert out["loaded_after_close"] == []
    assert set(server.deleted) == {ckpt, sampler}  # retention deletes both
