"""The talk benchmark's pacing (`clawbridge.devtools.talk`): a paced person waits, after every N
sessions, until the judge, the trainer and the gate have caught up, and never after the last."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clawbridge.devtools.talk import Proxy, TalkConfig, paced, settle, step_counts
from clawbridge.store import Store
from clawbridge.store.promotion import Decision, PromotionStore


def test_a_paced_person_waits_after_every_n_sessions_but_the_last() -> None:
    assert [i for i in range(7) if paced(TalkConfig(sessions=7, pace_every=2), i)] == [1, 3, 5]
    assert [i for i in range(6) if paced(TalkConfig(sessions=6, pace_every=2), i)] == [1, 3]
    assert [i for i in range(4) if paced(TalkConfig(sessions=4, pace_every=1), i)] == [0, 1, 2]
    assert not any(paced(TalkConfig(sessions=6), i) for i in range(6))  # the default: back to back


class ScriptedProxy(Proxy):
    """A proxy whose `/rl/status` answers come from a list (the last one repeats)."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        super().__init__("http://127.0.0.1:9", "admin", "client")
        self.answers = answers
        self.asked = 0

    def status(self) -> dict[str, Any]:
        self.asked += 1
        return self.answers[min(self.asked, len(self.answers)) - 1]


SETTLED: dict[str, Any] = {"trainer": {"backlog": 1, "waiting": {"unrewarded_turns": 1}}, "judge": {},
                           "promotion": {"holding": None}, "step": "settled"}


def test_settle_waits_for_the_judge_the_step_the_ready_backlog_and_the_gate_in_turn() -> None:
    proxy = ScriptedProxy([
        {"trainer": {}, "judge": {"judgements": {"running": 1}}},  # the judge still reads a session
        {"trainer": {"in_step": True}, "judge": {}},  # a step runs
        {"trainer": {"backlog": 3, "waiting": {"unrewarded_turns": 1}}, "judge": {}},  # 2 ready, untrained
        {"trainer": {}, "judge": {}, "promotion": {"holding": 4}},  # the gate has not decided v4
        SETTLED,  # the one backlog turn left waits for a reward that never comes (a reply turn): settled
    ])
    said: list[str] = []
    st = settle(proxy, TalkConfig(settle_s=60), said.append, poll_s=0.01)
    assert st is SETTLED and proxy.asked == 5 and not said


def test_settle_gives_up_after_settle_s_and_says_what_it_waited_for() -> None:
    proxy = ScriptedProxy([{"trainer": {"backlog": 2}, "judge": {}, "promotion": {"holding": 7}}])
    said: list[str] = []
    st = settle(proxy, TalkConfig(settle_s=0.05), said.append, poll_s=0.01)
    assert st["promotion"]["holding"] == 7
    assert said == ["not settled after 0 s (backlog 2, holding 7)"]


def test_the_bench_counts_every_step_and_decision_from_the_store_not_the_recent_ones(tmp_path: Path) -> None:
    """A paced run makes dozens of decisions; `/rl/status` lists only the recent ones (a run of 32
    steps with 30 promoted and 2 rejected printed 19/1 before the counts came from the store)."""
    store = Store(tmp_path / "clawbridge.db")
    ps = PromotionStore(store)
    ps.set_state("probe", 0)
    with store.write() as c:
        for step in range(1, 41):
            c.execute("INSERT INTO steps(step, policy_version, status, started_at) VALUES(?, ?, 'ok', 0)", (step, step))
        c.execute("INSERT INTO steps(step, policy_version, status, started_at) VALUES(41, 41, 'failed', 0)")
    for v in range(1, 41):
        assert ps.decide(Decision(v, "rejected" if v % 4 == 0 else "promoted", "eval", "probe", v - 1), "probe")
    assert ps.decide(Decision(3, "rejected", "admin", "an admin's rollback", 40), "probe", hold=True)
    assert len(ps.decisions()) < 41  # what status shows is a window
    assert step_counts(tmp_path) == (40, 30, 10)  # the failed step and the admin's decision are not counted
    assert step_counts(tmp_path / "nowhere") == (0, 0, 0)  # no store: nothing, not an error
