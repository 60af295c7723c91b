"""The Fireworks backend against tests/fireworks_server.py, through the real fireworks-ai SDK.

Live tests (a real Fireworks account) run only when FIREWORKS_API_KEY is set.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("clawbridge_fireworks")
pytest.importorskip("fireworks.training.sdk")

from clawbridge_fireworks import sdk as fw_sdk
from clawbridge_fireworks.backend import FireworksBackend, StepFailed
from clawbridge_fireworks.conversion import UnsupportedLoss, loss_options
from clawbridge_fireworks.doctor import doctor_checks
from clawbridge_fireworks.manifest import Manifest
from clawbridge_fireworks.provision import ConsentRequired, ProvisionError

from clawbridge.backend import Datum, LossConfig, TrainingBackend
from clawbridge.config import Settings
from clawbridge.plugins import load_backend
from clawbridge.serving.sampler import SamplerOverloaded, SamplerTimeout, SamplerUnavailable, SamplingParams
from tests.fireworks_server import FakeFireworks, ServerThread

SHAPE = "accounts/fireworks/trainingShapes/ts-test"
MODEL = "accounts/fireworks/models/qwen3-test"


@pytest.fixture
def fake() -> Iterator[tuple[FakeFireworks, ServerThread]]:
    fw = FakeFireworks()
    with ServerThread(fw) as srv:
        yield fw, srv


def make_settings(url: str, state: Path, fireworks: dict[str, Any] | None = None, **kw: Any) -> Settings:
    """Settings for a backend against `url`; `fireworks` overrides options of `[backends.fireworks]`."""
    section: dict[str, Any] = dict(
        api_key="fw-test-key",
        account_id="acct-test",
        base_url=url,
        training_shape=SHAPE,
        yes=True,
        poll_interval_s=0.05,
        retry_budget_s=5.0,
        step_timeout_s=30.0,
    )
    section.update(fireworks or {})
    base: dict[str, Any] = dict(
        backend="fireworks",
        model=MODEL,
        tokenizer="/nonexistent/local-tokenizer",
        state_dir=state,
        backends={"fireworks": {k: v for k, v in section.items() if v is not None}},
        request_timeout_s=10.0,
        lora_rank=8,
        learning_rate=3e-5,
    )
    base.update(kw)
    return Settings(**base)


def datum(adv: float = 1.0, version: int = 0) -> Datum:
    return Datum.from_turn([1, 2, 3], [4, 5], [-0.5, -0.25], [adv, adv], version, turn_id="t1")


async def started(settings: Settings) -> FireworksBackend:
    backend = FireworksBackend(settings, notify=lambda m: None)
    await backend.start()
    return backend


def test_sdk_names_exist() -> None:
    for module, names in fw_sdk.SDK_NAMES.items():
        mod = importlib.import_module(module)
        for name in names:
            assert hasattr(mod, name), f"{module}.{name} is gone: the SDK renamed it"
    for cls, methods in fw_sdk.SDK_METHODS.items():
        obj = getattr(fw_sdk, cls)
        for method in methods:
            assert callable(getattr(obj, method, None)), f"{cls}.{method} is gone"


def test_entry_point_loads(tmp_path: Path) -> None:
    backend = load_backend("fireworks", make_settings("http://127.0.0.1:9", tmp_path))
    assert isinstance(backend, TrainingBackend)


def test_loss_mapping() -> None:
    assert loss_options(LossConfig("importance_sampling")) == ("importance_sampling", None)
    assert loss_options(LossConfig("ppo", clip_low=0.1, clip_high=0.3)) == (
        "ppo",
        {"clip_low_threshold": pytest.approx(0.9), "clip_high_threshold": pytest.approx(1.3)},
    )
    assert loss_options(LossConfig("cispo"))[0] == "cispo"
    with pytest.raises(UnsupportedLoss):
        loss_options(LossConfig("ppo", kl_coef=0.1))


def test_start_train_publish_sample(fake: tuple[FakeFireworks, ServerThread], tmp_path: Path) -> None:
    fw, srv = fake
    fw.pending_polls = 3  # the trainer job reports PENDING three times before RUNNING
    fw.try_again = {"forward_backward": 3, "optim_step": 2}
    settings = make_settings(srv.url, tmp_path)

    async def run() -> None:
        backend = await started(settings)
        try:
            info = backend.model_info()
            assert info.context_window == 8192 and info.tokenizer_path == "/nonexistent/local-tokenizer"
            sampler = backend.sampler()
            assert sampler.policy_version == 0
            stream = await sampler.sample(
                [1, 2, 3], SamplingParams(max_tokens=8, stop_token_ids=(2,), top_logprobs=2)
            )
            toks = [t async for t in stream]
            assert [t.token_id for t in toks] == [11, 12, 13, 2]
            assert [t.logprob for t in toks] == pytest.approx([-0.2, -0.4, -0.6, -0.8])  # sampling_logprob
            assert toks[0].top_logprobs == ((11, pytest.approx(-0.2)), (12, pytest.approx(-1.2)))
            assert stream.finish_reason == "stop" and stream.policy_version == 0

            result = await backend.train_step(
                [datum(1.0), datum(-0.5)], LossConfig("ppo", clip_low=0.2, clip_high=0.28)
            )
            assert result.metrics["loss"] == pytest.approx(-(1.0 * 2) + 0.5 * 2)
            assert result.metrics["tokens"] == 4 and result.metrics["optim/grad_norm:mean"] == 0.5

            version = await backend.publish()
            assert version == 1 and sampler.policy_version == 1
            stream = await sampler.sample([7, 8], SamplingParams(max_tokens=8))
            _ = [t async for t in stream]
            assert stream.policy_version == 1
        finally:
            await backend.close()

    asyncio.run(run())

    # start-up: shape resolved, trainer created on the shape path, deployment bound to it
    create = fw.bodies("job.create")[0]
    assert create["trainingConfig"]["loraRank"] == 8 and create["trainingConfig"]["baseModel"] == MODEL
    job_url = next(e.path for e in fw.log if e.op == "job.create")
    assert "trainingShape=accounts%2Ffireworks%2FtrainingShapes%2Fts-test" in job_url
    assert fw.ops("job.get").count("job.get") >= 3
    dep = fw.bodies("deployment.create")[0]
    job_id = next(iter(fw.jobs))
    assert (
        dep["enableHotLoad"] is True
        and dep["hotLoadTrainerJob"] == f"accounts/acct-test/rlorTrainerJobs/{job_id}"
    )
    assert dep["hotLoadTransitionType"] == "SYNC" and dep["deploymentShape"].endswith("ds-test/versions/1")
    model = fw.bodies("trainer.create_model")[0]
    assert model["base_model"] == MODEL and model["lora_config"]["rank"] == 8

    # the step: forward_backward before optim_step, tensors as sent, Adam params
    train_ops = [op for op in fw.ops("trainer.") if op in ("trainer.forward_backward", "trainer.optim_step")]
    assert train_ops == ["trainer.forward_backward", "trainer.optim_step"]
    fb = fw.bodies("trainer.forward_backward")[0]
    inp = fb["forward_backward_input"]
    assert inp["loss_fn"] == "ppo"
    assert inp["loss_fn_config"] == {
        "clip_low_threshold": pytest.approx(0.8),
        "clip_high_threshold": pytest.approx(1.28),
    }
    d0 = inp["data"][0]
    assert d0["model_input"]["chunks"][0]["tokens"] == [1, 2, 3, 4]
    lfi = d0["loss_fn_inputs"]
    assert set(lfi) == {"target_tokens", "logprobs", "advantages"}
    assert lfi["target_tokens"]["data"] == [2, 3, 4, 5] and lfi["target_tokens"]["dtype"] == "int64"
    assert lfi["advantages"]["data"] == [0.0, 0.0, 1.0, 1.0]
    assert lfi["logprobs"]["data"] == [0.0, 0.0, -0.5, -0.25]
    assert inp["data"][1]["loss_fn_inputs"]["advantages"]["data"] == [0.0, 0.0, -0.5, -0.5]
    opt = fw.bodies("trainer.optim_step")[0]
    assert opt["adam_params"]["learning_rate"] == pytest.approx(3e-5)
    assert opt["adam_params"]["grad_clip_norm"] == 1.0
    assert opt["grad_accumulation_normalization"] == "none"
    assert fb["seq_id"] < opt["seq_id"]
    # every future was polled through its try_again answers
    assert fw.ops().count("trainer.retrieve_future") >= 3 + 1 + 2 + 1

    # publish: save_weights_for_sampler, then the hot load of that identity with routing headers
    saved = fw.bodies("trainer.save_weights_for_sampler")[0]
    assert saved["path"].startswith("clawbridge-v1")
    hot = next(e for e in fw.log if e.op == "hotload")
    assert hot.body["identity"] == saved["path"]
    dep_id = next(iter(fw.deployments))
    assert hot.headers["fireworks-deployment"] == f"accounts/acct-test/deployments/{dep_id}"
    assert hot.headers["fireworks-model"] == MODEL
    assert hot.headers["authorization"] == "Bearer fw-test-key"
    manifest = json.loads((tmp_path / "fireworks_manifest.json").read_text())
    assert manifest["versions"] == {"1": saved["path"]} and manifest["version"] == 1 and manifest["step"] == 1
    assert manifest["created_trainer_job"] == job_id and manifest["created_deployment"] == dep_id
    assert oct((tmp_path / "fireworks_manifest.json").stat().st_mode & 0o777) == "0o600"

    # sampling: token ids in, token ids + logprobs asked for; served by the published snapshot
    comp = fw.bodies("completions")
    first = next(c for c in comp if c["prompt"] == [1, 2, 3])
    assert first["raw_output"] is True and first["return_token_ids"] is True and first["logprobs"] is True
    assert first["model"] == f"accounts/acct-test/deployments/{dep_id}" and first["top_logprobs"] == 2
    assert fw.served[-1] == ([7, 8], saved["path"])
    # nothing deleted at shutdown unless asked
    assert "job.delete" not in fw.ops() and "deployment.delete" not in fw.ops()


def test_consent_refused_creates_nothing(fake: tuple[FakeFireworks, ServerThread], tmp_path: Path) -> None:
    fw, srv = fake
    backend = FireworksBackend(make_settings(srv.url, tmp_path, {"yes": False}), notify=lambda m: None)
    with pytest.raises(ConsentRequired) as err:
        asyncio.run(backend.start())
    msg = str(err.value)
    assert (
        "create trainer job" in msg and "create deployment" in msg and "$32.00/hour" in msg and "--yes" in msg
    )
    assert "job.create" not in fw.ops() and "deployment.create" not in fw.ops()


def test_lora_rank_must_match_training_shape(
    fake: tuple[FakeFireworks, ServerThread], tmp_path: Path
) -> None:
    fw, srv = fake
    backend = FireworksBackend(make_settings(srv.url, tmp_path, lora_rank=0), notify=lambda m: None)
    with pytest.raises(ProvisionError, match="LoRA shape"):
        asyncio.run(backend.start())
    assert "job.create" not in fw.ops()


def test_full_parameter_shape(fake: tuple[FakeFireworks, ServerThread], tmp_path: Path) -> None:
    fw, srv = fake
    fw.trainer_mode = "POLICY_TRAINER"

    async def run() -> None:
        backend = await started(make_settings(srv.url, tmp_path, lora_rank=0))
        await backend.close()

    asyncio.run(run())
    assert fw.bodies("job.create")[0]["trainingConfig"]["loraRank"] == 0
    assert fw.bodies("trainer.create_model")[0]["lora_config"]["rank"] == 0


def test_merged_session_datum_is_sent_as_one_sequence(
    fake: tuple[FakeFireworks, ServerThread], tmp_path: Path
) -> None:
    """A multi-span datum (a merged session) reaches the trainer as one sequence with each span's
    advantages and sampler logprobs where its completion is, zero between spans."""
    from clawbridge.trainer.merge import TurnPiece, build_datums

    fw, srv = fake
    pieces = [TurnPiece("t1", "s", [1, 2, 3], [4, 5], [-0.5, -0.25], [1.0, 1.0], 0),
              TurnPiece("t2", "s", [1, 2, 3, 4, 5, 6], [7, 8], [-0.75, -1.0], [-0.5, -0.5], 1)]
    (merged,), stats = build_datums(pieces)
    assert stats.merged == 1 and merged.turn_ids == ("t1", "t2")

    async def run() -> None:
        backend = await started(make_settings(srv.url, tmp_path))
        try:
            result = await backend.train_step([merged], LossConfig("importance_sampling"))
            assert result.metrics["tokens"] == 4 and result.metrics["sequences"] == 1
        finally:
            await backend.close()

    asyncio.run(run())
    (d,) = fw.bodies("trainer.forward_backward")[0]["forward_backward_input"]["data"]
    assert d["model_input"]["chunks"][0]["tokens"] == [1, 2, 3, 4, 5, 6, 7]
    lfi = d["loss_fn_inputs"]
    assert lfi["target_tokens"]["data"] == [2, 3, 4, 5, 6, 7, 8]
    assert lfi["advantages"]["data"] == [0.0, 0.0, 1.0, 1.0, 0.0, -0.5, -0.5]
    assert lfi["logprobs"]["data"] == [0.0, 0.0, -0.5, -0.25, 0.0, -0.75, -1.0]


def test_a_step_scale_lowers_that_step_s_learning_rate_only(
    fake: tuple[FakeFireworks, ServerThread], tmp_path: Path
) -> None:
    """`LossConfig.lr_scale` (smaller steps after a rejected version) reaches Fireworks' Adam
    parameters of that step; the next step at scale 1 is back at the configured rate."""
    fw, srv = fake

    async def run() -> None:
        backend = await started(make_settings(srv.url, tmp_path))
        try:
            await backend.train_step([datum()], LossConfig("importance_sampling", lr_scale=0.25))
            await backend.train_step([datum()], LossConfig("importance_sampling"))
        finally:
            await backend.close()

    asyncio.run(run())
    rates = [o["adam_params"]["learning_rate"] for o in fw.bodies("trainer.optim_step")]
    assert rates == [pytest.approx(3e-5 * 0.25), pytest.approx(3e-5)]


def test_server_reported_failure_fails_the_step(
    fake: tuple[FakeFireworks, ServerThread], tmp_path: Path
) -> None:
    fw, srv = fake

    async def run() -> None:
        backend = await started(make_settings(srv.url, tmp_path))
        try:
            fw.fail_future["forward_backward"] = "sequence too long for this trainer"
            with pytest.raises(StepFailed, match="sequence too long"):
                await backend.train_step([datum()], LossConfig("importance_sampling"))
            assert backend.manifest.step == 0
        finally:
            await backend.close()

    asyncio.run(run())
    assert json.loads((tmp_path / "fireworks_manifest.json").read_text())["step"] == 0


def test_training_429_is_backed_off(fake: tuple[FakeFireworks, ServerThread], tmp_path: Path) -> None:
    fw, srv = fake

    async def run() -> None:
        backend = await started(make_settings(srv.url, tmp_path))
        try:
            fw.http_fail["trainer.forward_backward"] = [429]
            result = await backend.train_step([datum()], LossConfig("importance_sampling"))
            assert result.metrics["loss"] == pytest.approx(-2.0)
        finally:
            await backend.close()

    asyncio.run(run())
    assert fw.ops().count("trainer.forward_backward") == 2  # the 429, then the accepted retry


def test_sampler_retries_425_and_429_then_maps_errors(
    fake: tuple[FakeFireworks, ServerThread], tmp_path: Path
) -> None:
    fw, srv = fake

    async def run() -> None:
        backend = await started(
            make_settings(srv.url, tmp_path, {"retry_budget_s": 2.5}, request_timeout_s=2.0)
        )
        try:
            sampler = backend.sampler()
            params = SamplingParams(max_tokens=8)
            fw.http_fail["completions"] = [425, 429]  # a hot load in progress, then rate limited
            stream = await sampler.sample([1, 2], params)
            assert [t.token_id async for t in stream] == [11, 12, 13, 2]
            assert sampler.stats.retries_425 == 1 and sampler.stats.retries_429 == 1  # type: ignore[attr-defined]
            fw.http_fail["completions"] = [429, 429, 429, 429]
            with pytest.raises(SamplerOverloaded):
                await sampler.sample([1, 2], params)
            fw.http_fail["completions"] = [503]
            with pytest.raises(SamplerUnavailable):
                await sampler.sample([1, 2], params)
            fw.http_fail["completions"] = []
            fw.completion_delay_s = 3.0
            with pytest.raises(SamplerTimeout):
                await sampler.sample([1, 2], params)
        finally:
            fw.completion_delay_s = 0.0
            await backend.close()

    asyncio.run(run())


def test_restart_restores_what_it_is_told(fake: tuple[FakeFireworks, ServerThread], tmp_path: Path) -> None:
    fw, srv = fake
    settings = make_settings(srv.url, tmp_path)

    async def first() -> tuple[str, str]:
        backend = await started(settings)
        try:
            await backend.train_step([datum()], LossConfig("importance_sampling"))
            assert await backend.publish() == 1
            return backend.manifest.versions[1], await backend.save_checkpoint("step-1")
        finally:
            await backend.close()

    identity, path = asyncio.run(first())
    n_jobs = fw.ops().count("job.create")

    async def second() -> None:
        # no consent needed: everything it uses already exists and was created by clawbridge
        backend = await started(make_settings(srv.url, tmp_path, {"yes": False}))
        try:
            assert not fw.bodies("trainer.load_weights")  # the trainer loop restores, never start()
            hotloads = fw.ops().count("hotload")
            assert await backend.restore_checkpoint(path, 1) == 1
            assert fw.ops().count("hotload") == hotloads  # the deployment already serves v1's snapshot
            assert backend.sampler().policy_version == 1 and backend.manifest.step == 1
            await backend.train_step([datum()], LossConfig("importance_sampling"))
            assert await backend.publish() == 2
            await backend.save_checkpoint("step-2")
        finally:
            await backend.close()

    asyncio.run(second())
    assert fw.ops().count("job.create") == n_jobs and fw.ops().count("deployment.create") == 1
    assert fw.bodies("trainer.load_weights")[0]["path"] == "step-1"
    m = Manifest.load(tmp_path / "fireworks_manifest.json")
    assert m.versions[1] == identity and m.version == 2 and m.step == 2
    assert [c.name for c in m.checkpoints] == ["step-1", "step-2"]


def test_delete_on_shutdown_only_what_was_created(
    fake: tuple[FakeFireworks, ServerThread], tmp_path: Path
) -> None:
    fw, srv = fake

    async def run(**kw: Any) -> None:
        backend = await started(make_settings(srv.url, tmp_path, **kw))
        await backend.close()

    asyncio.run(run())  # creates both
    dep_id = next(iter(fw.deployments))
    asyncio.run(run(fireworks={"deployment": dep_id, "delete_on_shutdown": True}))
    assert fw.ops().count("job.delete") == 1
    assert "deployment.delete" not in fw.ops()  # the user named it: never deleted
    assert dep_id in fw.deployments


def test_doctor_checks(fake: tuple[FakeFireworks, ServerThread], tmp_path: Path) -> None:
    _, srv = fake
    checks = doctor_checks(make_settings(srv.url, tmp_path))
    assert all(ok for ok, _ in checks), checks
    bad = doctor_checks(
        make_settings(srv.url, tmp_path, {"api_key": None, "account_id": "other"})
    )
    assert any(not ok and "FIREWORKS_API_KEY" in msg for ok, msg in bad)
    wrong = doctor_checks(make_settings(srv.url, tmp_path, {"account_id": "other"}))
    assert any(not ok and "not the key's account" in msg for ok, msg in wrong)


@pytest.mark.skipif(
    not os.environ.get("FIREWORKS_API_KEY"), reason="FIREWORKS_API_KEY is not set: live test skipped"
)
def test_live_doctor(live_service_env: dict[str, str]) -> None:
    checks = doctor_checks(Settings.model_validate({"backend": "fireworks"}))
    assert all(ok for ok, msg in checks if "reachable" in msg or "API key" in msg), checks


def test_sample_during_hotload_waits_and_gets_the_new_version(
    fake: tuple[FakeFireworks, ServerThread], tmp_path: Path
) -> None:
    fw, srv = fake
    fw.hotload_loading_polls = 1  # the deployment reports "loading" once (the SDK polls every 5 s)

    async def run() -> None:
        backend = await started(make_settings(srv.url, tmp_path, request_timeout_s=60.0))
        try:
            sampler = backend.sampler()
            publish = asyncio.create_task(backend.publish())
            while "hotload" not in fw.ops():
                await asyncio.sleep(0.02)
            stream = await sampler.sample([5, 6], SamplingParams(max_tokens=8))
            assert publish.done() and await publish == 1
            assert stream.policy_version == 1
            assert sampler.stats.gate_waits >= 1  # type: ignore[attr-defined]
        finally:
            await backend.close()

    asyncio.run(run())
    assert fw.served[-1] == ([5, 6], fw.current_identity) and fw.current_identity is not None
