"""End to end: nothing planted in a session reaches the hosted trainer.

The proxy with the Tinker backend (the real SDK, pointed at the local protocol server
`tests/tinker_server.py`) serves three sessions through the `openai` SDK; their prompts hold an
e-mail address, a GitHub token, a phone number and an IBAN, and one answer (scripted on the
server) holds a card number. The trainer loop runs one step. What the server received
(`forward_backward` datums, decoded with the model's tokenizer) holds none of the planted strings
and their placeholders instead; the turn whose answer held the card is counted `dropped: private`
in `/rl/status` and `/metrics`; nothing planted appears in the logs at DEBUG.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

pytest.importorskip("tinker")

from clawbridge.chat.render import Renderer
from clawbridge.cli.status import privacy_line
from clawbridge.config import Settings
from clawbridge.proxy.app import build_app
from clawbridge.server import build_state
from tests.tinker_server import TinkerProtocolServer

MODEL = "test/tiny-qwen3"
EMAIL = "alice.w@example.org"
TOKEN = "ghp_4Fz9kQw2Lm8Xc3Vb7Np1Rt6Yh0Ju5Ie2OsAa"
PHONE = "+44 20 7946 0958"
IBAN = "DE89 3704 0044 0532 0130 00"
CARD = "4111 1111 1111 1111"
PLANTED = (EMAIL, TOKEN, PHONE, IBAN, CARD)
ADMIN = {"Authorization": "Bearer cbadmin-key"}


def test_hosted_training_receives_no_planted_secret(tiny_model_dir: Path, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    leaked_answer = renderer.encode(f"Your card is {CARD}.<|im_end|>")
    server = TinkerProtocolServer(models=(MODEL,))
    server.vocab = 4000  # below the tiny tokenizer's vocabulary
    server.script = lambda prompt: leaked_answer if "which card" in renderer.decode(prompt) else None
    server.start()
    settings = Settings.model_validate({
        "backend": "tinker", "model": MODEL, "tokenizer": str(tiny_model_dir),
        "backends": {"tinker": {"base_url": server.base_url, "api_key": "tml-test-key"}},
        "state_dir": tmp_path, "api_key": "cb-client-key", "admin_key": "cbadmin-key", "batch_size": 2,
        "log_level": "debug",
    })
    sessions = {
        "s-mail": f"Please write to {EMAIL} and use my token {TOKEN} for the repo.",
        "s-bank": f"Call me on {PHONE}; my IBAN is {IBAN}.",
        "s-card": "Remind me: which card did I register?",
    }

    async def main() -> tuple[Any, dict[str, Any], str, dict[str, dict[str, Any]]]:
        state = await build_state(settings)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://127.0.0.1")
        client = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="cb-client-key", http_client=http)  # type: ignore[arg-type]
        try:
            for sid, text in sessions.items():
                await client.chat.completions.create(model="default", messages=[{"role": "user", "content": text}],
                                                     max_tokens=64, extra_headers={"X-Session-Id": sid})
                r = await http.post("/rl/set_reward", json={"reward": 1.0, "session_id": sid}, headers=ADMIN)
                assert r.status_code == 200, r.text
                r = await http.post("/rl/end_session", json={"session_id": sid}, headers=ADMIN)
                assert r.status_code == 200, r.text
            recorded = {sid: state.store.session_turns(sid)[0] for sid in sessions}
            assert state.trainer is not None
            report = await state.trainer.run_once()
            status = (await http.get("/rl/status", headers=ADMIN)).json()
            metrics = (await http.get("/metrics", headers=ADMIN)).text
            return report, status, metrics, recorded
        finally:
            await http.aclose()
            state.writer.close()
            state.store.close()
            await state.backend.close()

    try:
        report, status, metrics, recorded = asyncio.run(main())
    finally:
        server.stop()
    card_turn = recorded["s-card"]
    assert CARD in renderer.decode(card_turn["completion_token_ids"])  # the answer really held it
    assert report is not None and report.ok, report
    assert card_turn["turn_id"] not in report.turn_ids and len(report.turn_ids) == 2
    (fb,) = server.bodies("forward_backward")
    sent = [renderer.decode(d["model_input"]) for d in fb["data"]]
    assert len(sent) == 2
    for text in sent:
        for secret in PLANTED:
            assert secret not in text
    joined = "\n".join(sent)
    for placeholder in ("[EMAIL]", "[SECRET]", "[PHONE]", "[IBAN]"):
        assert placeholder in joined
    privacy = status["privacy"]
    assert privacy["train"] is True and privacy["judge"] is False
    assert privacy["masked"]["train"] == {"email": 1, "secret": 1, "phone": 1, "iban": 1}
    assert status["trainer"]["samples"]["dropped"] == {"private": 1}
    line = privacy_line(privacy, status["trainer"]["samples"])  # what `clawbridge status` prints
    assert "on for training data;" in line and "1 email, 1 iban, 1 phone, 1 secret" in line
    assert line.endswith("turns dropped as private: 1")
    assert 'clawbridge_samples_dropped_total{reason="private"} 1.0' in metrics
    assert 'clawbridge_privacy_masked_total{kind="email",where="train"} 1.0' in metrics
    logged = caplog.text
    assert "privacy" in logged  # the filter said what it did, by kind and count
    for secret in PLANTED:
        assert secret not in logged
