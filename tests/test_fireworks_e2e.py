"""End to end through the trainer loop: the proxy + a hosted backend (real SDK, local protocol
server) + the `openai` SDK, for Fireworks (FakeFireworks) and Tinker (TinkerProtocolServer).

The proxy runs under uvicorn on 127.0.0.1 with its lifespan, so `build_state` attaches the
`TrainerLoop` (train = true, batch_size = 1) and the app starts it. One session is served
(a non-streaming then a streaming call) and recorded token exact at policy version 0; rewards
are set through /rl/set_reward; the session is ended through /rl/end_session; the trainer loop
runs one step (forward_backward + optim_step) and publishes version 1 (Fireworks: a hot load
whose snapshot identity the deployment reports); the next call is served by the new weights and
recorded with policy_version 1. The datums the server received are checked against advantages
computed here from the rules (baseline none, gamma 1, token_mean): every completion token of a
turn carries (its reward + later rewards) / (completion tokens in the batch), prompt positions 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from tokenizers import Tokenizer

from clawbridge.config import Settings
from clawbridge.proxy.app import build_app
from clawbridge.proxy.state import ProxyState
from clawbridge.server import build_state
from clawbridge.serving.sampler import SequenceScorer
from clawbridge.store.training import TrainingStore
from clawbridge.trainer import TrainerLoop
from tests.support import free_port

CLIENT_KEY = "cb-client-key-e2e"
ADMIN_KEY = "cbadmin-key-e2e"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
REWARD_1 = 0.5  # on the first turn, by interaction id
REWARD_2 = 1.0  # on the session's last turn (no interaction id)
TRAINER_SETTINGS: dict[str, Any] = {
    "train": True,
    "batch_size": 1,
    "trainer_poll_interval_s": 0.05,
    "loss": "ppo",
    "clip_low": 0.2,
    "clip_high": 0.28,
    "baseline": "none",
    "gamma": 1.0,
    "promotion_mode": "off",  # the deployment answers only the agent's calls here (the probe: test_capability_probe.py)
    "advantage_normalization": "token_mean",
    "api_key": CLIENT_KEY,
    "admin_key": ADMIN_KEY,
}


# ---------------------------------------------------------------------------------- harness


@contextlib.asynccontextmanager
async def serving(settings: Settings) -> AsyncIterator[tuple[ProxyState, str]]:
    """build_state + build_app under uvicorn (lifespan on) on this event loop; yields the state
    and the base URL; stops the server (and with it the trainer loop), then closes the backend."""
    state = await build_state(settings)
    port = free_port()
    config = uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("uvicorn exited before starting")
            assert time.monotonic() < deadline, "proxy did not start"
            await asyncio.sleep(0.02)
        yield state, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)
        state.writer.close()
        state.store.close()
        await state.backend.close()


async def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def turn_id_of(completion_id: str) -> str:
    return completion_id.replace("chatcmpl-", "turn_")


async def run_scenario(settings: Settings, trained: Callable[[], bool], max_tokens: int) -> dict[str, Any]:
    """Drive the whole flow; `trained()` is true once the server has seen the step's optim_step
    (used to check the trainer does NOT step before the session ends). Returns what was observed."""
    out: dict[str, Any] = {}
    async with serving(settings) as (state, base):
        out["backend"] = state.backend
        trainer = state.trainer
        assert isinstance(trainer, TrainerLoop), "train=true with a training backend attaches the trainer"
        await wait_for(lambda: trainer.running, "the app lifespan to start the trainer loop", 10)
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=CLIENT_KEY, max_retries=0)
        admin = httpx.AsyncClient(base_url=base, headers=ADMIN, timeout=30)
        try:
            sess = {"X-Session-Id": "sess-train"}
            messages: list[Any] = [{"role": "user", "content": "Hello there"}]
            first = await client.chat.completions.create(
                model="default", messages=messages, max_tokens=max_tokens, extra_headers=sess
            )
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "And once more"},
            ]
            stream = await client.chat.completions.create(
                model="default", messages=messages, max_tokens=max_tokens, stream=True, extra_headers=sess
            )
            chunks = [c async for c in stream]
            out["first"] = first
            out["stream_text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            out["stream_id"] = chunks[0].id
            out["stream_finish"] = next(
                c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
            )
            out["turns_v0"] = state.store.session_turns("sess-train")
            out["version_before"] = state.sampler.policy_version

            r1 = await admin.post(
                "/rl/set_reward",
                json={"reward": REWARD_1, "session_id": "sess-train", "interaction_id": turn_id_of(first.id)},
            )
            r2 = await admin.post("/rl/set_reward", json={"reward": REWARD_2, "session_id": "sess-train"})
            assert r1.status_code == 200 and r2.status_code == 200, (r1.text, r2.text)
            out["reward_targets"] = (r1.json()["interaction_id"], r2.json()["interaction_id"])
            # the session is still active: the loop polls (every 0.05 s) but has nothing to train
            await asyncio.sleep(0.5)
            out["trained_before_end"] = trained() or trainer.last_report is not None

            ended = await admin.post("/rl/end_session", json={"session_id": "sess-train"})
            assert ended.status_code == 200 and ended.json()["ended"] is True, ended.text
            await wait_for(lambda: trainer.last_report is not None, "the trainer loop's step")
            report = trainer.last_report
            assert report is not None
            out["report"] = report
            out["version_after"] = state.sampler.policy_version
            out["steps"] = TrainingStore(state.store).steps()

            after = await client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": "After the update"}],
                max_tokens=max_tokens,
                extra_headers={"X-Session-Id": "sess-next"},
            )
            out["after"] = after
            out["turns_next"] = state.store.session_turns("sess-next")
            out["turns_final"] = state.store.session_turns("sess-train")
            health = await admin.get("/health")
            out["health"] = health.json()
            out["rl_status"] = (await admin.get("/rl/status")).json()
        finally:
            await admin.aclose()
            await client.close()
    return out


def expected_advantages(turns: list[dict[str, Any]], rewards: list[float]) -> dict[str, list[float]]:
    """baseline none, gamma 1, token_mean: per turn, [0] * (prompt - 1) + [return / T] * completion,
    with return = this turn's reward + every later turn's, T = completion tokens of the batch."""
    total = sum(len(t["completion_token_ids"]) for t in turns)
    out: dict[str, list[float]] = {}
    for i, t in enumerate(turns):
        ret = sum(rewards[i:])
        n_prompt, n_comp = len(t["prompt_token_ids"]), len(t["completion_token_ids"])
        out[t["turn_id"]] = [0.0] * (n_prompt - 1) + [ret / total] * n_comp
    return out


def check_common(out: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Assertions shared by both backends; returns (the two v0 turns, the v1 turn)."""
    turns = out["turns_v0"]
    assert [t["policy_version"] for t in turns] == [0, 0] and out["version_before"] == 0
    assert [t["turn_id"] for t in turns] == [turn_id_of(out["first"].id), turn_id_of(out["stream_id"])]
    assert out["reward_targets"] == (turns[0]["turn_id"], turns[1]["turn_id"])
    assert not out["trained_before_end"], "the loop trained a session that had not ended"
    # the step: ok, committed with the published version, both turns consumed
    report = out["report"]
    assert report.ok, report.error
    assert report.policy_version == 1 and out["version_after"] == 1
    assert set(report.turn_ids) == {t["turn_id"] for t in turns}
    n_tokens = sum(len(t["completion_token_ids"]) for t in turns)
    assert report.metrics["turns"] == 2.0 and report.metrics["tokens"] == float(n_tokens)
    assert report.metrics["reward_mean"] == pytest.approx(REWARD_1 + REWARD_2)
    (step_row,) = out["steps"]
    assert step_row.status == "ok" and step_row.policy_version == 1
    final = out["turns_final"]
    assert [t["reward"] for t in final] == [REWARD_1, REWARD_2]
    # the record of the first session did not change after training (what was sampled is kept)
    for before, after in zip(turns, final, strict=True):
        for key in ("prompt_token_ids", "completion_token_ids", "completion_logprobs", "policy_version"):
            assert before[key] == after[key]
    (nxt,) = out["turns_next"]
    assert nxt["policy_version"] == 1 and nxt["turn_id"] == turn_id_of(out["after"].id)
    assert out["health"]["policy_version"] == 1
    return turns, nxt


