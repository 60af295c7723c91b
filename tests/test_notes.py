"""Notes from talk: a correction's hint is carried by the same user's next calls at once.

The real app (uvicorn, SQLite, the tiny model's tokenizer) over a scripted sampler, the real
`openai` SDK as the client, and the rule-based judge endpoint reading what the user said next.
Asserted on what the store recorded: the prompt the model saw carries the note, the prompt the turn
trains on does not, the client's request is its own; another user's calls, side turns, `NAME@N` and
`X-Clawbridge-Notes: off` calls carry nothing; a deleted note is gone from the next call; check
sessions retire notes once the weights carry them. (Learning with notes through `clawbridge up`:
`bench/learn_from_talk.py`.)
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clawbridge.chat.render import Renderer
from clawbridge.devtools.judge_server import HintStyle, JudgeServer, instruction_hint, rule_based
from clawbridge.rewards.notes import NoteBook, NotesConfig, is_check_session
from clawbridge.serving.sampler import FakeSampler
from clawbridge.store import Store, TurnRecord
from clawbridge.store.notes import Note, NoteStore
from tests.fake_proxy import script_for, start_fake_proxy
from tests.support import wait_for

COMPLAINT = "You didn't use my name. Please call me Sam."


def test_note_store_counts_the_same_correction_once_and_keeps_the_newest(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    notes = NoteStore(store)
    first, new = notes.add("", "Too long. Keep it short.", "t1", max_active=2)
    assert new and first.corrections == 1
    again, new = notes.add("", "too long.  keep it short", "t2", max_active=2)
    assert not new and again.note_id == first.note_id and again.corrections == 2
    notes.add("", "Call me Sam.", "t3", max_active=2)
    notes.add("", "No lists.", "t4", max_active=2)  # a third: the oldest retires
    active = NoteStore(store).active()[""]
    assert [n.text for n in active] == ["Call me Sam.", "No lists."]
    assert notes.get(first.note_id).status == "retired"  # type: ignore[union-attr]
    assert notes.add("bob", "x" * 1000, None, 3)[0].text.endswith("…")  # a long one is cut
    assert set(notes.active()) == {"", "bob"}
    assert notes.count_on(active[0].note_id, "bob") is None  # another user's note: not counted for bob
    assert notes.count_on(first.note_id, "") is None  # a retired note is not counted on
    assert notes.count_on(active[0].note_id, "").corrections == 2  # type: ignore[union-attr]
    assert notes.delete(first.note_id, user="bob") is False  # not bob's
    assert notes.delete(first.note_id) is True and notes.get(first.note_id) is None
    store.close()


def _turns(state_dir: Path) -> list[sqlite3.Row]:
    db = sqlite3.connect(state_dir / "clawbridge.db")
    db.row_factory = sqlite3.Row
    try:
        return db.execute("SELECT t.*, s.user_id FROM turns t JOIN sessions s USING(session_id) "
                          "ORDER BY t.created_at").fetchall()
    finally:
        db.close()


def _decode(renderer: Renderer, blob: bytes | None) -> str:
    from clawbridge.store.codec import decode_ids

    return "" if blob is None else str(renderer.decode(decode_ids(blob)))


SEEN = {"system": "The user's name is Sam.\n\nThe user told you how they want your answers: " + COMPLAINT,
        "user": f"How do I make tea?\n\n[Hint: {COMPLAINT}]"}
"""What a noted call's prompt carries, by `notes_place`."""
MARK = {"system": "The user told you how", "user": "[Hint:"}


@pytest.mark.parametrize("place", ["system", "user"])
def test_a_correction_becomes_a_note_the_same_users_next_call_carries(tiny_model_dir: Path, tmp_path: Path,
                                                                       place: str) -> None:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    sampler = FakeSampler(script=script_for(renderer, "Hello there, how can I help?"))
    with JudgeServer() as judge:
        proxy = start_fake_proxy(tiny_model_dir, tmp_path / "state", sampler, judge="endpoint",
                                 judge_base_url=judge.base_url, judge_model="rule-based", judge_votes=1,
                                 judge_poll_interval_s=0.05, notes_place=place)
        try:
            _run(proxy, renderer, tmp_path / "state", place)
        finally:
            proxy.stop()


