"""Best of n for noted calls (`clawbridge.serving.best_of`): the answer the note explains best is served.

Unit rules on a scripted scoring sampler (`FakeScoringSampler`: one answer per seed, its logprobs
under the plain prompt given), then the real app (uvicorn, SQLite, the tiny model's tokenizer) with
the real `openai` SDK: a noted call serves the best candidate token exact and records what it chose
from; a call without notes samples once; forgetting the user while the candidates run stops them all
and records nothing. The real torch engine's scores are tested to equal its sampled logprobs in
tests/test_engine.py, so the note score of a real answer is exact; the effect on SmolLM2 is
measured by bench/note_effect.py --best-of.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clawbridge.rewards.notes_describe import met_words
from clawbridge.serving.best_of import Candidate, best_of, can_pick, note_score, pick
from clawbridge.serving.sampler import (
    FakeSampler,
    FinishedStream,
    SampledToken,
    SamplerOverloaded,
    SampleStream,
    SamplingParams,
    SequenceScorer,
)

SAMPLED_LP = -1.0
"""Every scripted token's logprob under the noted prompt (what it was sampled with)."""


@dataclass
class ClosingStream(FinishedStream):
    """A finished stream that says when it was closed."""

    closed_log: list[int] = field(default_factory=list)
    seed: int = 0

    async def aclose(self) -> None:
        self.closed_log.append(self.seed)
        await super().aclose()


@dataclass
class FakeScoringSampler:
    """A `Sampler` + `SequenceScorer` for tests: the answer for seed s is `answers[s]` (each token
    logprob `SAMPLED_LP`); `score(plain, ids)` gives `plain_lp[tuple(ids)]` per token, any other
    prompt `SAMPLED_LP` per token (the noted prompt, as sampled)."""

    answers: dict[int, list[int]]
    plain_lp: dict[tuple[int, ...], float]
    plain_prompt: list[int]
    delay_s: float = 0.0
    fail_seeds: set[int] = field(default_factory=set)
    version: int = 3
    seeds: list[int | None] = field(default_factory=list)
    scored: list[list[int]] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)

    @property
    def policy_version(self) -> int:
        return self.version

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> SampleStream:
        self.seeds.append(params.seed)
        seed = params.seed if params.seed is not None else len(self.seeds) - 1
        if seed in self.fail_seeds:
            raise SamplerOverloaded("busy")
        toks = [SampledToken(t, SAMPLED_LP) for t in self.answers[seed]]
        return ClosingStream(toks, self.version, "stop", delay_s=self.delay_s, closed_log=self.closed, seed=seed)

    async def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        self.scored.append(list(prompt_ids))
        lp = self.plain_lp[tuple(completion_ids)] if list(prompt_ids) == self.plain_prompt else SAMPLED_LP
        return [lp] * len(completion_ids)


NOTED, PLAIN = [1, 2, 3, 9], [1, 2, 3]
PARAMS = SamplingParams(max_tokens=32, temperature=1.0, seed=7)


def _never_echoes(ids: list[int]) -> bool:
    return False


def test_the_candidate_the_note_explains_best_is_served_as_sampled() -> None:
    """Three seeds, three answers; the one whose tokens lose most without the note (plain logprob
    -3 against -1 sampled: a note score of +2 per token) is served, with its ids, logprobs, version
    and finish reason as sampled; candidate i samples with seed + i; the meta says what was chosen."""
    sampler = FakeScoringSampler(answers={7: [10, 11, 12], 8: [20, 21], 9: [30]},
                                 plain_lp={(10, 11, 12): -1.2, (20, 21): -3.0, (30,): -0.5}, plain_prompt=PLAIN)
    chosen = asyncio.run(best_of(sampler, NOTED, PLAIN, PARAMS, 3, _never_echoes))
    assert sampler.seeds == [7, 8, 9]
    assert chosen.picked == 1 and chosen.stream.policy_version == 3

    async def replay() -> list[SampledToken]:
        return [t async for t in chosen.stream]

    assert replay_ids(asyncio.run(replay())) == [(20, SAMPLED_LP), (21, SAMPLED_LP)]
    assert chosen.stream.finish_reason == "stop"
    assert chosen.meta() == {"n": 3, "picked": 1, "scores": [0.2, 2.0, -0.5], "echoes": 0}
    assert sampler.scored == [PLAIN] * 3  # at temperature 1 the sampled logprobs are the noted ones
    assert sorted(sampler.closed) == [7, 8, 9]  # every candidate's stream is closed


