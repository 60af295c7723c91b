"""Rewards from conversation: next states, judge parsing and voting against a scripted
OpenAI-compatible endpoint, storage, restart, and the serving bound."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from clawbridge.devtools.judge_server import JudgeServer
from clawbridge.rewards.judge import (
    JudgementFailedWithVotes,
    OpenAIJudge,
    ScriptedJudge,
    VoteConfig,
    judge_messages,
    judge_turn,
    majority,
    parse_vote,
    same_note,
)
from clawbridge.rewards.next_state import extract_next_states, turn_view
from clawbridge.rewards.worker import RewardWorker, WorkerConfig
from clawbridge.runtime.clock import FakeClock
from clawbridge.store import Store
from clawbridge.store.rewards import RewardStore
from tests.rewards_support import SYSTEM, assistant, call, openclaw_session, record, tool, user


def views(store: Store, sid: str) -> list[Any]:
    return [turn_view(t.turn_id, t.seq, t.turn_type, t.request, t.response, t.api)
            for t in RewardStore(store).transcript(sid)]


# ------------------------------------------------------------------ next state


def test_next_state_openclaw_transcript(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    ids = openclaw_session(store, "s1")
    states = extract_next_states(views(store, "s1"))
    # the tool-calling turn: BOTH tool results, in order, across a side turn in between
    assert states[ids["tools"]].kind == "tool"
    assert [m["tool_call_id"] for m in states[ids["tools"]].messages] == ["call_ls", "call_cat"]
    assert states[ids["tools"]].from_turn_id == ids["answer"]
    # the answer: the user's correction
    assert states[ids["answer"]].kind == "user"
    assert states[ids["answer"]].messages == [user("No, I only wanted the .txt files, sorted by name.")]
    # the last main turn has no next state; side turns never get one
    assert ids["fixed"] not in states and ids["title"] not in states and ids["memory"] not in states


def test_next_state_tool_results_then_user_and_edited_history(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    a1 = assistant("", [call("c1", "exec", {"cmd": "make"})])
    t1 = record(store, "s", [SYSTEM, user("build it")], a1)
    # next request: history compacted (a summary replaces the system prompt), tool result AND a user nudge
    t2 = record(store, "s", [user("[summary] user wants a build"), a1, tool("c1", "error: missing target"),
                             user("hurry up")], assistant("retrying"))
    states = extract_next_states(views(store, "s"))
    assert states[t1].kind == "tool+user"
    assert [m["role"] for m in states[t1].messages] == ["tool", "user"]
    assert t2 not in states


def test_next_state_anthropic_shape(tmp_path: Path) -> None:
    import json
    import time

    from clawbridge.store import TurnRecord

    store = Store.open(tmp_path)
    now = time.time()

    def rec(messages: list[dict[str, Any]], content: list[dict[str, Any]]) -> str:
        body = {"model": "tiny", "max_tokens": 64, "messages": messages}
        return store.record_turn(TurnRecord(
            session_id="a", turn_type="main", status="ok", model="tiny", prompt_token_ids=[1],
            completion_token_ids=[2], completion_logprobs=[-1.0], policy_version=0, finish_reason="stop",
            request_json=json.dumps(body), response_json=json.dumps({"type": "message", "content": content}),
            created_at=now, completed_at=now, meta={"api": "anthropic"}), "header")

    use = [{"type": "tool_use", "id": "tu1", "name": "exec", "input": {"cmd": "ls"}}]
    t1 = rec([{"role": "user", "content": "ls please"}], use)
    rec([{"role": "user", "content": "ls please"}, {"role": "assistant", "content": use},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": "a b"}]}],
        [{"type": "text", "text": "a and b"}])
    states = extract_next_states(views(store, "a"))
    assert states[t1].kind == "tool" and "a b" in str(states[t1].messages[0]["content"])


# ------------------------------------------------------------------ parsing and voting


@pytest.mark.parametrize(("text", "score", "hint"), [
    ("Accepted.\nHINT: none\nSCORE: +1", 1, None),
    ("reason\nscore = -1", -1, None),
    ("**SCORE:** 0", 0, None),
    ("The answer is \\boxed{1}", 1, None),
    ("SCORE: 1 ... wait, actually SCORE: -1", -1, None),
    ("SCORE: 5", None, None),
    ("I think it went fine.", None, None),
    ("User wanted French.\nHINT: Answer in French, not English.\nSCORE: -1", -1, "Answer in French, not English."),
    ("HINT: n/a\nSCORE: 0", 0, None),
])
def test_parse_vote(text: str, score: int | None, hint: str | None) -> None:
    assert parse_vote(text) == (score, hint)


def test_same_note_is_the_number_most_votes_name_and_only_a_listed_one() -> None:
    from clawbridge.store.rewards import VoteRow

    def votes(*texts: str | None) -> list[VoteRow]:
        return [VoteRow(i, -1, None, t, None) for i, t in enumerate(texts)]

    assert same_note(votes("HINT: x\nSAME: 2\nSCORE: -1", "SAME: 2", "SAME: 1"), 3) == 2
    assert same_note(votes("SAME: 1", "SAME: 2", None), 3) == 1  # a tie: the lowest
    assert same_note(votes("SAME: 4", "SAME: 0", "same = [2]"), 3) == 2  # 4 and 0 are not listed
    assert same_note(votes("SAME: 1"), 0) is None  # no notes were listed
    assert same_note(votes("HINT: the same as before\nSCORE: -1", "SAME: none"), 2) is None


@pytest.mark.parametrize(("votes", "verdict"), [
    ([1, 1, -1], 1), ([-1, -1, 1], -1), ([1, -1, 0], 0), ([1, None, None], 0), ([1, 1, None], 1),
    ([1, -1], 0), ([None, None, None], 0), ([-1, None, 1, 1], 1),
])
def test_majority(votes: list[int | None], verdict: int) -> None:
    assert majority(votes) == verdict


SEED = 100


def scripted(answers: list[str | Exception]) -> JudgeServer:
    """A judge endpoint answering vote i (its request's seed is SEED + i) with answers[i % n].

    Votes are sent concurrently, so the answer goes by the vote's seed, not by arrival order."""

    def answer(body: dict[str, Any]) -> str:
        a = answers[(int(body["seed"]) - SEED) % len(answers)]
        if isinstance(a, Exception):
            raise a
        return a

    return JudgeServer(answer, model="scripted", api_key="judge-secret-key")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_judge_over_http_votes_ties_and_failures() -> None:
    msgs = judge_messages("do x", assistant("did x"), [user("thanks!")])
    cfg = VoteConfig(votes=3, retries=0)

    async def verdict(server: JudgeServer) -> Any:
        judge = OpenAIJudge(server.base_url, "scripted", "judge-secret-key")
        try:
            return await judge_turn(judge, msgs, cfg, seed=SEED)
        finally:
            await judge.aclose()

    with scripted(["ok\nSCORE: +1", "SCORE: -1", "no idea"]) as server:  # +1, -1, failed(0): tie -> 0
        v = run(verdict(server))
        assert v.score == 0 and [x.score for x in v.votes] == [1, -1, None]
        assert v.votes[2].error == "no parseable SCORE line" and v.votes[2].text == "no idea"
        assert server.requests[0]["messages"] == msgs and server.requests[0]["temperature"] == cfg.temperature
    with scripted(["SCORE: -1\nHINT: use French", "SCORE: -1\nHINT: the user wants French output", "SCORE: 1"]) as s:
        v = run(verdict(s))
        assert v.score == -1 and v.hint == "the user wants French output" and v.mean_vote == pytest.approx(-1 / 3)
    with scripted(["SCORE: 1", RuntimeError("boom"), "SCORE: 1"]) as s:  # a 500 is a failed vote
        v = run(verdict(s))
        assert v.score == 1 and v.votes[1].error is not None and "500" in v.votes[1].error
    with scripted([RuntimeError("down")]) as s, pytest.raises(JudgementFailedWithVotes):
        run(verdict(s))
    with scripted(["SCORE: 1"]) as s:  # wrong key: every vote fails
        judge = OpenAIJudge(s.base_url, "scripted", "wrong-key")
        with pytest.raises(JudgementFailedWithVotes, match="401"):
            run(judge_turn(judge, msgs, cfg, seed=SEED))


# ------------------------------------------------------------------ worker: storage, restart, bound


def by_turn(answers: dict[str, str]) -> Any:
    """A judge answer chosen by what the prompt's next state contains."""
    def pick(messages: list[dict[str, Any]]) -> str:
        text = messages[-1]["content"]
        return next(a for key, a in answers.items() if key in text)
    return pick


OPENCLAW_ANSWERS = {"[tool result": "tools ran\nHINT: none\nSCORE: +1",
                    "[user] No,": "corrected\nHINT: only .txt files, sorted by name\nSCORE: -1"}


def test_worker_stores_votes_verdicts_hints_and_rewards(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    ids = openclaw_session(store, "s1")
    judge = ScriptedJudge(by_turn(OPENCLAW_ANSWERS))
    worker = RewardWorker(store, judge, WorkerConfig(votes=VoteConfig(votes=3)))
    assert run(worker.run_once()) == 1
    rs = RewardStore(store)
    assert rs.session_done("s1") and len(judge.calls) == 6  # 2 turns x 3 votes
    sig = rs.turn_signals(ids.values())
    assert sig[ids["tools"]].judge_score == 1 and sig[ids["answer"]].judge_score == -1
    assert ids["fixed"] not in sig and ids["title"] not in sig
    votes = rs.votes(ids["answer"])
    assert len(votes) == 3 and all(v.text and "corrected" in v.text for _, v in votes)
    assert rs.hints("s1") == {ids["answer"]: "only .txt files, sorted by name"}
    judged = [r for r in store.session_rewards("s1") if r.source == "judge"]
    assert sorted((r.turn_id, r.value) for r in judged) == sorted([(ids["tools"], 1.0), (ids["answer"], -1.0)])
    assert run(worker.run_once()) == 0 and len(judge.calls) == 6  # nothing judged twice
    assert rs.next_states("s1")[ids["tools"]][0] == "tool"


def test_restart_judged_once_interrupted_judged_again(tmp_path: Path) -> None:
    db = tmp_path / "clawbridge.db"
    store = Store(db)
    done_ids = openclaw_session(store, "done")
    first = ScriptedJudge(by_turn(OPENCLAW_ANSWERS))
    assert run(RewardWorker(store, first, WorkerConfig()).run_once()) == 1
    calls_before = len(first.calls)

    t1 = record(store, "cut", [SYSTEM, user("say hi")], assistant("hi"))
    record(store, "cut", [SYSTEM, user("say hi"), assistant("hi"), user("great, thanks")], assistant(":)"))
    store.end_session("cut", "end_session")
    started = threading.Event()

    class Hanging:
        name = "hanging"

        async def complete(self, messages: list[dict[str, Any]], **kw: Any) -> str:
            started.set()
            await asyncio.Event().wait()  # never answers: the process "dies" here
            return ""

    async def interrupted() -> None:
        w = RewardWorker(store, Hanging(), WorkerConfig())
        await w.start()
        while not started.is_set():
            await asyncio.sleep(0.01)
        task = w.background.task
        assert task is not None
        task.cancel()  # like kill -9: no cleanup code of ours runs after this point in the store
        with pytest.raises(asyncio.CancelledError):
            await task

    run(interrupted())
    assert RewardStore(store).judgement_states([t1]) == {t1: ("running", 1)}
    store.close()

    store2 = Store(db)  # the restarted process
    second = ScriptedJudge(["fine\nSCORE: +1"])
    w2 = RewardWorker(store2, second, WorkerConfig())
    assert run(w2.run_once()) == 1
    rs = RewardStore(store2)
    assert rs.judgement_states([t1]) == {t1: ("done", 2)}
    assert len(second.calls) == 3  # only the interrupted turn: the finished session is not judged again
    assert all("say hi" in c[-1]["content"] for c in second.calls)
    assert len(first.calls) == calls_before
    assert rs.turn_signals([t1])[t1].judge_score == 1
    assert rs.judgement_states(done_ids.values())[done_ids["tools"]] == ("done", 1)


def test_all_votes_failing_is_retried_then_given_up(tmp_path: Path) -> None:
    clock = FakeClock()
    store = Store.open(tmp_path, clock)
    t1 = record(store, "s", [user("q")], assistant("a"))
    record(store, "s", [user("q"), assistant("a"), user("ok thanks")], assistant("b"))
    store.end_session("s", "end_session")
    judge = ScriptedJudge([RuntimeError("endpoint down")])
    w = RewardWorker(store, judge, WorkerConfig(votes=VoteConfig(votes=2, retries=1, backoff_s=0.0),
                                                max_attempts=2, retry_backoff_s=30.0))
    rs = RewardStore(store)
    assert run(w.run_once()) == 0 and not rs.session_done("s")  # failed: no silent 0 verdict
    assert rs.judgement_states([t1]) == {t1: ("failed", 1)}
    assert len(judge.calls) == 4  # 2 votes x (1 + 1 retry)
    assert run(w.run_once()) == 0 and len(judge.calls) == 4  # backing off (30 s x 2^1) on the store's clock
    clock.advance(60.0)
    assert run(w.run_once()) == 1  # attempt 2 fails too -> given up, the session finishes
    assert rs.judgement_states([t1]) == {t1: ("failed", 2)} and rs.session_done("s")
    assert rs.turn_signals([t1]) == {} and [r for r in store.session_rewards("s") if r.source == "judge"] == []
    assert all(v.error for _, v in rs.votes(t1))


def test_judge_concurrency_bound(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    for i in range(4):
        sid = f"s{i}"
        h: list[dict[str, Any]] = [user("start")]
        for k in range(3):
            a = assistant(f"step {k}")
            record(store, sid, h, a)
            h = [*h, a, user(f"thanks {k}")]
        store.end_session(sid, "end_session")

    class Slow:
        name = "slow"

        async def complete(self, messages: list[dict[str, Any]], **kw: Any) -> str:
            await asyncio.sleep(0.01)
            return "SCORE: 1"

    w = RewardWorker(store, Slow(), WorkerConfig(concurrency=2, votes=VoteConfig(votes=3)))
    assert run(w.run_once()) == 4
    assert w.in_flight_max == 2  # 24 votes went through, never more than 2 at once