@pytest.mark.parametrize("hints", ["words", "instruction"])
def test_corrections_asking_for_the_same_thing_count_on_one_note(tiny_model_dir: Path, tmp_path: Path,
                                                                  hints: HintStyle) -> None:
    """Differently worded corrections of one preference are one note with several corrections (the
    judge, shown the user's notes, says `SAME: n`); a correction about another thing is a note of
    its own. Before, each wording was a note, and with notes_max of them the notes churned. Also
    when the judge writes its hints as instructions ("Call the user Sam."): the notes it is shown
    are then in its own words, not the user's."""
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    sampler = FakeSampler(script=script_for(renderer, "Hello there, how can I help?"))
    written = instruction_hint if hints == "instruction" else str.strip
    first, brief = written(COMPLAINT), "Too long. Keep it under 30 words, please."
    with JudgeServer(rule_based(hints)) as judge:
        proxy = start_fake_proxy(tiny_model_dir, tmp_path / "state", sampler, judge="endpoint",
                                 judge_base_url=judge.base_url, judge_model="rule-based", judge_votes=1,
                                 judge_poll_interval_s=0.05, notes_max=2)
        try:
            admin = {"Authorization": f"Bearer {proxy.state.keys.admin}"}
            client = openai.OpenAI(base_url=f"{proxy.base}/v1", api_key=proxy.state.keys.client)
            question = {"role": "user", "content": "How do I make tea?"}

            def session(sid: str, complaint: str, n_notes: int) -> list[dict[str, Any]]:
                answer = client.chat.completions.create(model="tiny", messages=[question],
                                                        extra_headers={"X-Session-Id": sid})
                client.chat.completions.create(
                    model="tiny", extra_headers={"X-Session-Id": sid, "X-Session-Done": "true"},
                    messages=[question, {"role": "assistant", "content": answer.choices[0].message.content or ""},
                              {"role": "user", "content": complaint}])
                return list(wait_for(lambda: (lambda ns: ns if sum(n["corrections"] for n in ns) == n_notes else None)(
                    httpx.get(f"{proxy.base}/rl/notes", headers=admin).json()["notes"]), 30, f"{sid} judged"))

            session("a", COMPLAINT, 1)
            session("b", "Don't forget to address me as Sam.", 2)
            notes = session("c", "Please say my name, Sam, in your answers.", 3)
            assert [(n["text"], n["corrections"], n["status"]) for n in notes] == [(first, 3, "active")]
            asked = [m["content"] for body in judge.requests for m in body["messages"] if m["role"] == "user"]
            assert f"[1] {first}" in asked[-1]  # the judge was shown the note it counted on
            notes = session("d", brief, 4)
            assert sorted((n["text"], n["corrections"]) for n in notes) == sorted([(written(brief), 1), (first, 3)])
        finally:
            proxy.stop()


