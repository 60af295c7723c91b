"""The Tinker backend against the real, unmodified tinker SDK and a local Tinker protocol server.

Every test asserts on what reached the server (tests/tinker_server.py): loss function and
config, tensors, Adam params, request order, checkpoint paths, and on how the backend handles
try_again, 429s, server-reported failures and timeouts. `test_live_tinker` runs only with a
real TINKER_API_KEY.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tinker")

from clawbridge_tinker import (
    FakeSamplingClient,
    SamplerLimits,
    TinkerBackend,
    TinkerRequestFailed,
    TinkerSampler,
    TinkerTransientError,
    doctor_checks,
)
from clawbridge_tinker.convert import loss_fn_and_config, to_tinker_datum
from clawbridge_tinker.manifest import load_manifest, manifest_path
from clawbridge_tinker.sdk import SDK_NAMES

from clawbridge.backend import Datum, LossConfig, TrainingBackend
from clawbridge.config import Settings
from clawbridge.plugins import load_backend
from clawbridge.serving.sampler import SamplerTimeout, SamplingParams
from tests.tinker_server import TinkerProtocolServer, expected_logprob, sample_output

MODEL = "test/tiny-qwen3"
PROMPT = [5, 6, 7, 8]


@pytest.fixture
def server() -> Iterator[TinkerProtocolServer]:
    srv = TinkerProtocolServer(models=(MODEL,))
    srv.start()
    yield srv
    srv.stop()


def make_settings(server: TinkerProtocolServer, state_dir: Path, tinker: dict[str, Any] | None = None,
                  **kw: Any) -> Settings:
    """Settings for a backend against `server`; `tinker` overrides options of `[backends.tinker]`."""
    section: dict[str, Any] = {"base_url": server.base_url, "api_key": "tml-test-key", "retry_backoff_s": 0.05}
    section.update(tinker or {})
    base: dict[str, Any] = dict(
        model=MODEL,
        tokenizer="/nonexistent/tokenizer",  # only handed to the proxy; the backend never loads it
        backends={"tinker": {k: v for k, v in section.items() if v is not None}},
        state_dir=state_dir,
        learning_rate=3e-5,
        lora_rank=8,
    )
    base.update(kw)
    return Settings.model_validate(base)


def run(
    server: TinkerProtocolServer,
    tmp_path: Path,
    body: Callable[[TinkerBackend], Awaitable[Any]],
    **kw: Any,
) -> Any:
    """Start a backend against `server`, run `body`, close it."""

    async def main() -> Any:
        backend = TinkerBackend(make_settings(server, tmp_path, **kw))
        await backend.start()
        try:
            return await body(backend)
        finally:
            await backend.close()

    return asyncio.run(main())


def datum(completion: list[int], advantage: float = 1.0, version: int = 0) -> Datum:
    logprobs = [expected_logprob(i, 0) for i in range(len(completion))]
    return Datum.from_turn(PROMPT, completion, logprobs, [advantage] * len(completion), version)


# ---- SDK surface


def test_every_sdk_name_we_use_exists() -> None:
    missing = []
    for dotted in SDK_NAMES:
        parts = dotted.split(".")
        obj: Any = None
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                obj = getattr(obj, attr, None)
            break
        if obj is None:
            missing.append(dotted)
    assert not missing, f"tinker SDK no longer has: {missing}"


def test_entry_point_gives_a_training_backend(tmp_path: Path) -> None:
    settings = Settings.model_validate({"model": MODEL, "state_dir": tmp_path})
    backend = load_backend("tinker", settings)
    assert isinstance(backend, TinkerBackend)
    assert isinstance(backend, TrainingBackend)


# ---- conversions


def test_loss_mapping() -> None:
    assert loss_fn_and_config(LossConfig("importance_sampling")) == ("importance_sampling", None)
    name, cfg = loss_fn_and_config(LossConfig("cispo", clip_low=0.1, clip_high=0.3))
    assert name == "cispo" and cfg == pytest.approx({"clip_low_threshold": 0.9, "clip_high_threshold": 1.3})
    with pytest.raises(ValueError, match="kl_coef"):
        loss_fn_and_config(LossConfig("ppo", kl_coef=0.1))


def test_mask_becomes_zero_advantage() -> None:
    # a side-turn token inside the completion: advantage given, mask 0
    d = Datum((1, 2, 3, 4), 2, (0.0, -0.5, -0.7), (0.0, 1.5, 1.5), (0.0, 0.0, 1.0), 0)
    td = to_tinker_datum(d)
    assert set(td.loss_fn_inputs) == {"target_tokens", "logprobs", "advantages"}
    assert td.loss_fn_inputs["advantages"].tolist() == [0.0, 0.0, 1.5]
    assert td.model_input.to_ints() == [1, 2, 3]
    assert td.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4]


# ---- training


def test_train_step_sends_loss_tensors_and_adam_in_order(
    server: TinkerProtocolServer, tmp_path: Path
) -> None:
    server.faults.try_again["ForwardBackward"] = 3  # the result is late: optim_step must not wait for it
    completion = [40, 41, 42]
    d = datum(completion, advantage=2.0)

    async def body(b: TinkerBackend) -> Any:
        return await b.train_step([d], LossConfig("ppo", clip_low=0.1, clip_high=0.3))

    result = run(server, tmp_path, body)

    (fb,) = server.bodies("forward_backward")
    assert fb["loss_fn"] == "ppo"
    assert fb["loss_fn_config"] == pytest.approx({"clip_low_threshold": 0.9, "clip_high_threshold": 1.3})
    (sent,) = fb["data"]
    n = len(PROMPT) + len(completion) - 1
    assert sent["model_input"] == (PROMPT + completion)[:-1]
    inputs = sent["loss_fn_inputs"]
    assert set(inputs) == {"target_tokens", "logprobs", "advantages"}  # masking is zero advantages
    assert inputs["target_tokens"] == {"dtype": "int64", "shape": [n], "values": (PROMPT + completion)[1:]}
    assert inputs["advantages"]["dtype"] == "float32" and inputs["advantages"]["shape"] == [n]
    assert inputs["advantages"]["values"] == [0.0] * (len(PROMPT) - 1) + [2.0] * len(completion)
    assert inputs["logprobs"]["values"] == [0.0] * (len(PROMPT) - 1) + [-0.125, -0.25, -0.375]

    (optim,) = server.bodies("optim_step")
    assert optim["adam_params"]["learning_rate"] == pytest.approx(3e-5)
    assert optim["seq_id"] == fb["seq_id"] + 1
    routes = server.routes()
    assert (
        routes.index("forward_backward") < routes.index("optim_step") < routes.index("result:ForwardBackward")
    )

    # ratio 1 under the fake model: ppo loss = -sum(advantages) over the completion
    assert result.metrics["loss"] == pytest.approx(-6.0)
    assert result.metrics["tokens"] == 3
    assert result.metrics["step"] == 1



def test_a_step_scale_lowers_that_step_s_learning_rate_only(server: TinkerProtocolServer, tmp_path: Path) -> None:
    """`LossConfig.lr_scale` (smaller steps after a rejected version) reaches Tinker's AdamParams of
    that step; the next step at scale 1 is back at the configured rate."""

    async def body(b: TinkerBackend) -> Any:
        await b.train_step([datum([40, 41])], LossConfig("cispo", lr_scale=0.5))
        return await b.train_step([datum([40, 41])], LossConfig("cispo"))

    run(server, tmp_path, body)
    rates = [o["adam_params"]["learning_rate"] for o in server.bodies("optim_step")]
    assert rates == [pytest.approx(1.5e-5), pytest.approx(3e-5)]

def test_importance_sampling_sends_no_config(server: TinkerProtocolServer, tmp_path: Path) -> None:
    async def body(b: TinkerBackend) -> Any:
        return await b.train_step([datum([40, 41]), datum([50], advantage=-1.0)], LossConfig("importance_sampling"))

    result = run(server, tmp_path, body)
    (fb,) = server.bodies("forward_backward")
    assert fb["loss_fn"] == "importance_sampling" and fb["loss_fn_config"] == {}
    assert len(fb["data"]) == 2
    assert result.metrics["loss"] == pytest.approx(-1.0)


def test_merged_session_datum_is_sent_as_one_sequence(server: TinkerProtocolServer, tmp_path: Path) -> None:
    """A multi-span datum (a merged session): one sequence, the advantages and sampler logprobs of
    each span where its completion is, zero between spans; the loss equals the separate datums'."""
    from clawbridge.trainer.merge import TurnPiece, build_datums

    c1, c2 = [40, 41], [42, 43, 44]
    p2 = PROMPT + c1 + [9, 9]
    lp1, lp2 = [expected_logprob(i, 0) for i in range(2)], [expected_logprob(i, 1) for i in range(3)]
    pieces = [TurnPiece("t1", "s", PROMPT, c1, lp1, [2.0, 2.0], 0), TurnPiece("t2", "s", p2, c2, lp2, [-1.0] * 3, 1)]
    (merged,), stats = build_datums(pieces)
    separate, _ = build_datums(pieces, merge=False)
    assert stats.merged == 1

    async def body(b: TinkerBackend) -> Any:
        return [await b.train_step([merged], LossConfig("ppo")), await b.train_step(separate, LossConfig("ppo"))]

    on_merged, on_separate = run(server, tmp_path, body)
    sent = server.bodies("forward_backward")[0]["data"]
    assert len(sent) == 1
    tokens = p2 + c2
    assert sent[0]["model_input"] == tokens[:-1]
    inputs = sent[0]["loss_fn_inputs"]
    assert inputs["target_tokens"]["values"] == tokens[1:]
    gap = [0.0] * 2  # the tool result's tokens between the spans
    assert inputs["advantages"]["values"] == [0.0] * (len(PROMPT) - 1) + [2.0, 2.0] + gap + [-1.0] * 3
    assert inputs["logprobs"]["values"] == pytest.approx([0.0] * (len(PROMPT) - 1) + lp1 + gap + lp2)
    assert on_merged.metrics["tokens"] == on_separate.metrics["tokens"] == 5
    # the fake server's ratio is exp(shift) for every loss token: each span is weighted on its own
    assert on_merged.metrics["loss"] == pytest.approx(-(2.0 * 2 - 1.0 * 3))


