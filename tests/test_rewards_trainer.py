"""How judge verdicts, explicit rewards and OPD become advantages: rules 1b, 1c and 5, the OPD
teacher inputs (fake scorer) and the local backend's real base-model scoring on the tiny model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from clawbridge.backend import FakeLogprobScorer, LogprobScorer, ModelInfo
from clawbridge.config import Settings
from clawbridge.rewards.judge import ScriptedJudge
from clawbridge.rewards.opd import HINT_TEMPLATE, hinted_messages, opd_advantages
from clawbridge.rewards.worker import RewardWorker, WorkerConfig
from clawbridge.serving.sampler import FakeSampler, SamplingParams
from clawbridge.store import Store
from clawbridge.store.rewards import RewardStore
from clawbridge.store.training import SessionTrace, TraceTurn, TrainingStore
from clawbridge.trainer import FakeTrainingBackend, TrainerConfig, TrainerLoop
from clawbridge.trainer.advantages import (
    RewardMix,
    RunningMeans,
    combined_rewards,
    mix_token_advantages,
    promote_best,
)
from clawbridge.trainer.datums import prepare_batch
from tests.rewards_support import SYSTEM, assistant, openclaw_session, record, user

INFO = ModelInfo(name="tiny", tokenizer_path="unused", context_window=4096, max_output_tokens=64)


def trace(*turns: tuple[str, bool, float | None], session_reward: float | None = None) -> SessionTrace:
    return SessionTrace("s", None, "header",
                        tuple(TraceTurn(tid, i, tr, r) for i, (tid, tr, r) in enumerate(turns)), session_reward)


# ------------------------------------------------------------------ rule 1b: explicit vs judge


def test_explicit_overrides_or_adds_to_judge() -> None:
    tr = trace(("a", True, None), ("side", False, 0.5), ("b", True, None), ("c", True, 2.0))
    judge = {"a": -1.0, "b": 1.0, "c": 1.0}
    # override: 'a' got the side turn's explicit 0.5 (credited backwards), 'c' its own 2.0; 'b' keeps the judge
    assert combined_rewards(tr, judge, "override") == {"a": 0.5, "b": 1.0, "c": 2.0}
    assert combined_rewards(tr, judge, "add") == {"a": -0.5, "b": 1.0, "c": 3.0}
    # a session reward lands on the last trainable turn: it overrides that turn's verdict
    tr2 = trace(("a", True, None), ("b", True, None), session_reward=-2.0)
    assert combined_rewards(tr2, {"a": 1.0, "b": 1.0}, "override") == {"a": 1.0, "b": -2.0}
    assert combined_rewards(tr2, {"a": 1.0, "b": 1.0}, "add") == {"a": 1.0, "b": -1.0}
    # no judge: exactly rule 1
    assert combined_rewards(tr, {}, "override") == {"a": 0.5, "b": 0.0, "c": 2.0}


def test_at_least_one_promotes_the_best_mean_vote_only_when_positive() -> None:
    order = ["a", "b", "c"]
    assert promote_best({"a": 0.0, "b": 0.0}, {"a": 1 / 3, "b": 1 / 3}, order) == {"b": 1 / 3}  # later wins ties
    assert promote_best({"a": 0.0, "b": 0.0}, {"a": 2 / 3, "b": 1 / 3}, order) == {"a": 2 / 3}
    assert promote_best({"a": 0.0, "b": 0.0}, {"a": 0.0, "b": -1 / 3}, order) == {}  # no positive vote: nothing
    assert promote_best({"a": 1.0, "b": 0.0}, {"a": 1.0, "b": 1 / 3}, order) == {}  # already has signal
    tr = trace(("a", True, None), ("b", True, None))
    means = {"a": 1 / 3, "b": 0.0}
    assert combined_rewards(tr, {"a": 0.0, "b": 0.0}, "override", means, promote=True) == {"a": 1 / 3, "b": 0.0}
    assert combined_rewards(tr, {"a": 0.0, "b": 0.0}, "override", means, promote=False) == {"a": 0.0, "b": 0.0}
    tr_explicit = trace(("a", True, None), ("b", True, 0.0))  # an explicit reward: no promotion
    assert combined_rewards(tr_explicit, {"a": 0.0}, "override", means, promote=True) == {"a": 0.0, "b": 0.0}


def test_mix_token_advantages_methods() -> None:
    opd = [0.5, -0.5]
    assert mix_token_advantages(2.0, opd, 2, "rl", 0.3, 0.7) == [2.0, 2.0]
    assert mix_token_advantages(2.0, opd, 2, "opd", 0.3, 0.7) == [0.5, -0.5]
    assert mix_token_advantages(2.0, opd, 2, "combine", 0.3, 0.7) == pytest.approx([0.6 + 0.35, 0.6 - 0.35])
    assert mix_token_advantages(2.0, None, 2, "combine", 0.3, 0.7) == pytest.approx([0.6, 0.6])  # RL-only turn
    assert mix_token_advantages(0.0, None, 2, "opd", 0.3, 0.7) == [0.0, 0.0]
    assert opd_advantages([-1.0, -2.0], [-1.5, -1.0], 2.0) == [1.0, -2.0]


# ------------------------------------------------------------------ through the store and the trainer


def judged_session(store: Store, scorer: LogprobScorer | None = None, renderer: Any = None,
                   noted: bool = False) -> dict[str, str]:
    ids = openclaw_session(store, "s1", noted=noted)
    answers = {"[tool result": "SCORE: +1", "[user] No,": "HINT: only .txt files, sorted by name\nSCORE: -1"}

    def pick(messages: list[dict[str, Any]]) -> str:
        return next(a for k, a in answers.items() if k in messages[-1]["content"])

    w = RewardWorker(store, ScriptedJudge(pick), WorkerConfig(), renderer=renderer, scorer=scorer)
    assert asyncio.run(w.run_once()) == 1
    return ids


def test_combined_method_per_token_advantages(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    ids = judged_session(store)
    teacher = [-0.1, -0.2, -0.3]  # recorded sampler logprobs are -0.5 each
    RewardStore(store).save_teacher_logprobs(ids["answer"], teacher, 10)
    tstore = TrainingStore(store, wait_for_judge=True)
    tstore.ingest_ended()
    batch = tstore.ready_samples()
    assert [s.turn_id for s in batch] == [ids["tools"], ids["answer"], ids["fixed"]]

    def advs(mix: RewardMix) -> dict[str, list[float]]:
        pb = prepare_batch(tstore, batch, gamma=0.0, baseline="none", normalization="sum",
                           running=RunningMeans(), current_version=0, mix=mix)
        return {d.turn_id: list(d.advantages[d.prompt_len - 1:]) for d in pb.datums}

    opd = [2.0 * (t + 0.5) for t in teacher]  # opd_coef 2
    combine = advs(RewardMix("combine", w_rl=0.5, w_opd=0.25, opd_coef=2.0))
    assert combine[ids["tools"]] == pytest.approx([0.5] * 3)  # RL only (+1 verdict, no teacher)
    assert combine[ids["answer"]] == pytest.approx([0.5 * -1 + 0.25 * o for o in opd])
    assert combine[ids["fixed"]] == pytest.approx([0.0] * 3)  # no next state, no reward
    assert advs(RewardMix("rl"))[ids["answer"]] == pytest.approx([-1.0] * 3)
    assert advs(RewardMix("opd", opd_coef=2.0))[ids["answer"]] == pytest.approx(opd)
    assert advs(RewardMix("opd"))[ids["tools"]] == pytest.approx([0.0] * 3)
    # an explicit reward on the corrected turn overrides the judge's -1 (or adds to it)
    store.add_reward("s1", 3.0, "api", ids["answer"])
    assert advs(RewardMix("rl"))[ids["answer"]] == pytest.approx([3.0] * 3)
    assert advs(RewardMix("rl", explicit_rule="add"))[ids["answer"]] == pytest.approx([2.0] * 3)


def test_loop_waits_for_the_judge_then_trains_on_its_verdicts(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    ids = openclaw_session(store, "s1")
    store.add_reward("s1", 1.0, "api", ids["fixed"])  # explicit, on the last turn
    backend = FakeTrainingBackend(FakeSampler(script=[7]), INFO)
    loop = TrainerLoop(store, backend, TrainerConfig(batch_size=1, baseline="none", normalization="sum",
                                                     gamma=0.0, wait_for_judge=True))
    assert asyncio.run(loop.run_once()) is None  # rewarded, but the judge has not finished the session
    judge = ScriptedJudge(lambda m: "SCORE: -1" if "[user] No," in m[-1]["content"] else "SCORE: +1")
    assert asyncio.run(RewardWorker(store, judge, WorkerConfig()).run_once()) == 1
    report = asyncio.run(loop.run_once())
    assert report is not None and report.ok
    got = {d.turn_id: d.advantages[-1] for d in backend.batches[0]}
    assert got == {ids["tools"]: 1.0, ids["answer"]: -1.0, ids["fixed"]: 1.0}
    assert report.metrics["judge_turns"] == 2.0


def test_settings_reach_the_trainer_and_worker() -> None:
    s = Settings.model_validate(dict(judge="endpoint", method="opd", w_rl=0.2, explicit_reward_rule="add",
                                     judge_votes=5, judge_promote_best=True))
    cfg = TrainerConfig.from_settings(s)
    assert cfg.wait_for_judge and cfg.mix == RewardMix("opd", 0.2, 1.0, 1.0, "add", True)
    wc = WorkerConfig.from_settings(s)
    assert wc.votes.votes == 5 and wc.opd
    assert not TrainerConfig.from_settings(Settings.model_validate({})).wait_for_judge


# ------------------------------------------------------------------ OPD teacher inputs


def test_teacher_scores_recorded_ids_with_the_hint_in_the_prompt(tmp_path: Path, tiny_model_dir: Path) -> None:
    from clawbridge.chat.render import Renderer

    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    store = Store.open(tmp_path)
    scorer = FakeLogprobScorer(lambda toks, i: -0.25)
    ids = judged_session(store, scorer, renderer)
    assert len(scorer.calls) == 1  # only the turn with a hint
    tokens, plen = scorer.calls[0]
    assert tokens[plen:] == [4, 5, 6]  # the RECORDED completion ids, appended as they are
    hist = RewardStore(store).transcript("s1")[2].request  # the 'answer' turn
    expected = renderer.render(hinted_messages(hist["messages"], "only .txt files, sorted by name"), hist["tools"])
    assert tokens[:plen] == expected
    assert HINT_TEMPLATE.format(hint="only .txt files, sorted by name").strip() in renderer.decode(tokens[:plen])
    sig = RewardStore(store).turn_signals([ids["answer"], ids["tools"]])
    assert sig[ids["answer"]].teacher_logprobs == [-0.25] * 3 and sig[ids["tools"]].teacher_logprobs is None
    # scored once: a second pass (or a restart) does not score again
    asyncio.run(RewardWorker(store, ScriptedJudge(["SCORE: 0"]), WorkerConfig(), renderer, scorer).run_once())
    assert len(scorer.calls) == 1


def test_a_noted_turns_teacher_is_measured_against_the_plain_prompt(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A turn served with a note was sampled with the hint already in its context: OPD measures its
    teacher against the base model on the plain prompt it trains on, not against its sampled
    logprobs (which already carry the note)."""
    from clawbridge.chat.render import Renderer

    store = Store.open(tmp_path)
    plain = [1, 2, 3, 4, 5, 6]  # the train prompt [1, 2, 3] + the recorded completion [4, 5, 6]
    scorer = FakeLogprobScorer(lambda toks, i: -0.9 if list(toks) == plain else -0.1)
    ids = judged_session(store, scorer, Renderer.from_pretrained(str(tiny_model_dir)), noted=True)
    teacher = [(toks, plen) for toks, plen in scorer.calls if toks != plain]
    assert len(teacher) == 1 and teacher[0][0][teacher[0][1]:] == [4, 5, 6]  # the hinted teacher, as before
    assert [(toks, plen) for toks, plen in scorer.calls if toks == plain] == [(plain, 3)]  # one reference, plain
    sig = RewardStore(store).turn_signals([ids["answer"]])[ids["answer"]]
    assert sig.teacher_logprobs == [-0.1] * 3 and sig.reference_logprobs == [-0.9] * 3
    tstore = TrainingStore(store, wait_for_judge=True)
    tstore.ingest_ended()
    pb = prepare_batch(tstore, tstore.ready_samples(), gamma=0.0, baseline="none", normalization="sum",
                       running=RunningMeans(), current_version=0, mix=RewardMix("opd", opd_coef=1.0))
    answer = next(d for d in pb.datums if d.turn_id == ids["answer"])
    assert list(answer.tokens[:3]) == [1, 2, 3]  # trained on the plain prompt
    # teacher -0.1 against the plain reference -0.9, not against the sampled -0.5
    assert list(answer.advantages[answer.prompt_len - 1:]) == pytest.approx([0.8] * 3)
    assert opd_advantages([-0.1], [-0.5], 1.0, reference=[-0.9]) == pytest.approx([0.8])
    with pytest.raises(ValueError, match="reference"):
        RewardStore(store).save_teacher_logprobs(ids["answer"], [-0.1] * 3, 3, reference=[-0.9] * 2)