def _run(proxy: Any, renderer: Renderer, state_dir: Path, place: str) -> None:
    mark = MARK[place]
    admin = {"Authorization": f"Bearer {proxy.state.keys.admin}"}
    shared = openai.OpenAI(base_url=f"{proxy.base}/v1", api_key=proxy.state.keys.client)
    alice_key = httpx.post(f"{proxy.base}/rl/users", json={"user": "alice"}, headers=admin).json()["api_key"]
    alice = openai.OpenAI(base_url=f"{proxy.base}/v1", api_key=alice_key)
    system = {"role": "system", "content": "You are Claw. The user's name is Sam."}
    question = {"role": "user", "content": "How do I make tea?"}

    def talk(client: openai.OpenAI, sid: str, **extra: Any) -> str:
        first = client.chat.completions.create(model=extra.pop("model", "tiny"), messages=[system, question],
                                               extra_headers={"X-Session-Id": sid, **extra.pop("headers", {})})
        answer = first.choices[0].message.content or ""
        client.chat.completions.create(
            model="tiny", messages=[system, question, {"role": "assistant", "content": answer},
                                    {"role": "user", "content": COMPLAINT}],
            extra_headers={"X-Session-Id": sid, "X-Session-Done": "true"})
        return answer

    talk(shared, "s1")
    notes = wait_for(lambda: httpx.get(f"{proxy.base}/rl/notes", headers=admin).json()["notes"], 30, "a note")
    assert [(n["user"], n["text"], n["status"]) for n in notes] == [(None, COMPLAINT, "active")]
    # the shared key's next session carries it: the model saw it, training will not
    talk(shared, "s2")
    talk(alice, "a1")  # alice is another person: her calls carry nothing of the shared key's notes
    talk(shared, "s3", headers={"X-Turn-Type": "side"})  # a side turn (a title, a summary) carries nothing
    talk(shared, "s4", model="default@0")  # a pinned version is an evaluation: nothing
    talk(shared, "s5", headers={"X-Clawbridge-Notes": "off"})
    rows = {(r["session_id"], r["seq"]): r for r in _turns(state_dir)}
    noted = rows[("s2", 0)]
    seen, trains = _decode(renderer, noted["prompt_token_ids"]), _decode(renderer, noted["train_prompt_token_ids"])
    assert SEEN[place] in seen
    assert mark not in trains and "How do I make tea?" in trains
    assert json.loads(noted["request_json"])["messages"][-1] == question  # the client's own request
    assert json.loads(noted["meta_json"])["notes"] == [notes[0]["note_id"]]
    for key in (("s1", 0), ("alice:a1", 0), ("s3", 0), ("s4", 0), ("s5", 0)):
        row = rows[key]
        assert mark not in _decode(renderer, row["prompt_token_ids"]), key
        assert row["train_prompt_token_ids"] is None, key
    # alice's correction is her own note; the admin sees both, alice only hers, the shared key only its own
    wait_for(lambda: len(httpx.get(f"{proxy.base}/rl/notes", headers=admin).json()["notes"]) == 2, 30, "alice's note")
    mine = httpx.get(f"{proxy.base}/rl/notes", headers={"Authorization": f"Bearer {alice_key}"}).json()["notes"]
    assert [n["user"] for n in mine] == ["alice"]
    client_hdr = {"Authorization": f"Bearer {proxy.state.keys.client}"}
    theirs = httpx.get(f"{proxy.base}/rl/notes", headers=client_hdr).json()["notes"]
    assert [n["user"] for n in theirs] == [None]
    # alice cannot see or delete the shared key's note (404, as if it did not exist), nor ask for another's list
    assert httpx.delete(f"{proxy.base}/rl/notes/{theirs[0]['note_id']}",
                        headers={"Authorization": f"Bearer {alice_key}"}).status_code == 404
    assert httpx.get(f"{proxy.base}/rl/notes?user=", headers={"Authorization": f"Bearer {alice_key}"}).status_code == 404
    # the person deletes their note: the next call carries nothing
    assert httpx.delete(f"{proxy.base}/rl/notes/{theirs[0]['note_id']}", headers=client_hdr).json()["deleted"]
    shared.chat.completions.create(model="tiny", messages=[system, question], extra_headers={"X-Session-Id": "s6"})
    last = next(r for r in _turns(state_dir) if r["session_id"] == "s6")
    assert mark not in _decode(renderer, last["prompt_token_ids"]) and last["train_prompt_token_ids"] is None
    assert httpx.get(f"{proxy.base}/rl/notes", headers=client_hdr).json()["notes"] == []
    # bad input: an empty note and an unknown field are 422, an unknown id 404
    assert httpx.post(f"{proxy.base}/rl/notes", json={"text": ""}, headers=client_hdr).status_code == 422
    assert httpx.post(f"{proxy.base}/rl/notes", json={"text": "x", "rule": 1}, headers=client_hdr).status_code == 422
    assert httpx.delete(f"{proxy.base}/rl/notes/999999", headers=client_hdr).status_code == 404
    # forgetting alice deletes her notes (also one she wrote by hand) and a new alice carries none of them
    alice_hdr = {"Authorization": f"Bearer {alice_key}"}
    assert httpx.post(f"{proxy.base}/rl/notes", json={"text": "Answer in French."}, headers=alice_hdr).status_code == 200
    assert httpx.post(f"{proxy.base}/rl/users/alice/forget", headers=admin).json()["forgotten"]
    assert [n for n in httpx.get(f"{proxy.base}/rl/notes", headers=admin).json()["notes"] if n["user"] == "alice"] == []
    new_key = httpx.post(f"{proxy.base}/rl/users", json={"user": "alice"}, headers=admin).json()["api_key"]
    openai.OpenAI(base_url=f"{proxy.base}/v1", api_key=new_key).chat.completions.create(
        model="tiny", messages=[system, question], extra_headers={"X-Session-Id": "fresh"})
    fresh = next(r for r in _turns(state_dir) if r["session_id"] == "alice:fresh")
    assert mark not in _decode(renderer, fresh["prompt_token_ids"]) and fresh["train_prompt_token_ids"] is None


