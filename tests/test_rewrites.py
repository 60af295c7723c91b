"""Corrections as demonstrations: the judge's `REWRITE:` of a corrected answer, from the vote text
to the datum the trainer sends (`clawbridge.rewards.rewrites`, `advantages` rule 6)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from clawbridge.backend import FakeLogprobScorer
from clawbridge.chat.render import Renderer
from clawbridge.devtools.judge_server import rule_based_answer, rule_based_rewrite
from clawbridge.devtools.personas import PERSONAS
from clawbridge.rewards.judge import (
    MAX_REWRITE_CHARS,
    ScriptedJudge,
    best_rewrite,
    judge_messages,
    parse_rewrite,
    parse_vote,
)
from clawbridge.rewards.worker import RewardWorker, WorkerConfig
from clawbridge.store import Store
from clawbridge.store.rewards import RewardStore, VoteRow
from clawbridge.store.training import TrainingStore
from clawbridge.trainer.advantages import RewardMix, RunningMeans
from clawbridge.trainer.datums import prepare_batch
from tests.rewards_support import SYSTEM, assistant, call, record, user

ANSWERS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, which was built in 1889 for the "
    "World's Fair. Paris is also famous for its museums, including the Louvre.",
    "Water boils at 100 degrees Celsius at sea level.\nAt higher altitudes the air pressure is lower, so it "
    "boils at a lower temperature. In the mountains, cooking pasta takes longer for that reason.",
    "Sure! Here is what you need to know:\n\n1. **Exercise** helps the heart.\n2. Sleep helps memory and "
    "mood, and most adults need seven to nine hours a night.\n3. Water keeps you going.",
]


def test_a_votes_rewrite_is_read_and_only_a_correction_keeps_one() -> None:
    text = "The user wanted it short.\nHINT: be brief\nREWRITE:\nParis.\n\nIt is the capital.\nSCORE: -1"
    assert parse_rewrite(text) == "Paris.\n\nIt is the capital."
    assert parse_rewrite("HINT: x\nREWRITE: Sam, hi.\nEND REWRITE\nnoise\nSCORE: -1") == "Sam, hi."
    assert parse_rewrite("HINT: x\nREWRITE: Sam, hi.\nSAME: 1\nSCORE: -1") == "Sam, hi."
    assert parse_rewrite("HINT: x\nREWRITE: none\nSCORE: -1") is None
    # after the SCORE line, as the prompt asks: a vote cut by max_tokens keeps its score, drops its rewrite
    assert parse_rewrite("HINT: x\nSCORE: -1\nREWRITE:\nSam, hi.\nEND REWRITE") == "Sam, hi."
    cut = "HINT: be brief\nSCORE: -1\nREWRITE:\nSam, the capital of Fra"
    assert parse_rewrite(cut) is None and parse_vote(cut) == (-1, "be brief")
    assert parse_rewrite("SCORE: -1") is None
    assert parse_rewrite(f"REWRITE: {'a' * (MAX_REWRITE_CHARS + 1)}\nSCORE: -1") is None

    def vote(i: int, score: int | None, rewrite: str | None) -> VoteRow:
        body = f"REWRITE: {rewrite}\n" if rewrite else ""
        return VoteRow(i, score, None, f"{body}SCORE: {score}" if score is not None else body)

    votes = [vote(0, 1, "from a +1 vote"), vote(1, -1, None), vote(2, -1, "the first -1"), vote(3, -1, "later")]
    assert best_rewrite(votes, -1) == "the first -1"  # the first among the votes that gave the verdict
    assert best_rewrite(votes, 1) is None  # only a correction (-1) has a rewrite
    assert best_rewrite(votes, 0) is None


@pytest.mark.parametrize("key", ["brief", "name", "lead", "plain"])
def test_the_rule_based_judge_rewrites_a_correction_the_way_the_words_ask(key: str) -> None:
    """The judge sees only the answer and the user's words, never the persona's rule; its rewrite
    meets that rule for every complaint of the persona (on answers that miss it)."""
    persona = PERSONAS[key]
    checked = 0
    for answer in ANSWERS:
        if persona.meets(answer):
            continue
        for complaint in persona.complaints:
            msgs = judge_messages("Tell me about it.", assistant(answer), [user(complaint)])
            text = rule_based_answer({"messages": msgs})
            rewrite = parse_rewrite(text)
            assert rewrite is not None and persona.meets(rewrite), (complaint, text)
            assert "SCORE: -1" in text
            checked += 1
    assert checked >= 4
    # a tool call is no answer to rewrite; thanks are no correction
    assert rule_based_rewrite("TOOL CALL exec({})", persona.complaints[0]) is None
    thanks = rule_based_answer({"messages": judge_messages("q", assistant(ANSWERS[0]), [user("Thanks!")])})
    assert parse_rewrite(thanks) is None


REWRITE = "Only notes.txt.\n\nIt is the one .txt file."


def _session(store: Store, stop: int, noted: bool = False) -> dict[str, str]:
    """A tool-call turn corrected, a text answer corrected, then a last turn; ended."""
    task = user("List the files in /tmp")
    a1 = assistant("Let me look.", [call("c1", "exec", {"cmd": "ls /tmp"})])
    ids = {"tools": record(store, "s1", [SYSTEM, task], a1)}
    h2 = [SYSTEM, task, a1, {"role": "tool", "tool_call_id": "c1", "content": "Error: not found"}]
    a2 = assistant("/tmp has notes.txt, a.log and more files that I could list for you.")
    ids["answer"] = record(store, "s1", h2, a2, prompt=(1, 2, 3, 99) if noted else (1, 2, 3),
                           completion=(4, 5, stop), train_prompt=(1, 2, 3) if noted else None)
    h3 = [*h2, a2, user("No, keep it short: only the .txt files.")]
    ids["last"] = record(store, "s1", h3, assistant("notes.txt"))
    store.end_session("s1", "end_session")
    return ids


def _judge(messages: list[dict[str, Any]]) -> str:
    # a judge that rewrites every correction, the tool-call turn's included (the worker must not keep that one)
    return f"HINT: only the .txt files\nSCORE: -1\nREWRITE:\n{REWRITE}\nEND REWRITE"


@pytest.mark.parametrize("noted", [False, True])
def test_the_worker_keeps_a_corrections_rewrite_as_ids_scored_by_the_base_model(
        tmp_path: Path, tiny_model_dir: Path, noted: bool) -> None:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    stop = renderer.stop_token_ids[0]
    store = Store.open(tmp_path)
    ids = _session(store, stop, noted)
    scorer = FakeLogprobScorer(lambda toks, i: -0.25)
    w = RewardWorker(store, ScriptedJudge(_judge), WorkerConfig(opd=False, rewrites=True), renderer=renderer,
                     scorer=scorer)
    assert asyncio.run(w.run_once()) == 1
    want = [*renderer.encode(REWRITE), stop]  # the recorded answer ended with the stop token: so does this
    assert scorer.calls == [([1, 2, 3, *want], 3)]  # on the prompt it trains on: never the noted one
    sig = RewardStore(store).turn_signals([ids["answer"], ids["tools"]])
    assert sig[ids["answer"]].rewrite_ids == want and sig[ids["answer"]].rewrite_logprobs == [-0.25] * len(want)
    assert sig[ids["tools"]].rewrite_ids is None  # a rewrite of a tool call is no demonstration
    assert RewardStore(store).stats()["rewrites"] == 1

    tstore = TrainingStore(store, wait_for_judge=True)
    tstore.ingest_ended()
    batch = tstore.ready_samples()
    pb = prepare_batch(tstore, batch, gamma=0.0, baseline="none", normalization="token_mean",
                       running=RunningMeans(), current_version=0, mix=RewardMix("rl", rewrite_coef=2.0))
    demo = pb.datums[-1]
    assert demo.turn_id == ids["answer"] and list(demo.tokens) == [1, 2, 3, *want]
    sampled = sum(len(tstore.turn_tokens([s.turn_id])[s.turn_id].completion_ids) for s in batch)
    n = len(want)
    assert list(demo.advantages[2:]) == pytest.approx([2.0 / (sampled + n)] * n)  # counted as one more turn
    assert list(demo.sampler_logprobs[2:]) == [-0.25] * n and list(demo.mask[2:]) == [1.0] * n
    assert pb.metrics["rewrite_datums"] == 1 and pb.metrics["rewrite_tokens"] == n
    answer = next(d for d in pb.datums[:-1] if d.turn_id == ids["answer"])
    assert answer.advantages[-1] < 0  # the recorded turn trains as before, on its own verdict
    off = prepare_batch(tstore, batch, gamma=0.0, baseline="none", normalization="token_mean",
                        running=RunningMeans(), current_version=0, mix=RewardMix("rl", rewrite_coef=0.0))
    assert len(off.datums) == len(pb.datums) - 1 and off.metrics["rewrite_datums"] == 0


def test_with_rewrite_coef_zero_no_rewrite_is_kept_and_a_bad_save_is_refused(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    store = Store.open(tmp_path)
    ids = _session(store, renderer.stop_token_ids[0])
    scorer = FakeLogprobScorer()
    w = RewardWorker(store, ScriptedJudge(_judge), WorkerConfig(opd=False, rewrites=False), renderer=renderer,
                     scorer=scorer)
    assert asyncio.run(w.run_once()) == 1
    assert scorer.calls == [] and RewardStore(store).stats()["rewrites"] == 0
    with pytest.raises(ValueError, match="no unscored rewrite"):
        RewardStore(store).save_rewrite_tokens(ids["answer"], [1], [-0.1])
    with pytest.raises(ValueError, match="one logprob each"):
        RewardStore(store).save_rewrite_tokens(ids["answer"], [1, 2], [-0.1])


def test_a_demonstration_scored_by_the_base_trains_on_real_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    """On the local backend with LoRA: the base model's logprobs of a never-sampled rewrite are the
    trainer's own at v0 (ratio 1 on the first update), and training it makes it likelier."""
    pytest.importorskip("torch")
    pytest.importorskip("clawbridge_local")
    from clawbridge.backend import Datum, LossConfig
    from tests.test_updates_per_step import lora_backend

    prompt, rewrite = [11, 42, 7, 300, 5, 99, 1000, 3], [17, 250, 64, 901, 33, 8]
    backend = lora_backend(tiny_model_dir, tmp_path)

    async def go() -> list[float]:
        await backend.start()
        try:
            [base] = await backend.compute_logprobs([prompt + rewrite], [len(prompt)])
            datum = Datum.from_turn(prompt, rewrite, base, [1.0] * len(rewrite), policy_version=0, turn_id="t0")
            return [(await backend.train_step([datum], LossConfig("cispo"))).metrics["ratio_mean"] for _ in range(3)]
        finally:
            await backend.close()

    ratios = asyncio.run(go())
    assert ratios[0] == pytest.approx(1.0, abs=1e-3)
    assert ratios[2] > ratios[1] > 1.0  # the policy puts more on the rewrite with each update