def replay_ids(tokens: list[SampledToken]) -> list[tuple[int, float]]:
    return [(t.token_id, t.logprob) for t in tokens]


def test_at_another_temperature_the_noted_logprobs_are_scored_too() -> None:
    """A sampled logprob is tempered; the note score compares untempered ones, so both prompts are scored."""
    sampler = FakeScoringSampler(answers={7: [10], 8: [20]}, plain_lp={(10,): -2.0, (20,): -1.5}, plain_prompt=PLAIN)
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=7)
    chosen = asyncio.run(best_of(sampler, NOTED, PLAIN, params, 2, _never_echoes))
    assert sorted(map(tuple, sampler.scored)) == sorted([tuple(PLAIN)] * 2 + [tuple(NOTED)] * 2)
    assert chosen.picked == 0


def test_the_score_is_the_mean_not_the_sum() -> None:
    """Brevity is said by one early end token: a short answer the note moved a lot beats a long one
    it moved a little per token, though the long one's sum is larger."""
    short, long = note_score([-1.0, -0.5], [-1.0, -3.5]), note_score([-1.0] * 40, [-1.2] * 40)
    assert short == pytest.approx(1.5) and long == pytest.approx(0.2)
    assert pick([Candidate([], "stop", long, False), Candidate([], "stop", short, False)]) == 1


def test_an_echo_is_served_only_when_every_candidate_echoes() -> None:
    echo, plain = Candidate([], "stop", 5.0, True), Candidate([], "stop", 0.1, False)
    assert pick([echo, plain]) == 1
    assert pick([echo, Candidate([], "stop", 6.0, True)]) == 1
    unscored = Candidate([], "stop", None, False)
    assert pick([unscored, Candidate([], "stop", -2.0, False)]) == 1  # unscored last
    assert pick([unscored, unscored]) == 0
    assert pick([plain, Candidate([], "stop", 0.1, False)]) == 0  # the earliest on ties


def test_a_candidate_that_cannot_start_is_left_out_and_the_first_ones_error_is_the_calls() -> None:
    sampler = FakeScoringSampler(answers={7: [10], 8: [20], 9: [30]},
                                 plain_lp={(10,): -1.0, (20,): -1.0, (30,): -4.0}, plain_prompt=PLAIN,
                                 fail_seeds={9})
    chosen = asyncio.run(best_of(sampler, NOTED, PLAIN, PARAMS, 3, _never_echoes))
    assert chosen.meta()["n"] == 2 and replay_ids(chosen.stream.tokens) == [(10, SAMPLED_LP)]
    sampler.fail_seeds = {7}
    with pytest.raises(SamplerOverloaded):
        asyncio.run(best_of(sampler, NOTED, PLAIN, PARAMS, 3, _never_echoes))


def test_cancelling_closes_every_candidate() -> None:
    """Client gone or user forgotten while the candidates sample: every stream is closed."""
    sampler = FakeScoringSampler(answers={s: [10 + s] * 200 for s in (7, 8, 9)}, plain_lp={}, plain_prompt=PLAIN,
                                 delay_s=0.01)

    async def run() -> None:
        task = asyncio.ensure_future(best_of(sampler, NOTED, PLAIN, PARAMS, 3, _never_echoes))
        for _ in range(1000):  # bounded: the three candidates start within a few loop turns
            if len(sampler.seeds) == 3:
                break
            await asyncio.sleep(0.01)
        assert len(sampler.seeds) == 3, "the candidates never started"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert sorted(sampler.closed) == [7, 8, 9] and sampler.scored == []


