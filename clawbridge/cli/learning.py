"""`clawbridge doctor --learning`: "is it learning, and if not, why?" in words, with the figure
behind each answer and what to change.

The questions the peers' trackers ask most ("sessions skipped as unknown", "zero advantages", "a
judge that never answers", "60 conversations and nothing changed") are each one check here, read
from the running server's `/rl/status` and the store (read-only, `clawbridge.store.learning`):
sessions end; ended sessions get rewards or verdicts; rewards differ (else every advantage is 0);
the judge answers, and clearly; samples are trained, not dropped; steps succeed; the gate keeps
what was trained.

Invariants:
- Every check says what holds NOW, with its figure (counts over the newest rows, `RECENT`), and a
  check that holds says what to change.
- `blocks` means nothing learns until it is mended (the exit code is 1); `warn` means learning
  goes on, slower or from less data; `ok` and `n/a` need nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from clawbridge.cli.target import Target
from clawbridge.config import Settings
from clawbridge.promotion.likelihood import FACTS, GUARD_REASON, GUARDS
from clawbridge.store.learning import RECENT, LearningFacts

Verdict = Literal["ok", "warn", "blocks", "n/a"]

DROP_FIXES = {
    "stale": "the trainer fell behind the policy: answers sampled too many versions ago are dropped "
             "(drop_stale_after, or max_off_policy_steps with stale_policy = drop); raise that bound, or use a "
             "smaller batch_size so steps come sooner",
    "private": "the privacy filter found secrets in these answers and kept them off the hosted trainer; by design "
               "(privacy = off, or privacy_patterns, if those are no secrets)",
    "held_out": "held-out sessions score new versions instead of training them (held_out_share); by design",
    "empty": "answers without a sampled token have nothing to train",
    "echoed_note": "the model repeated the user's note instead of following it; such answers are never trained, so "
                   "the weights do not learn to say the note unasked (by design; docs/training.md, notes)",
}
"""What to change for each reason a sample is dropped (no_reward and no_signal have checks of their own)."""


@dataclass(frozen=True)
class Check:
    """One question of the diagnosis, answered."""

    name: str
    """The question, as a statement that should hold ("sessions end")."""
    verdict: Verdict
    figure: str
    """What holds now, with the number behind it."""
    change: str | None = None
    """What to change, when it does not hold."""


def _age(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _left_words(left: dict[str, int]) -> str:
    n = sum(left.values())
    return f"of the last {n} turn(s) that left the training queue"


def check_sessions(f: LearningFacts, s: Settings) -> Check:
    name = "sessions end"
    if f.main_turns == 0:
        return Check(name, "blocks", "no model call is recorded yet",
                     "point your agent at the server's /v1 with the client key (`clawbridge up` prints both)")
    total = f.sessions_active + f.sessions_ended
    if f.sessions_ended == 0:
        quiet = f" the quietest for {_age(f.most_idle_active_s)};" if f.most_idle_active_s is not None else ""
        return Check(name, "blocks",
                     f"no session has ended: {f.sessions_active} active, holding {f.active_turns} turn(s);{quiet} "
                     f"a session ends by itself after session_idle_timeout_s = {s.session_idle_timeout_s:g} s",
                     "a session's turns train only once it ends: send `X-Session-Done: true` on its last call, POST "
                     "/rl/end_session, run `clawbridge sessions end ID`, or lower session_idle_timeout_s")
    active = (f"{f.sessions_active} active, holding {f.active_turns} turn(s)" if f.sessions_active
              else "none active")
    return Check(name, "ok", f"{f.sessions_ended} of {total} session(s) ended ({active})")


def check_rewards(f: LearningFacts, s: Settings, judge: str | None) -> Check:
    name = "ended sessions get rewards or verdicts"
    if f.sessions_ended == 0:
        return Check(name, "n/a", "no session has ended yet")
    change = ("the judge gives a turn a verdict from what came next (the user's reply, a tool's result): a session "
              "of one call, and a session's last answer, get none; see the judge check below" if judge else
              "reward turns (`clawbridge reward SESSION 1`, POST /rl/set_reward, the dashboard), or let a judge "
              "read rewards from what the user says next (judge = endpoint or base), or give ended sessions a "
              "default (default_session_reward)")
    dropped = f.left_queue.get("no_reward", 0)
    figure = f"{f.unrewarded_turns} turn(s) of ended sessions wait without any reward"
    if f.left_queue:
        figure += (f"; {dropped} {_left_words(f.left_queue)} were dropped as no_reward (after reward_wait_s = "
                   f"{s.reward_wait_s:g} s)")
    if f.rewards == 0:
        return Check(name, "blocks", f"no reward is recorded at all: {figure}", change)
    if f.left_queue and dropped == sum(f.left_queue.values()):
        return Check(name, "blocks", figure, change)
    if f.unrewarded_turns or dropped:
        return Check(name, "warn", figure, change)
    return Check(name, "ok", f"{f.rewards} reward(s) recorded; no turn of an ended session waits without one")


def check_signal(f: LearningFacts, baseline: str) -> Check:
    name = "rewards differ (else every advantage is 0)"
    change = ("every answer of a task was rewarded alike, so against a group baseline nothing is better or worse: "
              "reward on a scale (partial credit, 0..1) instead of pass or fail, give each task prompts some "
              "answers fail, sample more varied answers (a higher temperature), or set baseline = running_mean "
              "(none: the reward itself)")
    no_signal = f.left_queue.get("no_signal", 0)
    groups = f" ({f.equal_groups} of the last {f.groups} task group(s) rewarded alike)" if f.groups else ""
    if no_signal:
        figure = f"{no_signal} {_left_words(f.left_queue)} were dropped as no_signal: zero advantage{groups}"
        return Check(name, "warn" if f.left_queue.get("trained") else "blocks", figure, change)
    recent = f.recent_rewards
    if len(recent) >= 4 and len(set(recent)) == 1 and baseline != "none":
        return Check(name, "warn", f"the last {len(recent)} rewards were all {recent[0]:g}: against a {baseline} "
                                   "baseline their advantages go to 0", change)
    if not recent:
        return Check(name, "n/a", "no reward yet")
    return Check(name, "ok", f"the last {len(recent)} reward(s) take {len(set(recent))} different value(s){groups}")


def check_judge(f: LearningFacts, judge: str | None) -> Check:
    """`judge`: the server's judge model (None: no judge)."""
    name = "the judge answers, and clearly"
    if judge is None:
        return Check(name, "n/a", "no judge (judge = off): rewards come from the API, the CLI or the dashboard")
    total = sum(f.judgements.values())
    failed, done = f.judgements.get("failed", 0), f.judgements.get("done", 0)
    unclear = f.verdicts.get(0, 0)
    fix_failing = (f"check the judge ({judge}): judge_base_url, judge_model, judge_api_key, judge_timeout_s (the "
                   "last error above says which)")
    fix_unclear = ("its votes tie or name no verdict: use a stronger judge model, an odd number of judge_votes, "
                   "or a lower judge_temperature")
    if total == 0:
        if f.sessions_ended == 0:
            return Check(name, "n/a", "no session has ended yet: the judge reads ended sessions")
        return Check(name, "warn", "the judge has judged no turn yet",
                     "it judges a turn by what came next (the user's reply, a tool's result): one-call sessions, "
                     "and a session's last answer, get no verdict")
    error = f"; the last error: {f.last_vote_error}" if f.last_vote_error else ""
    votes = f" ({f.vote_errors} of the last {f.votes} votes failed{error})" if f.vote_errors else ""
    tally = (f"{done} of the last {total} turn(s) judged: {f.verdicts.get(1, 0)} accepted, {f.verdicts.get(-1, 0)} "
             f"corrected, {unclear} unclear; {failed} failed{votes}")
    if failed and done == 0:
        return Check(name, "blocks", f"the judge failed on every one of the last {failed} turn(s){votes}", fix_failing)
    if done and unclear == done:
        return Check(name, "blocks", f"every verdict was unclear: {tally}", fix_unclear)
    if failed or f.vote_errors:
        return Check(name, "warn", tally, fix_failing)
    if unclear * 2 >= done:
        return Check(name, "warn", tally, fix_unclear)
    return Check(name, "ok", tally)


