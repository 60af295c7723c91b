"""End to end: the proxy with the Tinker backend (real SDK, local protocol server) and the `openai` SDK.

One chat call is served and recorded at policy version 0; a reward is set; a training step runs
and a new version is published through the backend; the next call is served and recorded with
the new version.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

pytest.importorskip("tinker")

from clawbridge_tinker import TinkerBackend

from clawbridge.backend import Datum, LossConfig
from clawbridge.config import Settings
from clawbridge.proxy.app import build_app
from clawbridge.server import build_state
from tests.tinker_server import TinkerProtocolServer, sample_output

MODEL = "test/tiny-qwen3"


def test_proxy_serves_records_and_swaps_version(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = TinkerProtocolServer(models=(MODEL,))
    server.vocab = 4000  # below the tiny tokenizer's vocabulary
    server.start()
    settings = Settings.model_validate(
        {
            "backend": "tinker",
            "model": MODEL,
            "tokenizer": str(tiny_model_dir),
            "backends": {"tinker": {"base_url": server.base_url, "api_key": "tml-test-key"}},
            "state_dir": tmp_path,
            "api_key": "cb-client-key",
            "admin_key": "cbadmin-key",
        }
    )

    async def main() -> Any:
        state = await build_state(settings)
        backend = state.backend
        assert isinstance(backend, TinkerBackend)
        app = build_app(state)
        transport = httpx.ASGITransport(app=app)
        http = httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1")
        # openai 3.x annotates its own httpx fork; a plain httpx.AsyncClient (ASGI transport) works at runtime
        client = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="cb-client-key", http_client=http)  # type: ignore[arg-type]
        headers = {"X-Session-Id": "sess-1"}
        messages: list[Any] = [{"role": "user", "content": "Hello there"}]
        try:
            first = await client.chat.completions.create(
                model="default", messages=messages, max_tokens=6, extra_headers=headers
            )
            reward = await http.post(
                "/rl/set_reward",
                json={"reward": 1.0, "session_id": "sess-1"},
                headers={"Authorization": "Bearer cbadmin-key"},
            )
            assert reward.status_code == 200, reward.text
            (turn,) = state.store.session_turns("sess-1")
            d = Datum.from_turn(
                turn["prompt_token_ids"],
                turn["completion_token_ids"],
                turn["completion_logprobs"],
                [1.0] * len(turn["completion_token_ids"]),
                turn["policy_version"],
                turn["turn_id"],
            )
            step = await backend.train_step([d], LossConfig("ppo"))
            version = await backend.publish()
            messages += [{"role": "assistant", "content": first.choices[0].message.content or ""}]
            messages += [{"role": "user", "content": "And again"}]
            await client.chat.completions.create(
                model="default", messages=messages, max_tokens=6, extra_headers=headers
            )
            return turn, step, version, state.store.session_turns("sess-1")
        finally:
            await http.aclose()
            state.writer.close()
            state.store.close()
            await backend.close()

    try:
        turn, step, version, turns = asyncio.run(main())
    finally:
        server.stop()
    assert turn["policy_version"] == 0 and turn["reward"] == 1.0
    assert (
        turn["completion_token_ids"]
        == sample_output(turn["prompt_token_ids"], 0, len(turn["completion_token_ids"]), None, 4000)[0]
    )
    (fb,) = server.bodies("forward_backward")
    assert fb["data"][0]["model_input"] == (turn["prompt_token_ids"] + turn["completion_token_ids"])[:-1]
    assert step.metrics["step"] == 1 and version == 1
    assert [t["policy_version"] for t in turns] == [0, 1]
    second = turns[1]
    expected = sample_output(second["prompt_token_ids"], 1, len(second["completion_token_ids"]), None, 4000)
    assert second["completion_token_ids"] == expected[0]
    assert second["completion_logprobs"] == expected[1]