def test_notes_retire_once_check_sessions_served_without_them_are_accepted(tmp_path: Path) -> None:
    """Check sessions start once the user's lane trained `check_after_steps` steps after the note;
    the notes retire when the last `retire_after` check sessions' first answers were accepted."""
    from clawbridge.store.versions import VersionStore

    store = Store(tmp_path / "db.sqlite")
    book = NoteBook(store, NotesConfig(check_share=1.0, check_after_steps=1, check_after_met=0, retire_after=2))
    book.add_from_hint("", "Call me Sam.", "t0")
    assert book.for_call(None, "any", "main")[0] and not book.for_call(None, "any", "main")[1]
    versions = VersionStore(store)
    versions.commit_base("ck0", None)
    store.clock.now()  # a step after the note: check sessions begin
    v = versions.reserve("step")
    versions.commit(v, "ck1", None)
    book.refresh()
    notes, check = book.for_call(None, "sess-x", "main")
    assert notes == [] and check  # check_share 1.0: every session is a check
    _judged(store, "c1", v, "check", [1.0])
    assert not book.observe_check("")  # one accepted check: not yet
    _judged(store, "c2", v, "check", [-1.0])
    _judged(store, "c3", v, "check", [1.0])
    assert not book.observe_check("")  # the last two: -1, +1
    _judged(store, "c4", v, "check", [1.0])
    assert book.observe_check("")  # the last two accepted: the weights carry it
    assert book.for_call(None, "sess-y", "main") == ([], False)
    listed = book.status()
    assert listed[0]["status"] == "retired" and "weights carry it" in listed[0]["retired_reason"]
    assert listed[0]["check_sessions"] == 4 and listed[0]["check_accepted"] == 3
    store.close()


def _judged(store: Store, session: str, version: int, notes: Any, scores: list[float], user: str | None = None) -> None:
    """A session of `user` (None: the shared key) whose main turns were served with `notes` (meta)
    and judged `scores`."""
    from clawbridge.store.rewards import RewardStore, VoteRow

    rstore = RewardStore(store)
    for i, score in enumerate(scores):
        now = store.clock.now()
        tid = store.record_turn(TurnRecord(session, "main", "ok", "m", [1, i], [2], [-0.1], version, "stop", "{}",
                                           None, now, now, meta={"notes": notes}, user_id=user, caller=user),
                                end_reason="end_session" if i == len(scores) - 1 else None)
        attempt = rstore.begin_judgement(tid, session, "rule-based")
        rstore.finish_judgement(tid, attempt, [VoteRow(0, int(score), None, "SCORE", None)], score, score, None)