def check_dropped(f: LearningFacts) -> Check:
    name = "samples are trained, not dropped"
    left = f.left_queue
    if not left:
        return Check(name, "n/a", "no turn has left the training queue yet")
    other = {k: n for k, n in left.items() if k not in ("trained", "no_reward", "no_signal")}
    words = ", ".join(f"{n} {k}" for k, n in sorted(left.items(), key=lambda kv: -kv[1]))
    figure = f"{_left_words(left)}: {words}"
    if not other:
        return Check(name, "ok", figure)
    change = "; ".join(f"{k}: {DROP_FIXES.get(k, 'see docs/training.md')}" for k in other)
    return Check(name, "warn" if left.get("trained") else "blocks", figure, change)


def check_steps(f: LearningFacts, status: dict[str, Any] | None) -> Check:
    name = "training steps succeed"
    if status is not None and status.get("trainer") is None:
        return Check(name, "blocks", "training is off on this server (--no-train, train = false, or a backend that "
                                     "only serves)", "start it with training on (`clawbridge up` trains by default)")
    if not f.recent_steps:
        waiting = ((status or {}).get("trainer") or {}).get("waiting")
        if waiting:
            from clawbridge.cli.status import waiting_line

            return Check(name, "n/a", f"no step yet; {waiting_line(waiting)}")
        return Check(name, "n/a", "no step yet")
    step, last, error = f.recent_steps[0]
    failed = sum(1 for _, st, _ in f.recent_steps if st == "failed")
    if last == "failed":
        return Check(name, "blocks", f"the last step ({step}) failed: {error}; {failed} of the last "
                                     f"{len(f.recent_steps)} failed",
                     "read the error (and the server's log); `clawbridge status` shows the steps")
    if failed:
        return Check(name, "warn", f"{failed} of the last {len(f.recent_steps)} steps failed (the last ok: step "
                                   f"{step}); {f.steps_ok} ok in all", "read their errors: `clawbridge status`")
    return Check(name, "ok", f"the last {len(f.recent_steps)} step(s) succeeded; {f.steps_ok} in all")


