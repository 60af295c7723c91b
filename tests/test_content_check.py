"""The content check (`clawbridge.promotion.content`): a candidate's everyday answers, asked in the
agent's own latest context (its system prompt and its caller's notes), must still talk about their
question about as often as the serving version's and the anchor's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from clawbridge.chat.messages import ChatMessage
from clawbridge.config import Settings
from clawbridge.promotion.announce import promotion_line
from clawbridge.promotion.capability import PROBE_SOURCE
from clawbridge.promotion.content import CONTENT_SOURCE, AgentContext, agent_context, content_set, system_text
from clawbridge.promotion.describe import still_good_line
from clawbridge.promotion.everyday import EVERYDAY_MAX_TOKENS, EVERYDAY_QUESTIONS, IN_CONTEXT_SOURCE
from clawbridge.promotion.report import promotion_status
from clawbridge.promotion.runner import Evaluator, FakeEvaluator
from clawbridge.serving.sampler import FakeSampler, SamplingParams
from clawbridge.store import Store
from clawbridge.store.notes import NoteStore
from clawbridge.store.promotion import PromotionStore
from clawbridge.store.turns import TurnRecord
from clawbridge.store.users import UserStore
from tests.test_capability_probe import _decide, _promoter

SAM = "You are Claw, a helpful personal assistant running in OpenClaw. The user's name is Sam."


def _call(store: Store, session: str, user: str | None, request: dict[str, Any], turn_type: str = "main") -> str:
    now = store.clock.now()
    return store.record_turn(TurnRecord(session, turn_type, "ok", "m", [1, 2], [3], [-0.5], 0, "stop",
                                        json.dumps(request), None, now, now, user_id=user))


def _openai(system: str, question: str = "What should I cook tonight?") -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def test_the_set_is_the_everyday_questions_in_the_latest_calls_context_with_its_callers_notes(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    assert agent_context(store, unnamed_only=False, with_notes=True) is None  # no call yet: nothing to ask in
    UserStore(store).add("sam")
    first = _call(store, "s1", "sam", _openai("an older profile"))
    turn = _call(store, "s2", "sam", _openai(SAM))
    _call(store, "s2", "sam", _openai("the judge's prompt"), turn_type="side")  # side turns never give the context
    NoteStore(store).add("sam", "Call the user Sam.", turn, max_active=3)
    context = agent_context(store, unnamed_only=False, with_notes=True)
    assert context == AgentContext(turn, SAM, "Call the user Sam.") and turn != first
    es = content_set(context, "user")
    assert es.source == CONTENT_SOURCE and es.max_tokens == EVERYDAY_MAX_TOKENS
    assert [i.kind for i in es.items] == ["topic"] * 12 and [i.question for i in es.items] == list(EVERYDAY_QUESTIONS)
    for n, (item, question) in enumerate(zip(es.items, EVERYDAY_QUESTIONS, strict=True), start=1):
        assert item.id == f"{turn}/everyday-{n}"  # forgetting sam finds the answers given in his context
        assert [m.role for m in item.chat] == ["system", "user"] and item.chat[0].content == SAM
        assert item.chat[1].content == f"{question}\n\n[Hint: Call the user Sam.]"  # where his calls carry notes
    in_system = content_set(context, "system")
    assert in_system.items[0].chat[0].content.endswith("Call the user Sam.") and in_system.items[0].chat[1].content == \
        EVERYDAY_QUESTIONS[0]
    unnoted = agent_context(store, unnamed_only=False, with_notes=False)
    assert unnoted is not None and unnoted.notes == ""
    assert len({es.digest, in_system.digest, content_set(unnoted).digest}) == 3  # figures are cached per context
    # with per-user adapters sam's calls train his own adapter: only calls without a user give the shared one's context
    assert agent_context(store, unnamed_only=True, with_notes=True) is None
    shared = _call(store, "s3", None, {"model": "m", "system": [{"type": "text", "text": "An Anthropic profile."}],
                                       "messages": [{"role": "user", "content": "hi"}]})
    assert agent_context(store, unnamed_only=True, with_notes=True) == AgentContext(shared, "An Anthropic profile.", "")
    store.close()


def test_a_recorded_request_without_a_readable_system_prompt_gives_none() -> None:
    assert system_text("{not json") == "" and system_text("[1, 2]") == "" and system_text("{}") == ""
    assert system_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]})) == ""
    assert system_text(json.dumps({"messages": [{"role": "developer", "content": [
        {"type": "text", "text": "Be kind."}]}]})) == "Be kind."
    bare = content_set(AgentContext("turn_x", "", ""))
    assert [m.role for m in bare.items[0].chat] == ["user"] and bare.items[0].chat[0].content == EVERYDAY_QUESTIONS[0]


class _Bytes:
    """A `ChatFormat` stand-in: a chat renders to its text's bytes; 0 stops."""

    stop_token_ids = (0,)

    def render(self, messages: Sequence[ChatMessage], **_: Any) -> list[int]:
        return list("\n".join(f"{m.role}: {m.content}" for m in messages).encode())

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode()


