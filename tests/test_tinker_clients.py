"""Tinker training clients (LoRA slots) are released: at close, when a restore replaces one, and
at the next start-up when a run was killed with one loaded; the OPD teacher falls back to full
prompt logprobs when the server refuses the suffix option. Real tinker SDK, local protocol server.

"Killed" here is a backend whose process state is abandoned without `close()`: the ledger in the
state dir is written when the client is created, so what the next start sees is what a kill -9
leaves behind.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tinker")

from clawbridge_tinker.backend import TinkerBackend
from clawbridge_tinker.service import ClientLedger

from clawbridge.backend import LossConfig
from tests.test_tinker_backend import PROMPT, datum, make_settings, run, server  # noqa: F401  (fixture)
from tests.tinker_server import TinkerProtocolServer, prompt_logprob, sample_output


def start_and_train(server: TinkerProtocolServer, state: Path, close: bool) -> str:  # noqa: F811
    """Start a backend, train one step (which creates a training client); close it or abandon it."""

    async def main() -> str:
        b = TinkerBackend(make_settings(server, state))
        await b.start()
        await b.train_step([datum([40])], LossConfig("importance_sampling"))
        assert b._training is not None
        model_id = str(b._training.model_id)
        if close:
            await b.close()
        return model_id

    return asyncio.run(main())


def test_close_releases_the_training_client(server: TinkerProtocolServer, tmp_path: Path) -> None:  # noqa: F811
    model_id = start_and_train(server, tmp_path, close=True)
    assert [b["model_id"] for b in server.bodies("unload_model")] == [model_id]
    assert server.loaded() == []
    assert ClientLedger(tmp_path).ids() == []


def test_slots_do_not_grow_over_killed_restarts(server: TinkerProtocolServer, tmp_path: Path) -> None:  # noqa: F811
    held = []
    for _ in range(3):
        start_and_train(server, tmp_path, close=False)  # killed: never closed
        held.append(len(server.loaded()))
    assert held == [1, 1, 1]  # each start released the one the killed run left
    assert len(server.bodies("create_model")) == 3
    (left,) = ClientLedger(tmp_path).ids()
    assert server.loaded() == [left]
    start_and_train(server, tmp_path, close=True)
    assert server.loaded() == []


def test_restore_releases_the_client_it_replaces(server: TinkerProtocolServer, tmp_path: Path) -> None:  # noqa: F811
    async def body(b: TinkerBackend) -> list[int]:
        await b.train_step([datum([40])], LossConfig("importance_sampling"))
        path = await b.save_checkpoint("ckpt")
        counts = []
        for _ in range(2):  # the trainer loop restores after every failed step
            await b.restore_checkpoint(path)
            counts.append(len(server.loaded()))
        return counts

    assert run(server, tmp_path, body) == [1, 1]
    assert server.loaded() == []


def test_server_without_unload_is_logged_not_fatal(
    server: TinkerProtocolServer, tmp_path: Path, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    server.unload_supported = False
    with caplog.at_level(logging.INFO, logger="clawbridge_tinker"):
        start_and_train(server, tmp_path, close=True)
    assert any("no unload_model" in r.getMessage() for r in caplog.records)
    assert ClientLedger(tmp_path).ids() == []  # nothing more can be done about it: not retried forever


def test_teacher_falls_back_to_full_prompt_logprobs(
    server: TinkerProtocolServer, tmp_path: Path, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    server.refuse_last_n = True
    seqs = [[*PROMPT, 40, 41, 77], [*PROMPT, 9]]

    async def body(b: TinkerBackend) -> Any:
        first = await b.compute_logprobs(seqs, [len(PROMPT)] * 2)
        tokens, _, _ = sample_output(PROMPT, 0, 2, None)
        await b.train_step([datum(tokens)], LossConfig("importance_sampling"))
        await b.publish()
        return first, await b.compute_logprobs(seqs[:1], [len(PROMPT)])

    with caplog.at_level(logging.WARNING, logger="clawbridge_tinker"):
        first, after = run(server, tmp_path, body)
    expected = [[prompt_logprob(t, 0) for t in s[len(PROMPT):]] for s in seqs]
    assert first == expected and after == expected[:1]
    scored = [b for b in server.bodies("asample") if b.get("prompt_logprobs")]
    assert [b.get("prompt_logprobs_last_n") for b in scored] == [3, None, None, None]  # refused once, then full
    fell_back = [r for r in caplog.records
                 if r.name.startswith("clawbridge_tinker") and "prompt_logprobs_last_n" in r.getMessage()]
    assert len(fell_back) == 1