def _book_with_a_note(tmp_path: Path, check_after_met: int, retire_after: int
                      ) -> tuple[Store, NoteBook, Note, Callable[[str], int]]:
    """A store with a base version, a notebook whose every session may be a check (one step after
    the note), the shared key's note, and `step(checkpoint)`: commit a training step, its version."""
    from clawbridge.store.versions import VersionStore

    store = Store(tmp_path / "db.sqlite")
    book = NoteBook(store, NotesConfig(check_share=1.0, check_after_steps=1, check_after_met=check_after_met,
                                       retire_after=retire_after))
    note = book.add_from_hint("", "Call me Sam.", "t0")
    assert note is not None
    versions = VersionStore(store)
    versions.commit_base("ck0", None)

    def step(checkpoint: str) -> int:
        store.clock.now()  # the step commits after what came before it
        v = versions.reserve("step")
        versions.commit(v, checkpoint, None)
        return v

    return store, book, note, step


def test_check_sessions_wait_until_the_note_itself_works(tmp_path: Path) -> None:
    """Trained enough is not enough: while answers served WITH the note still miss, a session
    without it would only show the user a miss. Checks begin once the last `check_after_met`
    noted sessions' first answers were accepted, and a noted miss pauses them again."""
    store, book, note, step = _book_with_a_note(tmp_path, check_after_met=2, retire_after=2)
    v = step("ck1")
    book.refresh()
    assert book.for_call(None, "sess-x", "main") == ([note], False)  # a step old, but no noted answer yet
    _judged(store, "m1", v, [note.note_id], [1.0], user="mallory")  # another user's accepted sessions...
    _judged(store, "m2", v, [note.note_id], [1.0], user="mallory")
    book.refresh()
    assert book.for_call(None, "sess-x", "main") == ([note], False)  # ...never start the shared key's checks

    _judged(store, "n1", v, [note.note_id], [1.0])
    _judged(store, "n2", v, [note.note_id], [-1.0, 1.0])  # its FIRST answer missed; a later turn does not count
    book.refresh()
    assert book.for_call(None, "sess-x", "main")[1] is False
    _judged(store, "n3", v, [note.note_id], [1.0])
    book.refresh()
    assert book.for_call(None, "sess-x", "main")[1] is False  # the last two: n3 accepted, n2 missed
    _judged(store, "n4", v, [note.note_id], [1.0])
    book.refresh()
    assert book.for_call(None, "sess-x", "main") == ([], True)  # the last two noted first answers accepted
    _judged(store, "n5", v, [note.note_id], [-1.0])
    book.refresh()
    assert book.for_call(None, "sess-x", "main")[1] is False  # a noted miss: the note does not work yet
    store.close()


def test_a_missed_check_pauses_checks_until_the_lane_trained_and_the_note_works_again(tmp_path: Path) -> None:
    """A check session that missed says the weights do not carry the note yet: the next sessions are
    served with it until the lane trained `check_after_steps` more steps AND the last
    `check_after_met` noted sessions since the miss were accepted (a run of Sam's, seed 0, met five
    check sessions in a row and missed all five before this rule)."""
    store, book, note, step = _book_with_a_note(tmp_path, check_after_met=1, retire_after=3)
    v = step("ck1")
    _judged(store, "n1", v, [note.note_id], [1.0])
    book.refresh()
    assert book.for_call(None, "sess-x", "main") == ([], True)  # trained a step, the note works: checks
    _judged(store, "c1", v, "check", [-1.0])  # the weights alone missed
    book.refresh()
    assert book.for_call(None, "sess-x", "main") == ([note], False)  # no step since the miss
    _judged(store, "n2", v, [note.note_id], [1.0])
    book.refresh()
    assert book.for_call(None, "sess-x", "main") == ([note], False)  # the note works, but nothing trained since
    v = step("ck2")
    book.refresh()
    assert book.for_call(None, "sess-x", "main") == ([], True)  # a step after the miss and n2 accepted after it
    _judged(store, "c2", v, "check", [-1.0, 1.0])  # a check whose FIRST answer missed is a missed check
    v = step("ck3")
    book.refresh()
    assert book.for_call(None, "sess-x", "main") == ([note], False)  # trained since, no noted answer since
    _judged(store, "n3", v, [note.note_id], [1.0])
    book.refresh()
    assert book.for_call(None, "sess-x", "main") == ([], True)
    _judged(store, "c3", v, "check", [-1.0], user="mallory")  # another user's missed checks change nothing here
    book.refresh()
    assert book.for_call(None, "sess-x", "main") == ([], True)
    store.close()