def test_only_sampled_calls_on_a_scoring_sampler_are_picked() -> None:
    sampler = FakeScoringSampler(answers={}, plain_lp={}, plain_prompt=PLAIN)
    assert isinstance(sampler, SequenceScorer)
    assert can_pick(sampler, PARAMS, 4)
    assert not can_pick(sampler, PARAMS, 1)
    assert not can_pick(sampler, SamplingParams(max_tokens=8, temperature=0.0), 4)  # greedy: one answer n times
    assert not can_pick(FakeSampler(script=[1]), PARAMS, 4)  # cannot score: one sample


def test_the_judge_narrows_and_the_note_score_picks_among_what_it_named() -> None:
    """Among the candidates the judge says follow the notes, the highest note score; an echo stays
    out even when the judge names it; naming none (or no judgement) leaves the likelihood pick."""
    cands = [Candidate([], "stop", 2.0, False), Candidate([], "stop", 0.1, False),
             Candidate([], "stop", 0.5, False), Candidate([], "stop", 3.0, True)]
    assert pick(cands) == 0
    assert pick(cands, [1, 2]) == 2 and pick(cands, [1]) == 1
    assert pick(cands, [3]) == 0 and pick(cands, []) == 0 and pick(cands, None) == 0


def test_the_checker_sees_every_candidate_once_and_its_choice_is_recorded() -> None:
    sampler = FakeScoringSampler(answers={7: [10, 11, 12], 8: [20, 21], 9: [30]},
                                 plain_lp={(10, 11, 12): -1.2, (20, 21): -3.0, (30,): -0.5}, plain_prompt=PLAIN)
    asked: list[list[list[int]]] = []

    def checker(said: list[int] | None) -> Any:
        async def follows(candidates: list[list[int]]) -> list[int] | None:
            asked.append(candidates)
            return said
        return follows

    chosen = asyncio.run(best_of(sampler, NOTED, PLAIN, PARAMS, 3, _never_echoes, checker([2])))
    assert asked == [[[10, 11, 12], [20, 21], [30]]]
    assert chosen.picked == 2 and chosen.meta()["follows"] == [2]
    silent = asyncio.run(best_of(sampler, NOTED, PLAIN, PARAMS, 3, _never_echoes, checker(None)))
    assert silent.picked == 1 and silent.meta()["follows"] is None  # no judgement: the likelihood's pick
    assert "follows" not in asyncio.run(best_of(sampler, NOTED, PLAIN, PARAMS, 3, _never_echoes)).meta()


def _scripted_checker(said: list[list[int] | None]) -> tuple[Any, list[list[list[int]]]]:
    """A checker that answers `said` in order, and what it was shown each time."""
    asked: list[list[list[int]]] = []

    async def follows(candidates: list[list[int]]) -> list[int] | None:
        asked.append(candidates)
        return said[len(asked) - 1]
    return follows, asked


def test_when_the_judge_finds_none_it_samples_more_once_and_checks_only_those() -> None:
    """The checker names none of 3: 2 more are sampled (seeds go on at seed + 3) and scored, only
    they are shown to it, the one it names is served though another scores higher; the meta counts
    all 5 and the second round. No judgement, a named answer, or more = 0: no second round."""
    answers = {7: [10], 8: [20], 9: [30], 10: [40, 41], 11: [50]}
    lp = {(10,): -1.2, (20,): -3.0, (30,): -0.5, (40, 41): -1.1, (50,): -2.5}
    sampler = FakeScoringSampler(answers=answers, plain_lp=lp, plain_prompt=PLAIN)
    follows, asked = _scripted_checker([[], [0]])
    chosen = asyncio.run(best_of(sampler, NOTED, PLAIN, PARAMS, 3, _never_echoes, follows, more=2))
    assert sampler.seeds == [7, 8, 9, 10, 11] and asked == [[[10], [20], [30]], [[40, 41], [50]]]
    assert chosen.picked == 3 and [t.token_id for t in chosen.stream.tokens] == [40, 41]
    assert chosen.meta() == {"n": 5, "picked": 3, "scores": [0.2, 2.0, -0.5, 0.1, 1.5], "echoes": 0,
                             "follows": [3], "resampled": 2}
    assert sorted(sampler.closed) == [7, 8, 9, 10, 11]

    sampler.seeds.clear()
    follows, asked = _scripted_checker([[], None])  # the second check gives no judgement
    silent = asyncio.run(best_of(sampler, NOTED, PLAIN, PARAMS, 3, _never_echoes, follows, more=2))
    assert silent.picked == 1 and silent.meta()["follows"] == [] and len(asked) == 2  # the best score of all 5
    for said, more in (([None], 2), ([[2]], 2), ([[]], 0)):
        sampler.seeds.clear()
        follows, asked = _scripted_checker(said)
        once = asyncio.run(best_of(sampler, NOTED, PLAIN, PARAMS, 3, _never_echoes, follows, more=more))
        assert sampler.seeds == [7, 8, 9] and len(asked) == 1 and "resampled" not in once.meta()
    sampler.seeds.clear()
    assert "resampled" not in asyncio.run(best_of(sampler, NOTED, PLAIN, PARAMS, 3, _never_echoes, more=2)).meta()
    assert sampler.seeds == [7, 8, 9]  # no checker: never a second round


