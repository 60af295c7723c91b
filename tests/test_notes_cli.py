"""`clawbridge notes` and the "learning from talk" section of `clawbridge status`, against a real
`clawbridge up` (the tiny model, the local backend, real training steps gated by the built-in
capability probe) whose judge is the rule-based judge endpoint, with the real openai SDK as the
agent and the CLI run as a user runs it (its output piped, as in `clawbridge notes | grep`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clawbridge.devtools.judge_server import JudgeServer
from tests.support import ProxyProcess, wait_for
from tests.test_cli import cli

CORRECTION = "You didn't use my name. Please call me Sam, and keep every answer under thirty words from now on."
QUESTION = "How do I make tea?"


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    with JudgeServer() as judge:
        env = {"CLAWBRIDGE_JUDGE": "endpoint", "CLAWBRIDGE_JUDGE_BASE_URL": judge.base_url,
               "CLAWBRIDGE_JUDGE_MODEL": "rule-based", "CLAWBRIDGE_JUDGE_VOTES": "1",
               "CLAWBRIDGE_JUDGE_POLL_INTERVAL_S": "0.2", "CLAWBRIDGE_BATCH_SIZE": "2",
               "CLAWBRIDGE_TRAINER_POLL_INTERVAL_S": "0.2", "CLAWBRIDGE_BATCH_WAIT_S": "1",
               "CLAWBRIDGE_CAPABILITY_PROBE_MAX_TOKENS": "8"}
        p = ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("notes-cli-state"), env=env).start()
        yield p
        p.stop()


def run(proxy: ProxyProcess, *args: str, check: bool = True) -> Any:
    return cli(*args, "--state-dir", str(proxy.state_dir), check=check)


def talk(proxy: ProxyProcess, sid: str, reply: str) -> None:
    """A question, the model's answer, then the user's reply (which the judge reads) ending the session."""
    client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=proxy.key(), max_retries=0)
    first = client.chat.completions.create(model="default", max_tokens=8, messages=[
        {"role": "user", "content": QUESTION}], extra_headers={"X-Session-Id": sid})
    client.chat.completions.create(model="default", max_tokens=8, extra_headers={
        "X-Session-Id": sid, "X-Session-Done": "true"}, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": reply}])


def rl_status(proxy: ProxyProcess) -> dict[str, Any]:
    r = httpx.get(proxy.base + "/rl/status", headers={"Authorization": f"Bearer {proxy.admin_key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_notes_from_talk_listed_added_deleted_and_shown_in_status(proxy: ProxyProcess) -> None:
    assert "learning from talk" not in run(proxy, "status").stdout  # no note yet: nothing to say
    assert "no notes yet" in run(proxy, "notes").stdout

    talk(proxy, "corrected", CORRECTION)
    notes = wait_for(lambda: json.loads(run(proxy, "notes", "--json").stdout)["notes"], 60, "the note")
    assert [(n["user"], n["text"], n["status"], n["corrections"]) for n in notes] == [(None, CORRECTION, "active", 1)]
    note_id = notes[0]["note_id"]
    table = run(proxy, "notes").stdout
    row = next(line for line in table.splitlines() if CORRECTION in line)  # the whole note on one line: piped
    for words in (str(note_id), "the shared key (calls without a user)", "said once", "no session judged since",
                  "not stable yet", "active: carried by the user's calls"):
        assert words in row, (words, table)

    # by hand, for a user; listed per user; bad input refused by the server with its reason
    assert "user alice created" in run(proxy, "users", "add", "alice").stdout
    added = run(proxy, "notes", "add", "Answer in French.", "--user", "alice").stdout
    assert "of alice: \"Answer in French.\" (active: carried by the user's calls)" in " ".join(added.split())
    only = json.loads(run(proxy, "notes", "list", "--user", "alice", "--json").stdout)["notes"]
    assert [(n["user"], n["text"]) for n in only] == [("alice", "Answer in French.")]
    assert "added by hand" in run(proxy, "notes", "--user", "alice").stdout
    empty = run(proxy, "notes", "add", "", check=False)
    assert empty.returncode == 1 and "the server refused (422)" in empty.stderr and "text" in empty.stderr
    assert run(proxy, "notes", "delete", "not-a-number", check=False).returncode == 2

    # an accepted session: the note was met since; status groups the notes per user, in words
    talk(proxy, "accepted", "Thanks, that works.")
    wait_for(lambda: next(n for n in rl_status(proxy)["notes"] if n["note_id"] == note_id)["sessions_since"] == 1,
             60, "the judged session")
    status = " ".join(run(proxy, "status").stdout.split())
    assert "learning from talk (what the judge read in corrections; `clawbridge notes` lists and deletes):" in status
    assert "alice: 1 active, 0 retired \"Answer in French.\" (added by hand): met by no session judged since" in status
    # both answers of the session carried the note and were picked among 4 (`notes_best_of`), each
    # after the judge endpoint checked the four (`notes_pick = auto`), twelve more when it found none
    # among them (`notes_best_of_more`)
    said = re.search(re.escape(f"the shared key (calls without a user): 1 active, 0 retired \"{CORRECTION}\" (said once): "
                               "met by 1 of 1 sessions since (100%); 2 answers served as the best of 4 at following it "
                               "(the judge found one that does among ") + r"[0-2] of 2(, [12] sampled again when it found none at first)?\); "
                     + re.escape("not stable yet; active: carried by the user's calls"), status)
    assert said is not None, status

    # still good? the two judged sessions train steps, each gated by the probe against the base: the
    # tiny random model knows no more facts than the one-fact slack (its greedy answer can match one by
    # chance), so it has nothing to lose, as the promoter rules (test_capability_probe.py words the other cases)
    wait_for(lambda: rl_status(proxy)["promotion"]["serving_version"] >= 1, 300, "a trained version to serve")
    status = " ".join(run(proxy, "status").stdout.split())
    assert re.search(r"still good\? nothing to lose: the base v0 answers (none|1 \(within the 1-fact slack\)) of "
                     r"the 40 probe facts, so trained versions are not probed", status), status

    # deleted: gone from the list (and the store); a second delete says there is none
    assert f"note {note_id} deleted" in run(proxy, "notes", "delete", str(note_id)).stdout
    assert [n["note_id"] for n in json.loads(run(proxy, "notes", "--json").stdout)["notes"]] != [note_id]
    again = run(proxy, "notes", "delete", str(note_id), check=False)
    assert again.returncode == 1 and f"no note {note_id}" in again.stderr
    # an id no SQLite row can have is "no such note" too, on the API, the CLI and the dashboard (not a 500)
    huge = str(2**64)
    assert "no note" in run(proxy, "notes", "delete", huge, check=False).stderr
    headers = {"Authorization": f"Bearer {proxy.admin_key}"}
    for path in (f"/rl/notes/{huge}", f"/rl/notes/-{huge}"):
        r = httpx.delete(proxy.base + path, headers=headers)
        assert r.status_code == 404 and r.json()["error"]["code"] == "note_not_found", r.text
    r = httpx.post(f"{proxy.base}/dashboard/api/notes/{huge}/delete", headers=headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "note_not_found", r.text
    cleared = run(proxy, "notes", "clear", "--user", "alice", "--yes").stdout
    assert "deleted 1 note(s) of alice" in cleared
    assert json.loads(run(proxy, "notes", "--json").stdout)["notes"] == []
