"""The talk benchmark's first-answer waits (`clawbridge.devtools.talk`): each person's wait, timed
at the client, is counted under how the store says the answer was made (one sample, the best of a
noted call's first candidates, or a second round), a user's namespaced session ids included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clawbridge.devtools.talk import ANSWER_KINDS, SessionLog, answer_kinds, wait_by_kind
from clawbridge.store import Store


def _turn(store: Store, session_id: str, seq: int, meta: dict[str, object]) -> None:
    with store.write() as c:
        c.execute("INSERT OR IGNORE INTO sessions(session_id, source, status, created_at, updated_at) "
                  "VALUES(?, 'header', 'active', 0, 0)", (session_id,))
        c.execute("INSERT INTO turns(turn_id, session_id, seq, turn_type, status, model, prompt_token_ids, "
                  "completion_token_ids, completion_logprobs, policy_version, request_json, meta_json, "
                  "prompt_tokens, completion_tokens, created_at, completed_at) "
                  "VALUES(?, ?, ?, 'main', 'ok', 'm', x'', x'', x'', 0, '{}', ?, 0, 0, 0, 0)",
                  (f"{session_id}/{seq}", session_id, seq, json.dumps(meta)))


def test_first_answer_waits_are_counted_by_how_the_answer_was_made(tmp_path: Path) -> None:
    store = Store(tmp_path / "clawbridge.db")
    _turn(store, "lead-0-0", 0, {})  # no notes: one sample
    _turn(store, "lead-0-0", 1, {"best_of": {"n": 4, "picked": 0}})  # the reply turn: never a first answer
    _turn(store, "lead-0-1", 0, {"best_of": {"n": 4, "picked": 2}})
    _turn(store, "lead-0-2", 0, {"best_of": {"n": 16, "picked": 13, "resampled": 12}})
    _turn(store, "ana:lead-0-3", 0, {"best_of": {"n": 4, "picked": 1}})  # a user's namespace
    kinds = answer_kinds(tmp_path)
    assert kinds == {"lead-0-0": ANSWER_KINDS[0], "lead-0-1": ANSWER_KINDS[1], "lead-0-2": ANSWER_KINDS[2],
                     "lead-0-3": ANSWER_KINDS[1]}
    sessions = [SessionLog("lead", i, "q", "a", False, 0, wait) for i, wait in enumerate([2.0, 10.0, 40.0, 20.0, 7.0])]
    w = wait_by_kind(sessions, kinds, seed=0)
    assert w[ANSWER_KINDS[0]] == {"n": 1, "mean_s": 2.0, "max_s": 2.0}
    assert w[ANSWER_KINDS[1]] == {"n": 2, "mean_s": 15.0, "max_s": 20.0}
    assert w[ANSWER_KINDS[2]] == {"n": 1, "mean_s": 40.0, "max_s": 40.0}
    assert w["unrecorded"] == {"n": 1, "mean_s": 7.0, "max_s": 7.0}  # session 4 never reached the store
    assert wait_by_kind(sessions, kinds, seed=1) == {"unrecorded": pytest.approx(
        {"n": 5, "mean_s": 15.8, "max_s": 40.0})}  # another seed's ids: none of these
    assert answer_kinds(tmp_path / "nowhere") == {}  # no store: nothing, not an error