def test_when_the_judge_names_only_echoes_it_samples_more_once() -> None:
    """The checker names only an answer that repeats its note (never served while another does not):
    as good as naming none, so 2 more are sampled and checked; the one it names there is served, and
    `follows` keeps both rounds' names. Naming an echo and a clean answer: no second round."""
    answers = {7: [10], 8: [20], 9: [30], 10: [40, 41], 11: [50]}
    lp = {(10,): -1.2, (20,): -3.0, (30,): -0.5, (40, 41): -1.1, (50,): -2.5}
    sampler = FakeScoringSampler(answers=answers, plain_lp=lp, plain_prompt=PLAIN)

    def echoes(ids: list[int]) -> bool:
        return ids == [20]

    follows, asked = _scripted_checker([[1], [1]])
    chosen = asyncio.run(best_of(sampler, NOTED, PLAIN, PARAMS, 3, echoes, follows, more=2))
    assert sampler.seeds == [7, 8, 9, 10, 11] and asked == [[[10], [20], [30]], [[40, 41], [50]]]
    assert chosen.picked == 4 and chosen.meta()["follows"] == [1, 4] and chosen.meta()["resampled"] == 2
    sampler.seeds.clear()
    follows, asked = _scripted_checker([[1, 2]])
    once = asyncio.run(best_of(sampler, NOTED, PLAIN, PARAMS, 3, echoes, follows, more=2))
    assert sampler.seeds == [7, 8, 9] and len(asked) == 1 and once.picked == 2


def test_a_second_round_from_another_version_is_not_mixed_in() -> None:
    """A version published between the rounds: the second round's answers are left out (never
    mixed), the first round's pick is served with its version."""
    sampler = FakeScoringSampler(answers={7: [10], 8: [20], 9: [30]}, plain_lp={(10,): -1.2, (20,): -3.0},
                                 plain_prompt=PLAIN)

    async def follows(candidates: list[list[int]]) -> list[int] | None:
        sampler.version = 4  # the trainer published while the judge read
        return []

    chosen = asyncio.run(best_of(sampler, NOTED, PLAIN, PARAMS, 2, _never_echoes, follows, more=1))
    assert sampler.seeds == [7, 8, 9] and chosen.stream.policy_version == 3
    assert chosen.picked == 1 and chosen.meta()["n"] == 2 and "resampled" not in chosen.meta()


# ------------------------------------------------------------------ through the proxy