def test_the_judge_is_asked_for_a_rewrite_only_when_rewrites_train() -> None:
    from clawbridge.rewards.judge import REWRITE_PROMPT

    plain = judge_messages("q", assistant("a"), [user("No, shorter.")])
    asked = judge_messages("q", assistant("a"), [user("No, shorter.")], rewrite=True)
    assert REWRITE_PROMPT not in plain[0]["content"] and asked[0]["content"].endswith(REWRITE_PROMPT)
    assert plain[1] == asked[1]


def test_status_prints_a_steps_rewrites_only_when_it_trained_some() -> None:
    import io

    from rich.console import Console

    from clawbridge.cli.status import print_trainer

    def printed(metrics: dict[str, float]) -> str:
        out = io.StringIO()
        step = {"step": 3, "status": "ok", "policy_version": 3, "metrics": {"loss": 0.5, **metrics}}
        print_trainer(Console(file=out, width=200), {"samples": {"pending": 0, "consumed": 8, "dropped": {}},
                                                     "steps": {"ok": 3, "failed": 0}, "recent_steps": [step]})
        return out.getvalue()

    assert "rewrite_datums 2" in printed({"rewrite_datums": 2.0})
    assert "rewrite_datums" not in printed({"rewrite_datums": 0.0}) and "loss 0.5" in printed({})