def test_server_reported_failure_is_permanent(server: TinkerProtocolServer, tmp_path: Path) -> None:
    server.faults.fail["ForwardBackward"] = ("target_tokens out of vocabulary", "user")

    async def body(b: TinkerBackend) -> Any:
        with pytest.raises(TinkerRequestFailed, match="out of vocabulary"):
            await b.train_step([datum([40])], LossConfig("importance_sampling"))
        return b.step

    assert run(server, tmp_path, body) == 0
    assert len(server.bodies("forward_backward")) == 1  # not re-submitted


def test_repeated_try_again_is_polled_through(server: TinkerProtocolServer, tmp_path: Path) -> None:
    server.faults.try_again["ForwardBackward"] = 6
    server.faults.try_again["OptimStep"] = 4

    async def body(b: TinkerBackend) -> Any:
        return await b.train_step([datum([40])], LossConfig("importance_sampling"))

    assert run(server, tmp_path, body).metrics["step"] == 1
    assert server.routes().count("retrieve_future") >= 12


def test_429_is_backed_off_and_retried(server: TinkerProtocolServer, tmp_path: Path) -> None:
    server.faults.status["forward_backward"] = [429, 429, 429]
    server.faults.status["retrieve_future"] = [429]

    async def body(b: TinkerBackend) -> Any:
        t0 = time.monotonic()
        result = await b.train_step([datum([40])], LossConfig("importance_sampling"))
        return result, time.monotonic() - t0

    result, elapsed = run(server, tmp_path, body)
    assert result.metrics["step"] == 1
    assert len(server.bodies("forward_backward")) == 4  # three refused, one accepted
    assert len(server.bodies("optim_step")) == 1
    assert elapsed >= 0.1  # it waited between attempts