def test_hinted_messages() -> None:
    msgs = [SYSTEM, user("a"), assistant("b"), {"role": "user", "content": [{"type": "text", "text": "c"}]}]
    out = hinted_messages(msgs, "be brief")
    assert out[1] == user("a") and out[3]["content"][-1] == {"type": "text", "text": "[Hint: be brief]"}
    assert msgs[3]["content"] == [{"type": "text", "text": "c"}]  # the caller's messages are untouched
    assert hinted_messages([SYSTEM], "x")[-1] == {"role": "user", "content": "[Hint: x]"}


def test_local_backend_scores_with_the_base_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Teacher logprobs of the local backend = the engine's own sampling logprobs at T=1 on the
    base weights, token for token; and they stay the base model's after weights are published."""
    from clawbridge_local.backend import LocalBackend
    from clawbridge_local.engine import TorchEngine

    settings = Settings.model_validate(dict(model=str(tiny_model_dir), state_dir=tmp_path,
                                            backends={"local": {"device": "cpu", "kv_dtype": "float32",
                                                                "max_running_requests": 1}}))
    backend = LocalBackend(settings, progress=False)

    async def main() -> tuple[list[int], list[float], list[list[float]], list[list[float]]]:
        await backend.start()
        try:
            as_object: object = backend
            assert isinstance(as_object, LogprobScorer)
            prompt = [5, 17, 42, 99, 7]
            stream = await backend.sampler().sample(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=3))
            toks = [t async for t in stream]
            ids, lps = [t.token_id for t in toks], [t.logprob for t in toks]
            before = await backend.compute_logprobs([prompt + ids, [1, 2, 3]], [len(prompt), 1])
            engine = backend.sampler()
            assert isinstance(engine, TorchEngine)

            def zero(model: Any) -> None:
                for p in model.parameters():
                    p.data.zero_()

            await engine.swap_weights(zero, 1)  # "trained" serving weights: the teacher must not change
            after = await backend.compute_logprobs([prompt + ids], [len(prompt)])
            return ids, lps, before, after
        finally:
            await backend.close()

    ids, lps, before, after = asyncio.run(main())
    assert len(before[0]) == len(ids) and len(before[1]) == 2
    assert before[0] == pytest.approx(lps, abs=1e-4)
    assert after[0] == pytest.approx(before[0], abs=1e-6)