def test_notes_retire_on_check_sessions_not_on_their_later_turns(tmp_path: Path) -> None:
    """`retire_after` counts check SESSIONS by their first answer: one check session whose first
    answer missed and whose later turns were accepted is one miss, not two acceptances."""
    from clawbridge.store.versions import VersionStore

    store = Store(tmp_path / "db.sqlite")
    book = NoteBook(store, NotesConfig(check_share=1.0, check_after_steps=0, check_after_met=0, retire_after=2))
    book.add_from_hint("", "Call me Sam.", "t0")
    VersionStore(store).commit_base("ck0", None)
    _judged(store, "c1", 0, "check", [-1.0, 1.0, 1.0])
    assert not book.observe_check("")
    _judged(store, "c2", 0, "check", [1.0])
    assert not book.observe_check("")  # the last two check sessions: a miss, then an accepted one
    _judged(store, "c3", 0, "check", [1.0])
    assert book.observe_check("")
    store.close()


@pytest.mark.parametrize("share", [0.0, 0.25, 1.0])
def test_check_sessions_are_a_stable_share(share: float) -> None:
    ids = [f"s{i}" for i in range(2000)]
    got = sum(is_check_session(i, share) for i in ids) / len(ids)
    assert abs(got - share) < 0.04
    assert [is_check_session(i, share) for i in ids[:30]] == [is_check_session(i, share) for i in ids[:30]]


@pytest.mark.parametrize(("answer", "hint", "echoes"), [
    ("[Hint: Please be brief, just a sentence or two.]", "Please be brief, just a sentence or two.", True),
    ("Introduced It was (Hint: Thanks.", COMPLAINT, True),  # the marker, whatever follows it
    ("You didn't use my name. please call me [Sam], please call me.", COMPLAINT, True),  # four words in a row
    ("Sure, Sam! Boil the water, then steep the tea for three minutes.", COMPLAINT, False),
    ("I will be brief: Paris.", "Be brief.", False),  # a hint under four words: only the marker counts
    ("Paris. Cheers from your assistant", "Sign off with 'Cheers from your assistant' please.", False),  # asked for
    ("Paris. Cheers from your assistant", 'Sign off with "Cheers from your assistant".', False),
    ("Sign off with cheers, from me.", "Don't forget: sign off with 'Cheers from your assistant'.", False),
    ("Don't forget: sign off with it.", "Don't forget: sign off with 'Cheers from your assistant'.", True),
    ("Paris. Then the details: it is the largest city.",
     "Don't bury the answer. Give me a one-line answer first, then the details.", False),
    # a note of its own, in the note's form (seen at a high learning rate): not the hint's words
    ("[Your answer was too long too. Here is the correct answer with two sentences]", COMPLAINT, True),
    ("Sam, steep it for three minutes. [I, you look like a scientist.]", COMPLAINT, True),
    # brackets that are not a note: a link, a citation, a checkbox, a short tag
    ("See [the tea guide for beginners](https://example.com/tea), Sam.", COMPLAINT, False),
    ("Steep it for three minutes [1], Sam. - [ ] buy tea [Sam]", COMPLAINT, False),
])
def test_an_answer_that_repeats_its_note_echoes_it(answer: str, hint: str, echoes: bool) -> None:
    from clawbridge.rewards.notes import echoes_note

    assert echoes_note(answer, hint) is echoes