def _proxy_sampler(tiny_model_dir: Path, **kw: Any) -> tuple[Any, FakeScoringSampler, dict[int, str]]:
    """A scoring fake whose answers are real text: seed 0 a long one the note did not move, seed 1 a
    short one it did (plain logprob -4 per token), seed 2 one that repeats the note."""
    from clawbridge.chat.render import Renderer
    from tests.fake_proxy import script_for

    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    texts = {0: "Tea is brewed by steeping leaves in hot water for a few minutes, then you pour it.",
             1: "Steep the leaves, Sam.", 2: "[Hint: Call the user Sam.] Steep the leaves."}
    answers = {s: script_for(renderer, t) for s, t in texts.items()}
    lp = {tuple(answers[0]): -1.1, tuple(answers[1]): -4.0, tuple(answers[2]): -9.0}
    return renderer, FakeScoringSampler(answers=answers, plain_lp=lp, plain_prompt=[], **kw), texts


def _rows(state_dir: Path) -> dict[str, Any]:
    import sqlite3

    db = sqlite3.connect(state_dir / "clawbridge.db")
    db.row_factory = sqlite3.Row
    try:
        return {r["session_id"]: r for r in db.execute("SELECT * FROM turns")}
    finally:
        db.close()


class PlainPromptSampler(FakeScoringSampler):
    """Learns the plain prompt from the first call (a call without notes), as the proxy renders it."""

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> SampleStream:
        if not self.plain_prompt:
            self.plain_prompt = list(prompt_ids)
        return await super().sample(prompt_ids, params)


@pytest.mark.parametrize("n", [1, 3])
def test_a_noted_call_serves_the_best_of_n_and_records_it_token_exact(tiny_model_dir: Path, tmp_path: Path,
                                                                       n: int) -> None:
    """With `notes_best_of = 3` the noted call answers seed 1's text (the note moved it most; seed
    2's scores higher but echoes the note), records exactly its ids and logprobs with the noted
    prompt, the plain one to train on, and `meta.best_of`; with 1 it answers seed 0 as one sample
    would. A call without notes samples once."""
    from clawbridge.store.codec import decode_floats, decode_ids
    from tests.fake_proxy import start_fake_proxy

    renderer, sampler, texts = _proxy_sampler(tiny_model_dir)
    sampler = PlainPromptSampler(**{f: getattr(sampler, f) for f in ("answers", "plain_lp", "plain_prompt")})
    proxy = start_fake_proxy(tiny_model_dir, tmp_path / "state", sampler, notes_best_of=n)  # type: ignore[arg-type]
    try:
        key = proxy.state.keys.client
        client = openai.OpenAI(base_url=f"{proxy.base}/v1", api_key=key, max_retries=0)
        question = [{"role": "user", "content": "How do I make tea?"}]

        def ask(sid: str, seed: int) -> str:
            made = client.chat.completions.create(model="tiny", messages=question, seed=seed,  # type: ignore[arg-type]
                                                  extra_headers={"X-Session-Id": sid})
            return made.choices[0].message.content or ""

        assert ask("plain", 0) == texts[0] and sampler.seeds == [0]
        assert httpx.post(f"{proxy.base}/rl/notes", json={"text": "Call the user Sam."},
                          headers={"Authorization": f"Bearer {key}"}).status_code == 200
        served = ask("noted", 0)
        listed = httpx.get(f"{proxy.base}/rl/notes", headers={"Authorization": f"Bearer {key}"}).json()["notes"]
    finally:
        proxy.stop()
    assert served == (texts[1] if n == 3 else texts[0])
    # what `clawbridge status`, `clawbridge notes` and the dashboard say of the note
    assert [(x["best_of_answers"], x["best_of_n"]) for x in listed] == [(1, 3) if n == 3 else (0, 0)]
    said = met_words(listed[0])
    assert ("1 answer served as the best of 3 at following it" in said) == (n == 3), said
    assert sampler.seeds == [0, *range(n)]
    rows = _rows(tmp_path / "state")
    noted, plain = rows["noted"], rows["plain"]
    meta = json.loads(noted["meta_json"])
    picked = 1 if n == 3 else 0
    assert decode_ids(noted["completion_token_ids"]) == sampler.answers[picked]
    assert decode_floats(noted["completion_logprobs"]) == [SAMPLED_LP] * len(sampler.answers[picked])
    assert "[Hint: Call the user Sam.]" in renderer.decode(decode_ids(noted["prompt_token_ids"]))
    assert decode_ids(noted["train_prompt_token_ids"]) == decode_ids(plain["prompt_token_ids"])
    if n == 3:
        assert meta["best_of"]["n"] == 3 and meta["best_of"]["picked"] == 1 and meta["best_of"]["echoes"] == 1
        assert "notes_echoed" not in meta
    else:
        assert "best_of" not in meta
    assert "best_of" not in json.loads(plain["meta_json"])


