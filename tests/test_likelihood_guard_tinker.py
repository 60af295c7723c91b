"""Promotion's likelihood scoring on Tinker: a committed version's own logprobs of given tokens
(`TinkerSampler.score`, Tinker's `compute_logprobs` on that version's sampling client), and the
likelihood guard deciding through the real `Evaluator` and the real SDK against
`tests.tinker_server` (its wire protocol on 127.0.0.1).

The server's model: a prompt token's logprob under weights trained `step` steps is
`prompt_logprob(token, step)`, 0.5 nats lower per step; `script` makes its greedy answers name
probe facts, the same at every step, so the greedy probe holds while the likelihood falls.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tinker")

from clawbridge_tinker import TinkerBackend

from clawbridge.access import OPERATOR
from clawbridge.backend import LossConfig
from clawbridge.chat.render import Renderer
from clawbridge.promotion.capability import PROBE_SOURCE
from clawbridge.promotion.promoter import Promoter
from clawbridge.promotion.report import promotion_status
from clawbridge.promotion.runner import Evaluator
from clawbridge.serving.sampler import SequenceScorer
from clawbridge.serving.versions import VersionRouter
from clawbridge.store import Store
from clawbridge.store.versions import VersionStore
from tests.test_tinker_backend import MODEL, PROMPT, datum, make_settings, run
from tests.tinker_server import TinkerProtocolServer, prompt_logprob


async def _two_steps(b: TinkerBackend, versions: VersionStore) -> None:
    """What the trainer loop does per step: train, publish, checkpoint, commit (versions 1 and 2)."""
    for step in (1, 2):
        await b.train_step([datum([40 + step])], LossConfig("importance_sampling"))
        v = versions.reserve("step", step)
        await b.publish(v)
        versions.commit(v, await b.save_checkpoint(f"step-{step}"), None)


@pytest.mark.parametrize("refuse_last_n", [False, True], ids=["last-n", "server-refuses-last-n"])
def test_each_version_scores_given_tokens_under_its_own_weights(tmp_path: Path, refuse_last_n: bool) -> None:
    server = TinkerProtocolServer(models=(MODEL,))
    server.refuse_last_n = refuse_last_n
    server.start()
    store = Store.open(tmp_path / "store")
    completion = [11, 12, 13, 30]

    async def body(b: TinkerBackend) -> dict[int, list[float]]:
        versions = VersionStore(store)
        await _two_steps(b, versions)
        router = VersionRouter(b, versions, ("tiny", "default"))
        out: dict[int, list[float]] = {}
        for v in (1, 2):  # v1 loaded beside the published v2, v2 the published sampler itself
            sampler = await router.sampler_for(v, OPERATOR, "evaluate")
            assert isinstance(sampler, SequenceScorer)
            out[v] = await sampler.score(PROMPT, completion)
        return out

    try:
        out = run(server, tmp_path, body)
    finally:
        server.stop()
        store.close()
    for v in (1, 2):  # token exact, the completion's tokens only, in order
        assert out[v] == [prompt_logprob(t, v) for t in completion]
    asked = [b for b in server.bodies("asample") if b.get("prompt_logprobs")]
    assert [b["prompt"]["chunks"][0]["tokens"] for b in asked][-1] == PROMPT + completion
    if refuse_last_n:  # refused once (422), then full prompt logprobs, sliced here
        assert [b.get("prompt_logprobs_last_n") for b in asked] == [4, None, None]
    else:
        assert [b.get("prompt_logprobs_last_n") for b in asked] == [4, 4]


def _facts(renderer: Renderer, probe_lines: list[dict[str, Any]]) -> dict[tuple[int, ...], list[int]]:
    """Greedy answers the scripted server gives: each capital question of the probe answered with
    its city (from the item's own regex), token exact, ended by the chat's stop token."""
    answers: dict[tuple[int, ...], list[int]] = {}
    for item in probe_lines:
        city = re.fullmatch(r"\\b([a-z]+)\\b", item["expect"])
        if item["id"].startswith("capital-") and city:
            prompt = renderer.render(item["messages"])
            text = f"The capital is {city.group(1).capitalize()}."
            answers[tuple(prompt)] = [*renderer.encode(text), renderer.stop_token_ids[0]]
    return answers


def test_the_guard_rejects_a_tinker_candidate_that_lost_likelihood_while_the_greedy_probe_holds(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    import json
    from importlib import resources

    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    text = resources.files("clawbridge.promotion").joinpath("capability_probe.jsonl").read_text(encoding="utf-8")
    answers = _facts(renderer, [json.loads(line) for line in text.splitlines() if line.strip()])
    assert len(answers) >= 5
    server = TinkerProtocolServer(models=(MODEL,))
    server.vocab = 4000  # below the tiny tokenizer's vocabulary
    server.script = lambda prompt: answers.get(tuple(prompt))
    server.start()
    store = Store.open(tmp_path / "store")
    settings = make_settings(server, tmp_path, tokenizer=str(tiny_model_dir))
    assert settings.capability_probe_nats == pytest.approx(0.1)  # the default

    async def body(b: TinkerBackend) -> tuple[Any, dict[str, Any]]:
        versions = VersionStore(store)
        await _two_steps(b, versions)
        router = VersionRouter(b, versions, ("tiny", "default"))
        promoter = Promoter(settings, store, router, Evaluator(router, renderer, max_tokens=32))
        promoter.serving = 1
        return await promoter._evaluate(2), promotion_status(promoter)

    try:
        decision, status = run(server, tmp_path, body, tokenizer=str(tiny_model_dir))
    finally:
        server.stop()
        store.close()
    # the greedy probe holds (the same scripted facts at every step); the candidate is 0.5 nats per
    # token less likely to say the serving v1's correct answers: beyond the bar of 0.1
    assert decision.verdict == "rejected", decision.reason
    assert decision.reason.startswith(f"likelihood of anchor v1's {len(answers)} correct probe answers -0.500")
    assert "beyond the bar of -0.1" in decision.reason and PROBE_SOURCE not in decision.reason
    probe = status["capability_probe"]
    assert probe["serving"]["passed"] == len(answers)
    assert probe["likelihood"]["answers"] == len(answers) and probe["likelihood"]["anchor"] == 1


def test_a_score_the_service_cannot_give_is_an_error_of_the_seam_not_a_guess() -> None:
    from clawbridge_tinker import FakeSamplingClient, SamplerLimits, TinkerSampler

    from clawbridge.serving.sampler import PromptTooLong, SamplerUnavailable

    fake = FakeSamplingClient(tokens=[1], logprobs=[-1.0], prompt_logprob=-0.75)
    sampler = TinkerSampler(fake, 3, SamplerLimits(context_window=8, max_retries=0, backoff_s=0.01))

    async def go() -> None:
        assert await sampler.score([5, 6], [7, 8, 9]) == [-0.75] * 3
        assert await sampler.score([5, 6], []) == []
        with pytest.raises(PromptTooLong):  # refused before anything is sent
            await sampler.score([5] * 6, [7, 8, 9])
        fake.prompt_logprob = float("nan")  # a position the service did not score
        with pytest.raises(SamplerUnavailable, match="compute_logprobs returned"):
            await sampler.score([5, 6], [7])

    asyncio.run(go())
    assert [ids for ids, params in fake.calls if params is None] == [[5, 6, 7, 8, 9], [5, 6, 7]]