def test_step_timeout_is_transient(server: TinkerProtocolServer, tmp_path: Path) -> None:
    server.faults.hang.add("OptimStep")

    async def body(b: TinkerBackend) -> Any:
        t0 = time.monotonic()
        with pytest.raises(TinkerTransientError, match="no answer within 1s"):
            await b.train_step([datum([40])], LossConfig("importance_sampling"))
        return time.monotonic() - t0, b.step

    elapsed, step = run(server, tmp_path, body, tinker={"step_timeout_s": 1.0})
    assert 0.9 <= elapsed < 5
    assert step == 0


# ---- sampling and publishing


def test_sampling_is_token_exact_and_versioned(server: TinkerProtocolServer, tmp_path: Path) -> None:
    base_tokens, _, _ = sample_output(PROMPT, 0, 6, None)
    stop_id = base_tokens[3]
    params = SamplingParams(
        max_tokens=6, temperature=0.7, top_k=0, seed=11, stop_token_ids=(stop_id,), top_logprobs=2
    )

    async def body(b: TinkerBackend) -> Any:
        sampler = b.sampler()
        stream = await sampler.sample(PROMPT, params)
        first = [t async for t in stream]
        await b.train_step([datum(base_tokens[:2])], LossConfig("importance_sampling"))
        version = await b.publish()
        stream2 = await sampler.sample(PROMPT, SamplingParams(max_tokens=3))
        second = [t async for t in stream2]
        return stream, first, version, stream2, second, sampler.policy_version

    stream, first, version, stream2, second, current = run(server, tmp_path, body)
    assert [t.token_id for t in first] == base_tokens[:4]  # ends with the stop token
    assert [t.logprob for t in first] == [expected_logprob(i, 0) for i in range(4)]
    assert first[0].top_logprobs == ((base_tokens[0], -0.125), (base_tokens[0] + 1, -1.125))
    assert stream.finish_reason == "stop" and stream.policy_version == 0

    sent = server.bodies("asample")[0]["sampling_params"]
    assert (
        sent["max_tokens"] == 6 and sent["top_k"] == -1 and sent["seed"] == 11 and sent["stop"] == [stop_id]
    )
    assert sent["temperature"] == pytest.approx(0.7)

    new_tokens, new_logprobs, _ = sample_output(PROMPT, 1, 3, None)  # weights after one step
    assert version == 1 and current == 1 and stream2.policy_version == 1
    assert [t.token_id for t in second] == new_tokens
    assert [t.logprob for t in second] == new_logprobs
    assert stream2.finish_reason == "length"