def test_forgetting_the_user_stops_her_candidates_and_records_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Alice's noted call is sampling its candidates (slow: seconds each) when she is forgotten: the
    call is answered 401 `user_forgotten`, every candidate's stream is closed before it finished
    (none was scored: scoring follows the last), nothing of hers is recorded."""
    from tests.fake_proxy import start_fake_proxy

    _, sampler, _ = _proxy_sampler(tiny_model_dir, delay_s=0.01)
    sampler.answers = {s: ids * 40 for s, ids in sampler.answers.items()}
    proxy = start_fake_proxy(tiny_model_dir, tmp_path / "state", sampler, notes_best_of=3)  # type: ignore[arg-type]
    outcome: dict[str, Any] = {}
    try:
        admin = {"Authorization": f"Bearer {proxy.state.keys.admin}"}
        alice = httpx.post(f"{proxy.base}/rl/users", json={"user": "alice"}, headers=admin).json()["api_key"]
        assert httpx.post(f"{proxy.base}/rl/notes", json={"text": "Call the user Sam."},
                          headers={"Authorization": f"Bearer {alice}"}).status_code == 200
        secret = f"tea-{uuid.uuid4().hex}"

        def run() -> None:
            client = openai.OpenAI(base_url=f"{proxy.base}/v1", api_key=alice, max_retries=0, timeout=60)
            try:
                outcome["call"] = client.chat.completions.create(
                    model="tiny", seed=0, messages=[{"role": "user", "content": secret}], max_tokens=400,
                    extra_headers={"X-Session-Id": "s"})
            except openai.APIError as exc:
                outcome["call"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 30
        while len(sampler.seeds) < 3:
            assert time.monotonic() < deadline, "the candidates never started"
            time.sleep(0.02)
        forgot = httpx.post(f"{proxy.base}/rl/users/alice/forget", headers=admin, timeout=60)
        thread.join(60)
        assert forgot.status_code == 200 and forgot.json()["cut"] == 1, forgot.text
        call = outcome["call"]
        assert isinstance(call, openai.AuthenticationError) and call.code == "user_forgotten", call
        assert sorted(sampler.closed) == [0, 1, 2] and sampler.scored == []
        assert proxy.state.store.list_sessions() == []
    finally:
        proxy.stop()
    assert secret.encode() not in (tmp_path / "state" / "clawbridge.db").read_bytes()


@pytest.mark.parametrize(("pick_by", "said", "served_seed"), [
    ("auto", "FOLLOWS: 1", 0),  # the judge names the long answer: served though the note moved it least
    ("auto", "FOLLOWS: none", 1),  # it names none: the likelihood's pick
    ("likelihood", "FOLLOWS: 1", 1),  # not asked
])
def test_with_a_judge_endpoint_it_checks_the_candidates_before_the_pick(tiny_model_dir: Path, tmp_path: Path,
                                                                         pick_by: str, said: str,
                                                                         served_seed: int) -> None:
    """With judge=endpoint (`notes_pick = auto`) a noted call's three candidates go to the judge,
    decoded, with the user's note and request; the answer it names is served token exact and the
    turn records what it said (`meta.best_of.follows`)."""
    from clawbridge.devtools.judge_server import JudgeServer, is_check_prompt
    from clawbridge.store.codec import decode_ids
    from tests.fake_proxy import start_fake_proxy

    def answer(body: dict[str, Any]) -> str:
        prompt = "\n".join(str(m.get("content")) for m in body["messages"])
        return said if is_check_prompt(prompt) else "no signal\nSCORE: 0"

    _, sampler, texts = _proxy_sampler(tiny_model_dir)
    sampler = PlainPromptSampler(**{f: getattr(sampler, f) for f in ("answers", "plain_lp", "plain_prompt")})
    with JudgeServer(answer) as judge:
        proxy = start_fake_proxy(tiny_model_dir, tmp_path / "state", sampler, notes_best_of=3,  # type: ignore[arg-type]
                                 judge="endpoint", judge_base_url=judge.base_url, judge_model="rule-based",
                                 notes_pick=pick_by, notes_best_of_more=0)
        try:
            key = proxy.state.keys.client
            client = openai.OpenAI(base_url=f"{proxy.base}/v1", api_key=key, max_retries=0)

            def ask(sid: str) -> str:
                made = client.chat.completions.create(
                    model="tiny", seed=0, messages=[{"role": "user", "content": "How do I make tea?"}],
                    extra_headers={"X-Session-Id": sid})
                return made.choices[0].message.content or ""

            ask("plain")
            assert httpx.post(f"{proxy.base}/rl/notes", json={"text": "Call the user Sam."},
                              headers={"Authorization": f"Bearer {key}"}).status_code == 200
            served = ask("noted")
            listed = httpx.get(f"{proxy.base}/rl/notes", headers={"Authorization": f"Bearer {key}"}).json()["notes"]
        finally:
            proxy.stop()
        checks = [b for b in judge.requests
                  if is_check_prompt("\n".join(str(m.get("content")) for m in b["messages"]))]
    assert served == texts[served_seed]
    noted = _rows(tmp_path / "state")["noted"]
    assert decode_ids(noted["completion_token_ids"]) == sampler.answers[served_seed]
    meta = json.loads(noted["meta_json"])["best_of"]
    said_of_note = met_words(listed[0])  # what `clawbridge status`, `clawbridge notes` and the dashboard say
    if pick_by == "likelihood":
        assert checks == [] and "follows" not in meta and "the judge found" not in said_of_note, said_of_note
        return
    found = 1 if said == "FOLLOWS: 1" else 0
    assert f"best of 3 at following it (the judge found one that does among {found} of 1)" in said_of_note
    assert len(checks) == 1 and checks[0]["temperature"] == 0.0
    shown = checks[0]["messages"][1]["content"]
    assert "[1] Call the user Sam." in shown and "How do I make tea?" in shown
    assert all(f"### Answer {i + 1}\n{texts[i]}" in shown for i in range(3))
    assert meta["follows"] == ([0] if said == "FOLLOWS: 1" else [])


def test_the_judge_sees_only_the_calling_users_notes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Alice and Bob each have a note; Alice's noted call sends the judge her note and never Bob's,
    and a call on the shared key (no notes of its own) sends no check at all."""
    from clawbridge.devtools.judge_server import JudgeServer, is_check_prompt
    from tests.fake_proxy import start_fake_proxy

    def prompt_of(body: dict[str, Any]) -> str:
        return "\n".join(str(m.get("content")) for m in body["messages"])

    _, sampler, _ = _proxy_sampler(tiny_model_dir)
    with JudgeServer(lambda body: "FOLLOWS: 1" if is_check_prompt(prompt_of(body)) else "SCORE: 0") as judge:
        proxy = start_fake_proxy(tiny_model_dir, tmp_path / "state", sampler, notes_best_of=3,  # type: ignore[arg-type]
                                 judge="endpoint", judge_base_url=judge.base_url, judge_model="rule-based")
        try:
            admin = {"Authorization": f"Bearer {proxy.state.keys.admin}"}
            keys = {u: httpx.post(f"{proxy.base}/rl/users", json={"user": u}, headers=admin).json()["api_key"]
                    for u in ("alice", "bob")}
            for user, note in (("alice", "Call the user Alice."), ("bob", "Call the user Bob-secret.")):
                assert httpx.post(f"{proxy.base}/rl/notes", json={"text": note},
                                  headers={"Authorization": f"Bearer {keys[user]}"}).status_code == 200
            for key, sid in ((keys["alice"], "a"), (proxy.state.keys.client, "shared")):
                openai.OpenAI(base_url=f"{proxy.base}/v1", api_key=key, max_retries=0).chat.completions.create(
                    model="tiny", seed=0, messages=[{"role": "user", "content": "How do I make tea?"}],
                    extra_headers={"X-Session-Id": sid})
        finally:
            proxy.stop()
        checks = [prompt_of(b) for b in judge.requests if is_check_prompt(prompt_of(b))]
    assert len(checks) == 1, checks  # Alice's call only: the shared key has no note
    assert "[1] Call the user Alice." in checks[0] and "Bob-secret" not in checks[0]


