"""Tinker as the OPD teacher: `compute_logprobs` asks a BASE-model sampling client for prompt
logprobs of the last n tokens only, and keeps scoring the base model after weights are published."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clawbridge_tinker.backend import TinkerBackend

from clawbridge.backend import LogprobScorer, LossConfig
from tests.test_tinker_backend import PROMPT, datum, run, server  # noqa: F401  (fixture)
from tests.tinker_server import TinkerProtocolServer, prompt_logprob, sample_output


def test_compute_logprobs_scores_the_completion_under_the_base_model(
    server: TinkerProtocolServer, tmp_path: Path  # noqa: F811
) -> None:
    seq = [*PROMPT, 40, 41, 77]

    async def body(b: TinkerBackend) -> Any:
        as_object: object = b
        assert isinstance(as_object, LogprobScorer)
        first = await b.compute_logprobs([seq, [1, 2]], [len(PROMPT), 2])
        tokens, _, _ = sample_output(PROMPT, 0, 2, None)
        await b.train_step([datum(tokens)], LossConfig("importance_sampling"))
        assert await b.publish() == 1
        after = await b.compute_logprobs([seq], [len(PROMPT)])
        return first, after

    first, after = run(server, tmp_path, body)
    expected = [prompt_logprob(t, 0) for t in seq[len(PROMPT):]]
    assert first == [expected, []]
    assert after == [expected]  # published weights never reach the teacher
    scored = [b for b in server.bodies("asample") if b.get("prompt_logprobs")]
    assert [b["prompt_logprobs_last_n"] for b in scored] == [3, 3]
    assert all([t for c in b["prompt"]["chunks"] for t in c["tokens"]] == seq for b in scored)
    assert len({b["sampling_session_id"] for b in scored}) == 1  # one base client, created once