def test_an_answer_that_echoes_its_note_is_recorded_and_never_trained(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SmolLM2 taught at a high rate answered 34% of noted calls with the note itself ("[Hint: You
    didn't use my name. Please call me Sam.]"), and the person's check (his name is in it) rewarded
    that: trained onto the plain prompt, it teaches the weights to say the hint unasked. Such a turn
    is recorded as it was (token exact) with `meta.notes_echoed`, and becomes a sample already
    dropped as `echoed_note`; the same answer in a call without notes is trained as any other."""
    from clawbridge.store.training import TrainingStore

    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    sampler = FakeSampler(script=script_for(renderer, f"[Hint: {COMPLAINT}]"))
    proxy = start_fake_proxy(tiny_model_dir, tmp_path / "state", sampler)
    try:
        auth = {"Authorization": f"Bearer {proxy.state.keys.client}"}
        admin = {"Authorization": f"Bearer {proxy.state.keys.admin}"}
        client = openai.OpenAI(base_url=f"{proxy.base}/v1", api_key=proxy.state.keys.client)
        question = [{"role": "user", "content": "How do I make tea?"}]

        def session(sid: str) -> None:
            client.chat.completions.create(model="tiny", messages=question,  # type: ignore[arg-type]
                                           extra_headers={"X-Session-Id": sid, "X-Session-Done": "true"})
            assert httpx.post(f"{proxy.base}/rl/set_session_reward", json={"session_id": sid, "reward": 1.0},
                              headers=admin).status_code == 200

        session("plain")
        assert httpx.post(f"{proxy.base}/rl/notes", json={"text": COMPLAINT}, headers=auth).status_code == 200
        session("noted")
    finally:
        proxy.stop()
    rows = {r["session_id"]: r for r in _turns(tmp_path / "state")}
    plain, noted = json.loads(rows["plain"]["meta_json"]), json.loads(rows["noted"]["meta_json"])
    assert "notes_echoed" not in plain and noted["notes_echoed"] is True and noted["notes"]
    assert rows["noted"]["completion_token_ids"] == rows["plain"]["completion_token_ids"]  # recorded as sampled
    from clawbridge.devtools.talk import note_echoes

    assert note_echoes(tmp_path / "state") == [(0, True)]  # the bench's count (`--echoes`) reads the same
    store = Store.open(tmp_path / "state")
    try:
        tstore = TrainingStore(store)
        tstore.ingest_ended()
        assert [s.session_id for s in tstore.ready_samples()] == ["plain"]
        with store.read() as c:
            dropped = dict(c.execute("SELECT session_id, dropped_reason FROM samples").fetchall())
        assert dropped == {"plain": None, "noted": "echoed_note"}
        assert tstore.training_stats()["samples"]["dropped"] == {"echoed_note": 1}  # `clawbridge status` counts it
    finally:
        store.close()


def test_best_of_answers_count_only_the_notes_own_user_since_it_was_made(tmp_path: Path) -> None:
    """A note's `best_of_answers` (what `clawbridge status` says as "N answers served as the best of
    n") counts its own user's main turns served best of n since the note was made: never another
    user's (mallory's), never the shared key's for a user's note, never a side turn, never a turn
    from before the note, never a turn served one sample."""
    store = Store(tmp_path / "db.sqlite")
    book = NoteBook(store)

    def turn(session: str, user: str | None, meta: dict[str, Any], turn_type: str = "main") -> None:
        now = store.clock.now()
        store.record_turn(TurnRecord(session, turn_type, "ok", "m", [1], [2], [-0.1], 0, "stop", "{}", None, now,
                                     now, meta=meta, user_id=user, caller=user))

    picked = {"best_of": {"n": 4, "picked": 1, "scores": [0.1, 0.3, 0.0, 0.2], "echoes": 0}}
    turn("before", "alice", picked)  # before her note
    note = book.add_from_hint("alice", "Call me Sam.", "t0")
    assert note is not None
    turn("a1", "alice", picked)
    turn("a1", "alice", picked, turn_type="side")
    turn("a2", "alice", {"notes": [note.note_id]})  # one sample
    turn("m1", "mallory", picked)
    turn("s1", None, picked)
    (listed,) = book.status("alice")
    assert (listed["best_of_answers"], listed["best_of_n"]) == (1, 4)
    turn("m2", "mallory", {"best_of": {"n": 8, "picked": 0, "scores": [0.0] * 8, "echoes": 0}})
    (listed,) = book.status("alice")
    assert (listed["best_of_answers"], listed["best_of_n"]) == (1, 4)  # mallory's n = 8 is not alice's
    store.close()