# ---------------------------------------------------------------------------------- fireworks


def test_fireworks_proxy_trainer_loop_publish_and_serve(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("clawbridge_fireworks")
    pytest.importorskip("fireworks.training.sdk")
    from clawbridge_fireworks.backend import FireworksBackend

    from tests.fireworks_server import FakeFireworks, ServerThread

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    im_end = tok.token_to_id("<|im_end|>")
    reply_ids = tok.encode("Hello world, fine", add_special_tokens=False).ids
    assert reply_ids and im_end is not None and max(reply_ids) < im_end
    fw = FakeFireworks()
    fw.completion_ids = [*reply_ids, im_end]  # ids of the tiny tokenizer: the proxy decodes them
    model = "accounts/fireworks/models/qwen3-test"

    with ServerThread(fw) as srv:
        settings = Settings.model_validate(
            {
                **TRAINER_SETTINGS,
                "backend": "fireworks",
                "model": model,
                "tokenizer": str(tiny_model_dir),
                "state_dir": tmp_path,
                "backends": {"fireworks": {
                    "api_key": "fw-test-key",
                    "account_id": "acct-test",
                    "base_url": srv.url,
                    "training_shape": "accounts/fireworks/trainingShapes/ts-test",
                    "yes": True,
                    "poll_interval_s": 0.05,
                    "retry_budget_s": 5.0,
                    "step_timeout_s": 30.0,
                }},
                "request_timeout_s": 30.0,
                "lora_rank": 8,
                "learning_rate": 3e-5,
            }
        )

        def trained() -> bool:
            return "trainer.optim_step" in fw.ops("trainer.")

        out = asyncio.run(run_scenario(settings, trained, max_tokens=16))

    assert isinstance(out["backend"], FireworksBackend)
    # a deployment cannot score given tokens: `up` says no likelihood guard and no rehearsal here
    assert not isinstance(out["backend"].sampler(), SequenceScorer)
    turns, nxt = check_common(out)
    # token exact at v0: the ids the deployment returned (cut at <|im_end|>), its sampling logprobs
    n = len(fw.completion_ids)
    for t in turns:
        assert t["completion_token_ids"] == fw.completion_ids and t["finish_reason"] == "stop"
        assert t["completion_logprobs"] == [-0.2 * (i + 1) for i in range(n)]  # bit for bit
    text = tok.decode(reply_ids)
    assert out["first"].choices[0].message.content == text and out["stream_text"] == text
    assert out["first"].choices[0].finish_reason == "stop" and out["stream_finish"] == "stop"
    # the prompts the deployment got are the recorded prompt ids; v0 calls hit the base weights
    # (the SDK's own warm-up probe, prompt [1, 2], is not one of ours)
    served = [(p, identity) for p, identity in fw.served if p != [1, 2]]
    assert [p for p, _ in served] == [t["prompt_token_ids"] for t in [*turns, nxt]]
    assert served[0][1] is None and served[1][1] is None

    # the step the trainer loop ran: ppo with ratio bounds. The completions end in <|im_end|>, so
    # the second prompt the proxy rendered extends the first turn token for token: the session
    # is ONE sequence with a span per turn (clawbridge.trainer.merge)
    (fb,) = fw.bodies("trainer.forward_backward")
    inp = fb["forward_backward_input"]
    assert inp["loss_fn"] == "ppo"
    assert inp["loss_fn_config"] == {
        "clip_low_threshold": pytest.approx(0.8),
        "clip_high_threshold": pytest.approx(1.28),
    }
    assert out["report"].metrics["datums"] == 1.0 and out["report"].metrics["merged_turns"] == 1.0
    merging = out["rl_status"]["trainer"]["merging"]
    assert (merging["turns"], merging["datums"], merging["merged"], merging["breaks"]) == (2, 1, 1, 0)
    expected = expected_advantages(turns, [REWARD_1, REWARD_2])
    first, second = turns
    head = first["prompt_token_ids"] + first["completion_token_ids"]
    assert second["prompt_token_ids"][: len(head)] == head
    (d,) = inp["data"]
    seq = second["prompt_token_ids"] + second["completion_token_ids"]
    lfi = d["loss_fn_inputs"]
    assert d["model_input"]["chunks"][0]["tokens"] == seq[:-1]
    assert set(lfi) == {"target_tokens", "logprobs", "advantages"}
    assert lfi["target_tokens"]["data"] == seq[1:]
    # each turn's advantages and logprobs at its own completion's positions, 0 elsewhere
    adv = [0.0] * (len(seq) - 1)
    lps = [0.0] * (len(seq) - 1)
    for t in turns:
        start = len(t["prompt_token_ids"]) - 1
        for i, (a, lp) in enumerate(zip(expected[t["turn_id"]][start:], t["completion_logprobs"], strict=True)):
            adv[start + i], lps[start + i] = a, lp
    assert lfi["advantages"]["data"] == pytest.approx(adv, rel=1e-6)
    assert lfi["logprobs"]["data"] == pytest.approx(lps, abs=1e-6)
    (opt,) = fw.bodies("trainer.optim_step")
    assert fb["seq_id"] < opt["seq_id"]
    assert opt["adam_params"]["learning_rate"] == pytest.approx(3e-5)
    assert opt["grad_accumulation_normalization"] == "none"
    # FakeFireworks' loss is -sum(advantages): with token_mean that is -(sum of returns * tokens / T)
    loss = -sum(sum(v) for v in expected.values())
    assert out["report"].metrics["loss"] == pytest.approx(loss, rel=1e-5)

    # publish: a hot load of the saved snapshot; the deployment reports it; the manifest maps v1
    (saved,) = fw.bodies("trainer.save_weights_for_sampler")
    identity = saved["path"]
    (hot,) = fw.bodies("hotload")
    assert hot["identity"] == identity and fw.current_identity == identity
    manifest = json.loads((tmp_path / "fireworks_manifest.json").read_text())
    assert manifest["version"] == 1 and manifest["versions"] == {"1": identity} and manifest["step"] == 1
    ops = fw.ops()
    assert (
        ops.index("trainer.optim_step") < ops.index("trainer.save_weights_for_sampler") < ops.index("hotload")
    )
    # the next call was answered by the new snapshot and recorded as version 1
    assert served[-1] == (nxt["prompt_token_ids"], identity)
    assert nxt["completion_token_ids"] == fw.completion_ids
    assert out["after"].choices[0].message.content == text


# ---------------------------------------------------------------------------------- tinker


def test_tinker_proxy_trainer_loop_publish_and_serve(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("tinker")
    pytest.importorskip("clawbridge_tinker")
    from tests.tinker_server import TinkerProtocolServer, sample_output

    model = "test/tiny-qwen3"
    server = TinkerProtocolServer(models=(model,))
    server.vocab = 4000  # below the tiny tokenizer's vocabulary (its special tokens come after)
    server.start()
    settings = Settings.model_validate(
        {
            **TRAINER_SETTINGS,
            "backend": "tinker",
            "model": model,
            "tokenizer": str(tiny_model_dir),
            "backends": {"tinker": {"base_url": server.base_url, "api_key": "tml-test-key"}},
            "state_dir": tmp_path,
            "learning_rate": 3e-5,
        }
    )

    def trained() -> bool:
        return "optim_step" in server.routes()

    try:
        out = asyncio.run(run_scenario(settings, trained, max_tokens=6))
    finally:
        server.stop()

    turns, nxt = check_common(out)
    # token exact: v0 turns are what the base weights sample, the next one what step-1 weights do
    for t, weights_step in [(turns[0], 0), (turns[1], 0), (nxt, 1)]:
        ids, lps, _ = sample_output(
            t["prompt_token_ids"], weights_step, len(t["completion_token_ids"]), None, 4000
        )
        assert t["completion_token_ids"] == ids and len(ids) == 6
        assert t["completion_logprobs"] == lps

    # cut at max_tokens, a completion has no <|im_end|>, which the next prompt renders after the
    # reply: the prefix breaks and the turns train as separate datums
    assert out["report"].metrics["datums"] == 2.0 and out["report"].metrics["merge_breaks"] == 1.0
    merging = out["rl_status"]["trainer"]["merging"]
    assert (merging["turns"], merging["datums"], merging["merged"], merging["breaks"]) == (2, 2, 0, 1)
    (fb,) = server.bodies("forward_backward")
    assert fb["loss_fn"] == "ppo"
    assert fb["loss_fn_config"] == pytest.approx({"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
    expected = expected_advantages(turns, [REWARD_1, REWARD_2])
    sent = {tuple(d["model_input"]): d["loss_fn_inputs"] for d in fb["data"]}
    assert len(sent) == 2
    for t in turns:
        seq = t["prompt_token_ids"] + t["completion_token_ids"]
        inputs = sent[tuple(seq[:-1])]
        assert set(inputs) == {"target_tokens", "logprobs", "advantages"}
        assert inputs["target_tokens"]["values"] == seq[1:]
        assert inputs["advantages"]["values"] == pytest.approx(expected[t["turn_id"]], rel=1e-6)
        n_prompt = len(t["prompt_token_ids"])
        assert inputs["logprobs"]["values"] == pytest.approx(
            [0.0] * (n_prompt - 1) + t["completion_logprobs"]
        )
    (optim,) = server.bodies("optim_step")
    assert optim["adam_params"]["learning_rate"] == pytest.approx(3e-5)
    routes = server.routes()
    # the base checkpoint (version 0, kept servable as NAME@0) saves sampler weights before any step;
    # the step's optim_step then comes before the publish that serves version 1
    first_step = routes.index("optim_step")
    assert "save_weights_for_sampler" in routes[:first_step]
    assert "save_weights_for_sampler" in routes[first_step:]