def check_gate(f: LearningFacts, status: dict[str, Any] | None) -> Check:
    name = "the gate keeps what was trained"
    promotion = (status or {}).get("promotion")
    held = (promotion or {}).get("held_version")
    if held is not None:
        return Check(name, "blocks", f"a rollback to v{held} holds training", "`clawbridge resume` when you want "
                                                                              "training to go on from it")
    if not f.decisions:
        mode = (promotion or {}).get("mode")
        return Check(name, "n/a", "no version gated yet" + (f" (promotion: {mode})" if mode else ""))
    rejected = [v for v, verdict, _ in f.decisions if verdict == "rejected"]
    run = 0
    for _, verdict, _ in f.decisions:
        if verdict != "rejected":
            break
        run += 1
    last_reason = f.decisions[0][2]
    change = ("each new version lost what the gate checks: lower learning_rate (smaller steps), keep kl_coef > 0, "
              "or look at `clawbridge eval`; `clawbridge promote N` serves one anyway")
    if last_reason.startswith(GUARD_REASON):  # a guard binds: every step trains on from the edge
        setting = next((g.setting for g in GUARDS if f"({g.setting})" in last_reason), FACTS.setting)
        serving = (promotion or {}).get("serving_version")
        scale = (promotion or {}).get("step_scale") or {}
        shorter = (f" (the trainer already steps at {scale['words']}; a smaller step_backoff_floor goes shorter)"
                   if scale.get("scale", 1.0) < 1 else "")
        change = (f"the serving version has used all the drift the likelihood guard allows ({setting}), "
                  f"and each step trains on from it, so every new version goes past the bar{shorter}: `clawbridge "
                  f"promote {'N' if serving is None else serving}` accepts the serving version as the new baseline "
                  f"(the anchor), a larger {setting} allows more drift, a lower learning_rate drifts slower")
    versions = ", ".join(f"v{v}" for v in rejected[:5])
    if run >= 3:
        return Check(name, "blocks", f"the gate rejected the last {run} versions ({versions}); the last reason: "
                                     f"{last_reason}", change)
    if rejected:
        return Check(name, "warn", f"{len(rejected)} of the last {len(f.decisions)} versions were rejected "
                                   f"({versions})", change)
    return Check(name, "ok", f"the last {len(f.decisions)} version(s) were promoted")


def diagnose(status: dict[str, Any] | None, facts: LearningFacts, settings: Settings) -> list[Check]:
    """Every check, in the order a person would mend them. `status` is the server's `/rl/status`
    (None: no server answered)."""
    if status is not None:
        judge = (status.get("judge") or {}).get("judge_model", "on") if status.get("judge") is not None else None
    else:
        judge = None if settings.judge == "off" else (settings.judge_model or settings.judge)
    trainer = (status or {}).get("trainer") or {}
    baseline = str((trainer.get("config") or {}).get("baseline") or settings.baseline)
    checks = []
    if status is None:
        checks.append(Check("the server runs", "blocks", "no clawbridge server answers for this state dir: nothing "
                                                         "is served or trained", "start it: `clawbridge up`"))
    checks += [check_sessions(facts, settings), check_rewards(facts, settings, judge), check_signal(facts, baseline),
               check_judge(facts, judge), check_dropped(facts), check_steps(facts, status),
               check_gate(facts, status)]
    return checks


def blocked(checks: list[Check]) -> bool:
    return any(c.verdict == "blocks" for c in checks)


def report_lines(checks: list[Check]) -> list[str]:
    """What `clawbridge doctor --learning` prints: a verdict, then one line per check (and what to
    change under each that does not hold)."""
    stuck = [c.name for c in checks if c.verdict == "blocks"]
    head = (f"learning is blocked; what does not hold: {'; '.join(stuck)}" if stuck
            else "learning looks healthy" + ("" if all(c.verdict != "warn" for c in checks) else ", with warnings"))
    lines = [head]
    for c in checks:
        lines.append(f"  {c.verdict.upper():<6} {c.name}: {c.figure}")
        if c.change and c.verdict in ("blocks", "warn"):
            lines.append(f"         change: {c.change}")
    return lines


def learning_report(target: Target) -> tuple[list[str], bool]:
    """(the lines to print, whether learning is blocked) for the target's state dir: its running
    server's `/rl/status` if one answers, and the store read-only."""
    from clawbridge.cli.target import NoServer, answer_of, server_request
    from clawbridge.store import DB_FILENAME
    from clawbridge.store.learning import learning_facts

    settings = target.settings
    try:
        status: dict[str, Any] | None = answer_of(server_request(target, "GET", "/rl/status"))
    except NoServer:
        status = None
    db = settings.state_path / DB_FILENAME
    if not db.exists():
        return [f"learning is blocked: no store at {db} yet (start the server: `clawbridge up`)"], True
    checks = diagnose(status, learning_facts(db, time.time()), settings)
    note = f"  (recent = the newest {RECENT} of each: turns, judgements, votes, rewards)"
    return [*report_lines(checks), note], blocked(checks)