def test_forgetting_a_user_deletes_her_rewrites_to_the_last_byte(tmp_path: Path) -> None:
    from clawbridge.store.users import UserStore
    from tests.test_users import _turn, raw_bytes

    store = Store.open(tmp_path)
    users, rstore = UserStore(store), RewardStore(store)
    for name in ("alice", "bob"):
        users.add(name)
        store.record_turn(_turn(f"{name}:s", name, f"{name} asks"), end_reason="end_session")
        tid = store.last_turn_id(f"{name}:s")
        attempt = rstore.begin_judgement(tid, f"{name}:s", "judge")
        rstore.finish_judgement(tid, attempt, [], -1.0, -1.0, "shorter", f"{name}'s rewrite zq7x")
        rstore.save_rewrite_tokens(tid, [5, 6], [-0.1, -0.2])
    report = users.forget("alice")
    assert report.deleted["rewrites"] == 1 and rstore.stats()["rewrites"] == 1
    store.close()
    data = raw_bytes(tmp_path)
    assert b"alice's rewrite zq7x" not in data and b"bob's rewrite zq7x" in data


@pytest.mark.parametrize("answer", [
    "What makes a good cup of coffee? Fresh beans and clean water. Grind them just before you brew.",
    "Sure! Birds fly south to find food. They come back in spring.",
])
def test_the_lead_rewrite_puts_an_answer_first_not_the_question_or_a_word(answer: str) -> None:
    """The question repeated, or "Sure!", is no one-line answer: the rewrite starts at the first
    statement, so what the judge offers as the better answer meets Ana's rule."""
    rewrite = rule_based_rewrite(answer, "Put a one-sentence answer on the first line, details after.")
    assert rewrite is not None and rewrite.splitlines()[0] in answer and PERSONAS["lead"].meets(rewrite), rewrite