def test_through_the_proxy_a_second_round_is_sampled_when_the_judge_finds_none(tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    """`notes_best_of = 3`, `notes_best_of_more = 2`: the judge names none of the first three, two
    more are sampled with the next seeds and shown to it alone, the one it names is served token
    exact, and the turn and the note's status say the call was sampled again."""
    from clawbridge.chat.render import Renderer
    from clawbridge.devtools.judge_server import JudgeServer, is_check_prompt
    from clawbridge.store.codec import decode_ids
    from tests.fake_proxy import script_for, start_fake_proxy

    _, base, texts = _proxy_sampler(tiny_model_dir)
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    texts = {**texts, 3: "Sam, steep the leaves for three minutes.", 4: "Pour water on the leaves."}
    answers = {**base.answers, **{s: script_for(renderer, texts[s]) for s in (3, 4)}}
    lp = {**base.plain_lp, tuple(answers[3]): -1.5, tuple(answers[4]): -6.0}
    sampler = PlainPromptSampler(answers=answers, plain_lp=lp, plain_prompt=[])

    def prompt_of(body: dict[str, Any]) -> str:
        return "\n".join(str(m.get("content")) for m in body["messages"])

    def answer(body: dict[str, Any]) -> str:
        prompt = prompt_of(body)
        if not is_check_prompt(prompt):
            return "no signal\nSCORE: 0"
        return "FOLLOWS: none" if texts[0] in prompt else "FOLLOWS: 1"

    with JudgeServer(answer) as judge:
        proxy = start_fake_proxy(tiny_model_dir, tmp_path / "state", sampler, notes_best_of=3,  # type: ignore[arg-type]
                                 notes_best_of_more=2, judge="endpoint", judge_base_url=judge.base_url,
                                 judge_model="rule-based")
        try:
            key = proxy.state.keys.client
            client = openai.OpenAI(base_url=f"{proxy.base}/v1", api_key=key, max_retries=0)
            for sid in ("plain", "noted"):
                served = client.chat.completions.create(
                    model="tiny", seed=0, messages=[{"role": "user", "content": "How do I make tea?"}],
                    extra_headers={"X-Session-Id": sid}).choices[0].message.content
                if sid == "plain":
                    assert httpx.post(f"{proxy.base}/rl/notes", json={"text": "Call the user Sam."},
                                      headers={"Authorization": f"Bearer {key}"}).status_code == 200
            listed = httpx.get(f"{proxy.base}/rl/notes", headers={"Authorization": f"Bearer {key}"}).json()["notes"]
        finally:
            proxy.stop()
        checks = [prompt_of(b) for b in judge.requests if is_check_prompt(prompt_of(b))]
    assert served == texts[3] and sampler.seeds == [0, 0, 1, 2, 3, 4]  # the plain call, then 3 + 2
    assert len(checks) == 2 and texts[0] not in checks[1]
    assert f"### Answer 1\n{texts[3]}" in checks[1] and f"### Answer 2\n{texts[4]}" in checks[1]
    noted = _rows(tmp_path / "state")["noted"]
    assert decode_ids(noted["completion_token_ids"]) == answers[3]
    meta = json.loads(noted["meta_json"])["best_of"]
    assert meta["n"] == 5 and meta["picked"] == 3 and meta["follows"] == [3] and meta["resampled"] == 2
    assert ("1 answer served as the best of 3 at following it (the judge found one that does among 1 of 1, "
            "1 sampled again when it found none at first)") in met_words(listed[0])