def test_call_in_flight_finishes_on_old_version(server: TinkerProtocolServer, tmp_path: Path) -> None:
    server.faults.try_again["Sample"] = 8

    async def body(b: TinkerBackend) -> Any:
        await b.train_step([datum([40])], LossConfig("importance_sampling"))
        in_flight = asyncio.create_task(b.sampler().sample(PROMPT, SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.05)
        version = await b.publish()
        stream = await in_flight
        return version, stream.policy_version, [t.token_id async for t in stream]

    version, old_version, tokens = run(server, tmp_path, body)
    assert version == 1 and old_version == 0
    assert tokens == sample_output(PROMPT, 0, 2, None)[0]


def test_sample_timeout_maps_to_sampler_timeout(server: TinkerProtocolServer, tmp_path: Path) -> None:
    server.faults.hang.add("Sample")

    async def body(b: TinkerBackend) -> None:
        with pytest.raises(SamplerTimeout):
            await b.sampler().sample(PROMPT, SamplingParams(max_tokens=2))

    run(server, tmp_path, body, tinker={"sample_timeout_s": 1.0})


def test_fake_sampling_client_stream_cut_at_stop() -> None:
    fake = FakeSamplingClient(tokens=[1, 2, 3, 4], logprobs=[-1.0, -2.0, -3.0, -4.0])
    sampler = TinkerSampler(fake, 3, SamplerLimits(context_window=100, chunk_size=1))

    async def main() -> Any:
        stream = await sampler.sample([9], SamplingParams(max_tokens=10, stop_token_ids=(2,)))
        return [t.token_id async for t in stream], stream.finish_reason, stream.policy_version

    assert asyncio.run(main()) == ([1, 2], "stop", 3)
    with pytest.raises(ValueError):
        sampler.swap(fake, 3)


# ---- checkpoints


def test_restart_restores_what_it_is_told(server: TinkerProtocolServer, tmp_path: Path) -> None:
    async def first(b: TinkerBackend) -> str:
        await b.train_step([datum([40])], LossConfig("importance_sampling"))
        await b.train_step([datum([41])], LossConfig("importance_sampling"))
        await b.publish()
        return await b.save_checkpoint("step-2")

    path = run(server, tmp_path, first)
    assert path.startswith("tinker://") and path.endswith("/weights/step-2")
    manifest_file = manifest_path(tmp_path)
    manifest = load_manifest(manifest_file)
    assert manifest is not None and manifest.latest is not None
    assert (manifest.latest.path, manifest.latest.step, manifest.latest.policy_version) == (path, 2, 1)
    assert json.loads(manifest_file.read_text())["base_model"] == MODEL
    assert [p.name for p in manifest_file.parent.iterdir()] == ["manifest.json"]  # no temp files left

    async def second(b: TinkerBackend) -> Any:
        assert b.sampler().policy_version == 0  # the trainer loop restores, never start()
        assert await b.restore_checkpoint(path, 1) == 1
        state = (b.step, b.policy_version, b.sampler().policy_version)
        stream = await b.sampler().sample(PROMPT, SamplingParams(max_tokens=2))
        tokens = [t.token_id async for t in stream]
        result = await b.train_step([datum([42])], LossConfig("importance_sampling"))
        return state, tokens, result.metrics["step"]

    state, tokens, step = run(server, tmp_path, second)
    (load,) = server.bodies("load_weights")
    assert load["path"] == path and load["optimizer"] is True
    assert len(server.bodies("create_model")) == 1  # the restart created no fresh LoRA
    assert state == (2, 1, 1)
    assert tokens == sample_output(PROMPT, 2, 2, None)[0]  # served from the restored weights
    assert step == 3


# ---- telemetry and doctor


@pytest.mark.parametrize("enabled", [False, True])
def test_telemetry_off_unless_enabled(server: TinkerProtocolServer, tmp_path: Path, enabled: bool) -> None:
    async def body(b: TinkerBackend) -> None:
        await b.train_step([datum([40])], LossConfig("importance_sampling"))

    kw = {"tinker": {"telemetry": True}} if enabled else {}
    run(server, tmp_path, body, **kw)
    assert os.environ["TINKER_TELEMETRY"] == ("1" if enabled else "0")
    assert (server.telemetry_posts > 0) == enabled


def test_doctor_checks(server: TinkerProtocolServer, tmp_path: Path) -> None:
    ok = doctor_checks(make_settings(server, tmp_path))
    assert all(good for good, _ in ok), ok
    assert any("reached" in line for _, line in ok)

    no_key = doctor_checks(make_settings(server, tmp_path, tinker={"api_key": None}))
    assert (
        False,
        "TINKER_API_KEY is not set: export TINKER_API_KEY=tml-... (from the Tinker console)",
    ) in no_key

    wrong_model = doctor_checks(make_settings(server, tmp_path, tinker={"base_model": "nope/model"}))
    assert any(not good and "does not offer 'nope/model'" in line for good, line in wrong_model)

    server.api_keys = {"tml-test-key"}
    refused = doctor_checks(make_settings(server, tmp_path, tinker={"api_key": "tml-revoked-key"}))
    assert any(not good and "tinker: bad key" in line and "HTTP 401" in line for good, line in refused)
    assert not any("revoked" in line for _, line in refused)


@pytest.mark.skipif(
    not os.environ.get("TINKER_API_KEY"), reason="TINKER_API_KEY is not set; live Tinker test skipped"
)
def test_live_tinker(tmp_path: Path, live_service_env: dict[str, str]) -> None:
    base_model = os.environ.get("CLAWBRIDGE_TINKER_BASE_MODEL", "Qwen/Qwen3-4B-Instruct-2507")
    settings = Settings.model_validate(
        {"model": base_model, "tokenizer": base_model, "state_dir": tmp_path, "lora_rank": 8}
    )
    assert all(good for good, _ in doctor_checks(settings))

    async def main() -> None:
        backend = TinkerBackend(settings)
        await backend.start()
        try:
            stream = await backend.sampler().sample([1, 2, 3, 4], SamplingParams(max_tokens=4))
            toks = [t async for t in stream]
            assert toks and stream.policy_version == 0
            d = Datum.from_turn(
                [1, 2, 3, 4], [t.token_id for t in toks], [t.logprob for t in toks], [1.0] * len(toks), 0
            )
            result = await backend.train_step([d], LossConfig("ppo"))
            assert "loss" in result.metrics
            assert await backend.publish() == 1
        finally:
            await backend.close()

    asyncio.run(main())


def test_close_never_raises_when_the_server_is_gone(tmp_path: Path) -> None:
    srv = TinkerProtocolServer(models=(MODEL,))
    srv.start()

    async def main() -> None:
        backend = TinkerBackend(make_settings(srv, tmp_path, tinker={"max_retries": 0}))
        await backend.start()
        await backend.save_checkpoint("v00000000-base")  # a training session exists to finish
        srv.stop()
        await backend.close()  # the session cannot be finished: logged, not raised
        await backend.close()  # and closing twice is fine

    asyncio.run(main())
