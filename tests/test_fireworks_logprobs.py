"""Fireworks as the OPD teacher: `compute_logprobs` runs a forward-only `cross_entropy` pass on a
base-only training client (LoRA disabled) against tests/fireworks_server.py, through the real SDK,
and keeps scoring the base model after weights are trained and published."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("clawbridge_fireworks")
pytest.importorskip("fireworks.training.sdk")

from clawbridge_fireworks.backend import FireworksBackend
from clawbridge_fireworks.scoring import ScoringFailed, ScoringUnavailable, completion_logprobs

from clawbridge.backend import LogprobScorer, LossConfig
from clawbridge.config import Settings
from tests.fireworks_server import FakeFireworks, ServerThread, teacher_logprob
from tests.test_fireworks_backend import MODEL, datum, make_settings, started


@pytest.fixture
def fake() -> Iterator[tuple[FakeFireworks, ServerThread]]:
    fw = FakeFireworks()
    with ServerThread(fw) as srv:
        yield fw, srv


def expected(seq: Sequence[int], prompt_len: int, steps: int = 0) -> list[float]:
    """What the fake trainer answers for the completion of `seq`, as float32 on the wire."""
    return [
        float(np.float32(teacher_logprob(list(seq[:i]), seq[i], steps))) for i in range(prompt_len, len(seq))
    ]


def run_backend(settings: Settings, body: Callable[[FireworksBackend], Awaitable[Any]]) -> Any:
    async def go() -> Any:
        backend = await started(settings)
        try:
            return await body(backend)
        finally:
            await backend.close()

    return asyncio.run(go())


def forward_bodies(fw: FakeFireworks) -> list[dict[str, Any]]:
    return [b for b in fw.bodies("trainer.forward") if b["forward_input"]["loss_fn"] == "cross_entropy"]


def base_only_creates(fw: FakeFireworks) -> list[dict[str, Any]]:
    return [b for b in fw.bodies("trainer.create_model") if b.get("base_only")]


def test_scores_the_completion_under_the_base_model(
    fake: tuple[FakeFireworks, ServerThread],
    tmp_path: Path,
) -> None:
    fw, srv = fake
    fw.try_again = {"forward": 2}  # the future polls `try_again` before answering
    seq_a = [5, 9, 14, 40, 41, 77]  # prompt 3, completion 3
    seq_b = [1, 2]  # prompt == whole sequence: nothing to score
    seq_c = [7, 3, 3, 8]  # prompt 1: every token after the first
    seq_d = [100, 200, 300, 400, 2]  # completion of one token

    async def body(b: FireworksBackend) -> Any:
        as_object: object = b
        assert isinstance(as_object, LogprobScorer)
        first = await b.compute_logprobs([seq_a, seq_b, seq_c, seq_d], [3, 2, 1, 4])
        await b.train_step([datum()], LossConfig("importance_sampling"))
        assert await b.publish() == 1
        after = await b.compute_logprobs([seq_d, seq_a], [4, 3])
        return first, after

    first, after = run_backend(make_settings(srv.url, tmp_path), body)
    assert first == [expected(seq_a, 3), [], expected(seq_c, 1), expected(seq_d, 4)]
    assert [len(x) for x in first] == [3, 0, 3, 1]
    assert after == [expected(seq_d, 4), expected(seq_a, 3)]  # trained/published weights never score

    # The policy model really moved: scoring it would have given other numbers.
    policy = [m for m in fw.models.values() if not m.base_only]
    assert len(policy) == 1 and policy[0].steps == 1
    assert expected(seq_a, 3, steps=1) != expected(seq_a, 3)

    # One base-only model, created once on the policy's session, with no adapter.
    creates = base_only_creates(fw)
    assert len(creates) == 1
    assert creates[0]["base_model"] == MODEL and "lora_config" not in creates[0]
    policy_create = next(b for b in fw.bodies("trainer.create_model") if not b.get("base_only"))
    assert creates[0]["session_id"] == policy_create["session_id"]
    base_ids = {mid for mid, m in fw.models.items() if m.base_only}

    sent = forward_bodies(fw)
    assert len(sent) == 2  # one forward per call, every sequence batched in order
    assert all(b["model_id"] in base_ids for b in sent)
    assert all(b["model_id"] not in base_ids for b in fw.bodies("trainer.forward_backward"))

    def shape(d: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
        tokens = [t for c in d["model_input"]["chunks"] for t in c["tokens"]]
        x = d["loss_fn_inputs"]
        return tokens, x["target_tokens"]["data"], x["weights"]["data"]

    assert [shape(d) for d in sent[0]["forward_input"]["data"]] == [
        (seq_a[:-1], seq_a[1:], [0.0, 0.0, 1.0, 1.0, 1.0]),
        (seq_c[:-1], seq_c[1:], [1.0, 1.0, 1.0]),
        (seq_d[:-1], seq_d[1:], [0.0, 0.0, 0.0, 1.0]),
    ]
    assert [shape(d) for d in sent[1]["forward_input"]["data"]] == [
        (seq_d[:-1], seq_d[1:], [0.0, 0.0, 0.0, 1.0]),
        (seq_a[:-1], seq_a[1:], [0.0, 0.0, 1.0, 1.0, 1.0]),
    ]
    for d in sent[0]["forward_input"]["data"]:
        n = len(d["loss_fn_inputs"]["target_tokens"]["data"])
        assert d["loss_fn_inputs"]["target_tokens"]["dtype"] == "int64"
        assert d["loss_fn_inputs"]["target_tokens"]["shape"] == [n]
        assert d["loss_fn_inputs"]["weights"]["dtype"] == "float32"
        assert d["loss_fn_inputs"]["weights"]["shape"] == [n]


def test_nothing_to_score_sends_nothing_and_bad_prompt_lens_are_refused(
    fake: tuple[FakeFireworks, ServerThread],
    tmp_path: Path,
) -> None:
    fw, srv = fake

    async def body(b: FireworksBackend) -> Any:
        assert await b.compute_logprobs([], []) == []
        assert await b.compute_logprobs([[1, 2, 3], [4]], [3, 1]) == [[], []]
        for seqs, lens in (([[1, 2, 3]], [0]), ([[1, 2, 3]], [4]), ([[1, 2, 3]], [1, 2]), ([[]], [0])):
            with pytest.raises(ValueError):
                await b.compute_logprobs(seqs, lens)

    run_backend(make_settings(srv.url, tmp_path), body)
    assert forward_bodies(fw) == [] and base_only_creates(fw) == []


def test_trainer_errors_raise_scoring_failed_and_scoring_recovers(
    fake: tuple[FakeFireworks, ServerThread],
    tmp_path: Path,
) -> None:
    fw, srv = fake
    seq = [3, 1, 4, 1, 5, 9]

    async def body(b: FireworksBackend) -> Any:
        fw.fail_future["forward"] = "sequence too long for this trainer"
        with pytest.raises(ScoringFailed, match="sequence too long"):
            await b.compute_logprobs([seq], [2])
        fw.http_fail["trainer.forward"] = [400]
        with pytest.raises(ScoringFailed, match=r"HTTP 400|scripted"):
            await b.compute_logprobs([seq], [2])
        fw.forward_short_by = 1  # a server answering fewer logprobs than target tokens
        with pytest.raises(ScoringFailed, match="4 logprobs for 5 target tokens"):
            await b.compute_logprobs([seq], [2])
        fw.forward_short_by = 0
        ok = await b.compute_logprobs([seq], [2])
        # the failures never touched training state
        assert b.manifest.step == 0
        return ok

    assert run_backend(make_settings(srv.url, tmp_path), body) == [expected(seq, 2)]
    # A failed request poisons the SDK client's sequence: each failure unloads its base-only
    # model and the next call creates a fresh one; a misaligned (but answered) forward does not.
    assert len(base_only_creates(fw)) == 3
    base = [mid for mid, m in fw.models.items() if m.base_only]
    assert [fw.models[mid].unloaded for mid in base] == [True, True, False]
    assert [b["model_id"] for b in fw.bodies("trainer.unload_model")] == base[:2]
    assert [b["model_id"] for b in forward_bodies(fw)] == [base[0], base[1], base[2], base[2]]


def test_full_parameter_trainer_cannot_score_the_base_model(
    fake: tuple[FakeFireworks, ServerThread],
    tmp_path: Path,
) -> None:
    fw, srv = fake
    fw.trainer_mode = "POLICY_TRAINER"

    async def body(b: FireworksBackend) -> Any:
        with pytest.raises(ScoringUnavailable, match="lora_rank"):
            await b.compute_logprobs([[1, 2, 3]], [1])
        assert await b.compute_logprobs([[1, 2, 3]], [3]) == [[]]

    run_backend(make_settings(srv.url, tmp_path, lora_rank=0), body)
    assert forward_bodies(fw) == [] and base_only_creates(fw) == []


def test_not_started_raises(tmp_path: Path) -> None:
    backend = FireworksBackend(make_settings("http://127.0.0.1:9", tmp_path), notify=lambda m: None)
    with pytest.raises(RuntimeError, match="start"):
        asyncio.run(backend.compute_logprobs([[1, 2, 3]], [1]))


class _Tensor:
    def __init__(self, values: list[float]) -> None:
        self.values = values

    def to_numpy(self) -> Any:
        return np.asarray(self.values, dtype=np.float32)


class _Output:
    def __init__(self, outs: list[dict[str, Any]]) -> None:
        self.loss_fn_outputs = outs


def test_completion_logprobs_alignment_checks() -> None:
    seqs, lens = [[1, 2, 3, 4], [5, 6]], [2, 1]
    good = _Output([{"logprobs": _Tensor([-1.0, -2.0, -3.0])}, {"logprobs": _Tensor([-0.5])}])
    assert completion_logprobs(good, seqs, lens) == [[-2.0, -3.0], [-0.5]]
    with pytest.raises(ScoringFailed, match="1 outputs for 2 sequences"):
        completion_logprobs(_Output(good.loss_fn_outputs[:1]), seqs, lens)
    with pytest.raises(ScoringFailed, match="no logprobs"):
        completion_logprobs(_Output([{"loss": _Tensor([0.0])}, good.loss_fn_outputs[1]]), seqs, lens)
    with pytest.raises(ScoringFailed, match="non-finite"):
        completion_logprobs(
            _Output([{"logprobs": _Tensor([-1.0, float("nan"), -3.0])}, good.loss_fn_outputs[1]]), seqs, lens
        )