class _Talker:
    """A sampler whose answer is `answer(prompt text)`, then the stop token."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> Any:
        said = [*self.answer(bytes(prompt_ids).decode()).encode(), 0]
        return await FakeSampler(script=said[: params.max_tokens]).sample(prompt_ids, params)


class _Router:
    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    async def sampler_for(self, version: int, by: object = None, use: str = "evaluate") -> Any:
        return self.sampler


def test_an_answer_passes_when_it_talks_about_its_question_not_about_the_note_or_itself() -> None:
    context = AgentContext("turn_x", SAM, "Call the user Sam.")
    es = content_set(context)

    def answer(prompt: str) -> str:  # on topic for the questions about bread and ties, else about itself
        if "bread" in prompt:
            return "Keep the bread in a paper bag, Sam."
        if "tie a tie" in prompt:
            return "Sam, cross the wide end of the tie over the narrow one."
        return "I'm Sam, your personal assistant."  # the prompt's note and profile name Sam: still off topic

    ev = Evaluator(_Router(_Talker(answer)), _Bytes())  # type: ignore[arg-type]
    result = asyncio.run(ev.evaluate(3, es))
    assert (result.passed, result.items) == (2, 12) and result.score == pytest.approx(2 / 12)
    assert "turn_x/everyday-1" in result.failed and "I'm Sam, your personal assistant." in result.failed_answers


def _with_a_call(tmp_path: Path, settings: Settings, fake: FakeEvaluator, pinned: bool = True) -> tuple[Any, Store]:
    promoter, store = _promoter(tmp_path, settings, fake)
    promoter.pinned = pinned  # a backend that serves two versions at once (the local engine, Tinker)
    _call(store, "s1", None, _openai(SAM))
    return promoter, store


def test_a_candidate_whose_answers_in_the_agents_context_stopped_answering_is_rejected_though_every_other_check_holds(
        tmp_path: Path) -> None:
    # what SmolLM2 taught Sam's name showed: facts kept, the gate's own profile's answers kept, and
    # under Sam's profile 10 of 12 everyday answers on topic fell to 6
    fake = FakeEvaluator({}, by_set={PROBE_SOURCE: {0: 30, 1: 30, 2: 30, 3: 30},
                                     CONTENT_SOURCE: {0: 10, 1: 9, 2: 8, 3: 10}})
    promoter, store = _with_a_call(tmp_path, Settings(), fake)
    first = _decide(promoter, 1)  # one fewer than the anchor: within the slack
    assert first.verdict == "promoted" and promoter.serving == 1
    assert [c["source"] for c in first.figures["checks"]] == [PROBE_SOURCE, CONTENT_SOURCE]
    second = _decide(promoter, 2)  # two fewer than the anchor v0
    assert second.verdict == "rejected" and promoter.serving == 1
    assert second.reason.startswith("score 0.667 (8/12 passed) < anchor v0's 0.833"), second.reason
    assert CONTENT_SOURCE in second.reason and PROBE_SOURCE not in second.reason
    assert "failed: everyday-9" in second.reason and "turn_" not in second.reason  # no caller's turn id in words
    assert _decide(promoter, 3).verdict == "promoted"
    content = promotion_status(promoter)["capability_probe"]["content"]
    assert content == {"items": 12, "slack_items": 1, "serving": 10, "anchor_version": 0, "anchor": 10}
    line = still_good_line(promotion_status(promoter))
    assert line is not None and line.endswith("on topic in the agent's context: 10 of 12 everyday answers (anchor v0: 10)")
    store.close()


def test_the_check_is_off_when_turned_off_where_the_anchor_knows_no_fact_and_on_one_version_backends(tmp_path: Path) -> None:
    said = "its everyday answers in the agent's own context still talk about the question within 1 item(s)"
    assert said in promotion_line(Settings(), scores=True) and said in promotion_line(Settings(), scores=False)
    assert "agent's own context" not in promotion_line(Settings(content_check=False), scores=True)
    fake = FakeEvaluator({}, by_set={PROBE_SOURCE: {0: 30, 1: 30}, CONTENT_SOURCE: {0: 10, 1: 0}})
    promoter, store = _with_a_call(tmp_path / "off", Settings(content_check=False), fake)
    assert _decide(promoter, 1).verdict == "promoted"
    assert CONTENT_SOURCE not in {s for _, s in fake.asked}
    assert promotion_status(promoter)["capability_probe"]["content"] is None
    store.close()
    # a backend that serves one version at a time could not answer a new context with the serving version
    one = FakeEvaluator({}, by_set={PROBE_SOURCE: {0: 30, 1: 30}, CONTENT_SOURCE: {0: 10, 1: 0}})
    promoter, store = _with_a_call(tmp_path / "one", Settings(), one, pinned=False)
    assert _decide(promoter, 1).verdict == "promoted" and CONTENT_SOURCE not in {s for _, s in one.asked}
    store.close()
    # a random tiny model: nothing on the probe, so nothing to keep (as with the likelihood guards)
    blank = FakeEvaluator({}, by_set={PROBE_SOURCE: {0: 0, 1: 0}, CONTENT_SOURCE: {0: 10, 1: 0}})
    promoter, store = _with_a_call(tmp_path / "blank", Settings(), blank)
    assert _decide(promoter, 1).verdict == "promoted"
    assert CONTENT_SOURCE not in {s for _, s in blank.asked} and IN_CONTEXT_SOURCE not in {s for _, s in blank.asked}
    store.close()


def test_forgetting_the_user_whose_call_gave_the_context_takes_the_answers_given_in_it_out_of_every_figure(
        tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    users = UserStore(store)
    users.add("sam")
    users.add("bob")
    sam = _call(store, "sam:s", "sam", _openai(SAM))
    bob = _call(store, "bob:s", "bob", _openai("You help Bob."))
    promotion = PromotionStore(store)
    promotion.save_eval(2, "content-sam", {"items": 12, "passed": 10, "failed": [f"{sam}/everyday-4", f"{sam}/everyday-9"],
                                           "failed_answers": ["I'm Sam, your personal assistant-7c1d.", "Hello Sam-7c1d."]})
    promotion.save_eval(2, "content-bob", {"items": 12, "passed": 11, "failed": [f"{bob}/everyday-4"],
                                           "failed_answers": ["Bob, hello."]})
    report = users.forget("sam")
    assert report.deleted["promotion_figures"] == 1
    figures = {digest: f for _, digest, f in promotion.evals()}
    assert figures["content-sam"]["failed"] == [] and figures["content-sam"]["failed_answers"] == []
    assert figures["content-sam"]["passed"] == 10  # counts stay: numbers, not his text
    assert figures["content-bob"]["failed"] == [f"{bob}/everyday-4"]
    store.close()
