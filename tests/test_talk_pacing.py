"""The talk benchmark's pacing (`clawbridge.devtools.talk`): a paced person waits, after every N
sessions, until the judge, the trainer and the gate have caught up, and never after the last."""

from __future__ import annotations

from typing import Any

from clawbridge.devtools.talk import Proxy, TalkConfig, paced, settle


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