def test_group_baseline_never_pays_a_later_turn_for_an_earlier_ones_verdict(tmp_path: Path) -> None:
    # The judge demo's shape through the store: two-turn sessions of one task, the first turn judged
    # (+1 accepted / -1 corrected; set through the API here), the last one without a reward. Grouped by place, the last
    # turns get advantage 0 (nothing judged them) and only the first turns are pushed.
    store = Store.open(tmp_path)
    firsts = {}
    for sid, verdict in (("a", 1.0), ("b", -1.0), ("c", -1.0), ("d", -1.0)):
        store.ensure_session(sid, "header", task_id="t")
        firsts[sid] = record(store, sid, [user("hi")], assistant("x"))
        record(store, sid, [user("hi"), assistant("x"), user("ok")], assistant("y"), prompt=(1, 2, 3, 4, 5, 6, 7))
        store.add_reward(sid, verdict, "api", firsts[sid])
        store.end_session(sid, "end_session")
    tstore = TrainingStore(store)
    tstore.ingest_ended()
    batch = tstore.ready_samples()
    assert len(batch) == 8
    pb = prepare_batch(tstore, batch, gamma=1.0, baseline="group_mean", normalization="sum",
                       running=RunningMeans(), current_version=0, mix=RewardMix("rl"), merge=False)
    advs = {d.turn_id: set(d.advantages[d.prompt_len - 1:]) for d in pb.datums}
    assert {advs[firsts[s]].pop() for s in "abcd"} == {1.5, -0.5}
    assert [a for tid, a in advs.items() if tid not in firsts.values()] == [{0.0}] * 4
