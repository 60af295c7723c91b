"""People teaching their agent by talking, through a running `clawbridge up` (`bench/learn_from_talk.py`).

One run: a `clawbridge up` (any model; SmolLM2 for the figures) with the judge as an endpoint (the
rule-based judge, reading only what happened next), and one or more personas
(`clawbridge.devtools.personas`) who talk to it through the real `openai` SDK in OpenClaw-style
sessions: the agent's system prompt, the person's question, the answer, what the person says to it
(thanks, or what they want instead, in words), the agent's reply; `X-Session-Id`, `X-Turn-Type:
main`, the last call `X-Session-Done`. Nobody sets a reward.

Measured per persona:
- `stable_after`: sessions talked until three in a row showed the preference (their first answers);
- the held-out preference rate before and after (temperature 1, the same seeds), as the person gets
  it (`served`: their notes included) and from the weights alone (`X-Clawbridge-Notes: off`);
- whether the answers still talk about what was asked (`topic.on_topic`, a lexical floor the
  preference's form check does not look at): each held-out answer is kept (`PersonaResult.held_out`)
  with its question, so the share on topic before and after, and of the first answers that met the
  preference, can be read beside the preference rate (`bench/learn_from_talk.py` prints both);
- the capability check (`realdemo.FACTS`, greedy; a set the gate never sees) of the base and of
  every version that served plain calls during the run (`NAME@N`), and sampled (each fact 8 times
  at temperature 1) for the base, the final and the lowest greedy version;
- steps, versions promoted and rejected, notes made and retired, the mean teacher-minus-sampler
  logprob on hinted turns (does the judge's hint move the teacher?), wall time;
- how long the person waited for each first answer (timed at the client, over HTTP), by how the
  answer was made (`answer_kind`): one sample, the best of a noted call's first candidates, or a
  second round after the judge found none of those servable.

Rules: a person talks one session at a time, and starts the next once the judge has read the last
one (a person's next conversation comes minutes later; the judge takes seconds). By default they
then talk on at once, faster than any person, so on a slow machine the trainer falls behind the
talk; with `pace_every` N they also wait, after every N sessions, until the trainer and the gate
have caught up (the minutes between a person's conversations, in which training keeps up). The
measure stays sessions, not seconds. Personas in one run talk at once, each as their own user
(their own key: notes are per user) over the one shared policy (per-user adapters stay as
configured).
"""

from __future__ import annotations

import json
import random
import sqlite3
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from clawbridge.chat.topic import on_topic
from clawbridge.devtools.personas import HELD_OUT_QUESTIONS, PERSONAS, Persona, question_order
from clawbridge.devtools.realdemo import FACTS

Say = Callable[[str], None]
EVAL_CONCURRENCY = 8
"""Evaluation calls in flight at once (the engine batches them; the talking is one call at a time)."""
CAPABILITY_SAMPLES = 8
"""Sampled answers per fact for `TalkResult.sampled_capability`."""


@dataclass(frozen=True)
class TalkConfig:
    """One run's knobs."""

    personas: tuple[str, ...] = ("brief",)
    sessions: int = 32
    """Sessions each persona talks."""
    seed: int = 0
    max_tokens: int = 64
    """Cap on the agent's first answer of a session."""
    reply_max_tokens: int = 16
    """Cap on the agent's answer to what the person said (it has no next state: never judged)."""
    held_out_samples: int = 2
    """Sampled answers per held-out question (temperature 1, fixed seeds)."""
    settings: dict[str, str] = field(default_factory=dict)
    """CLAWBRIDGE_* values for `clawbridge up` beyond the run's own (method, notes, promotion, ...)."""
    judge_wait_s: float = 120.0
    """The longest a person waits for the judge to read their last session."""
    settle_s: float = 900.0
    """After talking: the longest to wait for the judge and the trainer to finish."""
    pace_every: int = 0
    """0: a person starts their next session as soon as the judge has read the last one (back to
    back: the trainer falls behind the talk). N: after every N of their sessions they also wait
    until the trainer has trained what is ready and the gate has decided (`settle`), as when a
    person's next conversation comes minutes later and training keeps up."""


@dataclass
class SessionLog:
    persona: str
    index: int
    question: str
    answer: str
    met: bool
    policy_version: int
    wait_s: float = 0.0
    """Seconds from the request to the first answer, timed at the client."""


@dataclass
class HeldOutAnswer:
    """One answer to a held-out question (never judged, never trained)."""

    question: str
    answer: str
    met: bool
    """Did it meet the persona's preference (`Persona.meets`)?"""


HELD_OUT_WHEN: tuple[str, ...] = ("before", "served", "weights")
"""`PersonaResult.held_out` keys: before talking; after, as the person gets it (notes included);
after, from the weights alone."""


def met_share(answers: Sequence[HeldOutAnswer]) -> float:
    """Share of `answers` that met the preference (0.0 for none)."""
    return sum(a.met for a in answers) / len(answers) if answers else 0.0


def on_topic_share(answers: Sequence[HeldOutAnswer | SessionLog]) -> float | None:
    """Share of `answers` (held-out answers or first answers) that share a content word with their
    question (`topic.on_topic`); None for none."""
    return sum(on_topic(a.question, a.answer) for a in answers) / len(answers) if answers else None


def share_text(x: float | None) -> str:
    """A share as the run's lines print it ("-" for none)."""
    return "-" if x is None else f"{x:.2f}"


@dataclass
class PersonaResult:
    persona: str
    wants: str
    sessions: list[SessionLog] = field(default_factory=list)
    before_rate: float = 0.0
    after_served: float = 0.0
    after_weights: float = 0.0
    held_out: dict[str, list[HeldOutAnswer]] = field(default_factory=dict)
    """The answers the three rates above were measured on, by `HELD_OUT_WHEN`."""
    paced_s: float = 0.0
    """Seconds this person waited for the trainer between sessions (`TalkConfig.pace_every`)."""

    @property
    def stable_after(self) -> int | None:
        return stable_after([s.met for s in sorted(self.sessions, key=lambda s: s.index)])


@dataclass
class TalkResult:
    config: dict[str, Any]
    personas: dict[str, PersonaResult]
    capability_before: float = 0.0
    capability_by_version: dict[int, float] = field(default_factory=dict)
    """Every version that served plain calls during the run, and the final serving one."""
    sampled_capability: dict[int, float] = field(default_factory=dict)
    """The same facts answered `CAPABILITY_SAMPLES` times each at temperature 1, for the base, the
    final version and the lowest greedy one: a greedy check of a small model flips on near-ties
    (SmolLM2's first token for "the capital of France" is "The" 0.152 against "L" 0.140), the
    sampled share says how often a person asking gets the fact."""
    served_versions: list[int] = field(default_factory=list)
    final_version: int = 0
    steps: int = 0
    promoted: int = 0
    rejected: int = 0
    notes: list[dict[str, Any]] = field(default_factory=list)
    teacher_gap: float | None = None
    """Mean OPD gap over the completion tokens of hinted turns: teacher minus sampler, or minus the
    plain-prompt reference for a turn served with notes (`clawbridge.rewards.opd`)."""
    hinted_turns: int = 0
    noted_answers: int = 0
    """Answers served with notes (`note_echoes`), and of them those that echoed the note (never trained)."""
    echoed_answers: int = 0
    first_answer_wait: dict[str, dict[str, float]] = field(default_factory=dict)
    """`answer_kind` -> {"n", "mean_s", "max_s"} over every person's first answers (`wait_by_kind`)."""
    seconds: float = 0.0

    @property
    def capability_min(self) -> float:
        return min(self.capability_by_version.values(), default=self.capability_before)

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["capability_min"] = self.capability_min
        for name, p in self.personas.items():
            out["personas"][name]["stable_after"] = p.stable_after
        return out


def stable_after(met: Sequence[bool], run: int = 3) -> int | None:
    """Sessions talked until `run` in a row met the preference (1-based count), or None."""
    streak = 0
    for i, ok in enumerate(met):
        streak = streak + 1 if ok else 0
        if streak >= run:
            return i + 1
    return None


class Proxy:
    """What the run needs of a running `clawbridge up`."""

    def __init__(self, base: str, admin: str, client: str) -> None:
        self.base, self.admin, self.client = base, admin, client

    def status(self) -> dict[str, Any]:
        r = httpx.get(f"{self.base}/rl/status", headers={"Authorization": f"Bearer {self.admin}"}, timeout=120)
        r.raise_for_status()
        return dict(r.json())

    def openai(self, key: str) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=5, timeout=900)

    def add_user(self, name: str) -> str:
        r = httpx.post(f"{self.base}/rl/users", json={"user": name}, timeout=60,
                       headers={"Authorization": f"Bearer {self.admin}"})
        r.raise_for_status()
        return str(r.json()["api_key"])


def _ask(client: Any, messages: list[dict[str, Any]], max_tokens: int, seed: int | None, headers: dict[str, str],
         model: str = "default") -> tuple[str, int]:
    """(text, policy version) of one call; greedy when `seed` is None."""
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                          temperature=0 if seed is None else 1.0, seed=seed, extra_headers=headers)
    version = int((resp.system_fingerprint or "policy-v0").removeprefix("policy-v"))
    return resp.choices[0].message.content or "", version


def held_out_answers(proxy: Proxy, key: str, persona: Persona, cfg: TalkConfig, notes: bool) -> list[HeldOutAnswer]:
    """Sampled answers to HELD_OUT_QUESTIONS (fixed seeds), each checked against the preference;
    each call its own one-call session (never judged, never trained)."""
    client = proxy.openai(key)
    headers = {} if notes else {"X-Clawbridge-Notes": "off"}
    jobs = [(q, 1_000_003 * cfg.seed + 7919 * k + i) for k in range(cfg.held_out_samples)
            for i, q in enumerate(HELD_OUT_QUESTIONS)]

    def one(job: tuple[str, int]) -> HeldOutAnswer:
        messages = [{"role": "system", "content": persona.system_prompt()}, {"role": "user", "content": job[0]}]
        text = _ask(client, messages, cfg.max_tokens, job[1], headers)[0]
        return HeldOutAnswer(job[0], text, persona.meets(text))

    with ThreadPoolExecutor(EVAL_CONCURRENCY) as pool:  # the engine batches them
        return list(pool.map(one, jobs))


def on_topic_line(pr: PersonaResult) -> str:
    """What a run says of its answers' content (`topic.on_topic`): held-out answers on topic by
    `HELD_OUT_WHEN`, and the first answers that met the preference."""
    shares = {k: on_topic_share(pr.held_out.get(k, [])) for k in HELD_OUT_WHEN}
    met = [s for s in pr.sessions if s.met]
    return (f"on topic: held-out {share_text(shares['before'])} -> {share_text(shares['served'])} "
            f"[{share_text(shares['weights'])}], "
            f"{sum(on_topic(s.question, s.answer) for s in met)} of the {len(met)} first answers that met it")


def capability(proxy: Proxy, version: int | None, samples: int = 0) -> float:
    """Share of FACTS whose answer names the fact (`default@N`, or the serving version): greedy, or
    with `samples` > 0 the share of that many answers per fact at temperature 1 (fixed seeds)."""
    client = proxy.openai(proxy.client)
    model = "default" if version is None else f"default@{version}"
    jobs = [(fact, None) for fact in FACTS] if samples <= 0 else [
        (fact, 7_919 * i + k) for i, fact in enumerate(FACTS) for k in range(samples)]

    def one(job: tuple[tuple[str, tuple[str, ...]], int | None]) -> bool:
        (question, names), seed = job
        text, _ = _ask(client, [{"role": "user", "content": question}], 32, seed, {"X-Clawbridge-Notes": "off"}, model)
        return any(n in text.lower() for n in names)

    with ThreadPoolExecutor(EVAL_CONCURRENCY) as pool:
        hits = sum(pool.map(one, jobs))
    return hits / len(jobs)


def _query(state_dir: Path, sql: str, params: tuple[Any, ...] = ()) -> list[Any] | None:
    """The rows of `sql` on the run's store, opened read-only beside the running server; None when
    there is no store yet or the query fails (a table not created yet)."""
    try:
        db = sqlite3.connect(f"file:{state_dir / 'clawbridge.db'}?mode=ro", uri=True, timeout=30)
    except sqlite3.Error:
        return None
    try:
        return db.execute(sql, params).fetchall()
    except sqlite3.Error:
        return None
    finally:
        db.close()


def session_judged(state_dir: Path, session_id: str) -> bool:
    """Whether the judge has finished `session_id` (read-only look at the store)."""
    rows = _query(state_dir, "SELECT COUNT(*) FROM judgements WHERE session_id IN (?, ?) AND status IN ('done', 'failed')",
                  (session_id, session_id.split(":", 1)[-1]))
    return bool(rows and rows[0][0])


def talk(proxy: Proxy, persona: Persona, key: str, cfg: TalkConfig, result: PersonaResult,
         judged: Callable[[str], bool], say: Say) -> None:
    """One person's sessions, one at a time (module rules)."""
    client = proxy.openai(key)
    rng = random.Random(f"{persona.key}:{cfg.seed}")
    order = question_order(cfg.seed)
    system = {"role": "system", "content": persona.system_prompt()}
    for i in range(cfg.sessions):
        sid = f"{persona.key}-{cfg.seed}-{i}"
        q = {"role": "user", "content": order[i % len(order)]}
        head = {"X-Session-Id": sid, "X-Turn-Type": "main"}
        asked = time.monotonic()
        answer, version = _ask(client, [system, q], cfg.max_tokens, cfg.seed * 100_003 + i, head)
        waited = time.monotonic() - asked
        reply, met = persona.reply(answer, rng)
        _ask(client, [system, q, {"role": "assistant", "content": answer}, {"role": "user", "content": reply}],
             cfg.reply_max_tokens, cfg.seed * 100_003 + i + 7, {**head, "X-Session-Done": "true"})
        result.sessions.append(SessionLog(persona.key, i, q["content"], answer, met, version, waited))
        say(f"{persona.key} session {i + 1}/{cfg.sessions} (v{version}): {'met' if met else 'missed'}: "
            f"{answer[:70]!r} -> {reply!r}")
        stored = sid if key == proxy.client else f"{persona.key}:{sid}"  # a user's ids are in her namespace
        deadline = time.monotonic() + cfg.judge_wait_s
        while not judged(stored) and time.monotonic() < deadline:  # the judge reads it before the next one
            time.sleep(0.5)
        if paced(cfg, i):
            t = time.monotonic()
            settle(proxy, cfg, lambda line: say(f"{persona.key} waiting for the trainer: {line}"))
            result.paced_s += time.monotonic() - t


def paced(cfg: TalkConfig, index: int) -> bool:
    """Whether the person waits for the trainer after session `index` (0-based; never after the last)."""
    return cfg.pace_every > 0 and (index + 1) % cfg.pace_every == 0 and index + 1 < cfg.sessions


def settle(proxy: Proxy, cfg: TalkConfig, say: Say, poll_s: float = 2.0) -> dict[str, Any]:
    """Until the judge is idle and the trainer has trained what it has and the gate decided (or
    `cfg.settle_s` has passed: said, and the last status returned)."""
    deadline = time.monotonic() + cfg.settle_s
    while True:
        st = proxy.status()
        trainer, judge, promo = st.get("trainer") or {}, st.get("judge") or {}, st.get("promotion") or {}
        pending_judge = int((judge.get("judgements") or {}).get("running", 0))
        unrewarded = int((trainer.get("waiting") or {}).get("unrewarded_turns", 0))
        untrained = int(trainer.get("backlog", 0)) - unrewarded
        if not pending_judge and not trainer.get("in_step") and untrained <= 0 and not promo.get("holding"):
            return st
        if time.monotonic() > deadline:
            say(f"not settled after {cfg.settle_s:.0f} s (backlog {untrained}, holding {promo.get('holding')})")
            return st
        time.sleep(poll_s)


def step_counts(state_dir: Path) -> tuple[int, int, int]:
    """(steps that committed, versions the gate promoted, versions it rejected), from the store:
    `/rl/status` lists only the recent decisions, and a paced run makes dozens."""
    steps = _query(state_dir, "SELECT COUNT(*) FROM steps WHERE status = 'ok'")
    verdicts = dict(_query(state_dir, "SELECT verdict, COUNT(*) FROM promotion_decisions WHERE source != 'admin' "
                                      "GROUP BY verdict") or [])
    if not steps:  # no store, or no steps table yet
        return 0, 0, 0
    return int(steps[0][0]), int(verdicts.get("promoted", 0)), int(verdicts.get("rejected", 0))


def teacher_gap(state_dir: Path) -> tuple[float | None, int]:
    """(mean teacher - sampler logprob over hinted turns' completion tokens, the plain-prompt reference
    in place of the sampler on turns served with notes, as OPD uses them; hinted turns scored)."""
    from clawbridge.store.codec import decode_floats

    rows = _query(state_dir, "SELECT COALESCE(tl.reference_logprobs, t.completion_logprobs), tl.logprobs "
                             "FROM teacher_logprobs tl JOIN turns t ON t.turn_id = tl.turn_id")
    if rows is None:
        return None, 0
    gaps = [te - sa for sampler, teacher in rows
            for sa, te in zip(decode_floats(sampler), decode_floats(teacher), strict=False)]
    return (statistics.fmean(gaps) if gaps else None), len(rows)


def base_logprob_by_quarter(state_dir: Path) -> list[float | None]:
    """The base model's mean logprob per token of the answers the judge corrected, over each
    quarter of them in order: the OPD teacher's scores (the base on the plain prompt where the
    turn carried notes, else the base with the hint). Answers a model wrote while it fell apart
    score far lower under the base than the base's own kind of answer (docs/training.md)."""
    from clawbridge.store.codec import decode_floats

    rows = _query(state_dir, "SELECT COALESCE(tl.reference_logprobs, tl.logprobs) FROM teacher_logprobs tl "
                             "JOIN turns t ON t.turn_id = tl.turn_id ORDER BY t.created_at") or []
    size = len(rows) // 4
    out: list[float | None] = []
    for q in range(4):
        part = rows[q * size:(q + 1) * size] if q < 3 else rows[3 * size:]
        values = [x for (blob,) in part for x in decode_floats(blob)]
        out.append(statistics.fmean(values) if values else None)
    return out


def note_echoes(state_dir: Path) -> list[tuple[int, bool]]:
    """(policy version, whether it echoed its note) of every answer served with notes, in order
    (`clawbridge.rewards.notes.echoes_note`, judged again from the stored answer and note texts, so
    a store written before answers were flagged counts the same way)."""
    from clawbridge.rewards.notes import echoes_note

    texts = dict(_query(state_dir, "SELECT note_id, text FROM notes") or [])
    rows = _query(state_dir, "SELECT policy_version, response_json, json_extract(meta_json, '$.notes') FROM turns "
                             "WHERE turn_type = 'main' AND status = 'ok' AND train_prompt_token_ids IS NOT NULL "
                             "ORDER BY created_at") or []
    out = []
    for version, response, ids in rows:
        try:
            answer = json.loads(response)["choices"][0]["message"]["content"] or ""
            hint = " ".join(texts.get(i, "") for i in json.loads(ids))
        except (TypeError, ValueError, KeyError, IndexError):
            continue
        out.append((int(version), echoes_note(answer, hint)))
    return out


ANSWER_KINDS = ("one sample", "best of n", "second round")
"""How a first answer was made: one sample (no notes), the best of a noted call's first candidates
(`clawbridge.serving.best_of`), or those and a second round the judge's miss asked for."""


def answer_kinds(state_dir: Path) -> dict[str, str]:
    """Session id (a user's namespace dropped) -> `ANSWER_KINDS` entry of its first main answer, from
    the store's `meta.best_of` (`resampled` > 0: a second round ran)."""
    rows = _query(state_dir, "SELECT session_id, json_type(meta_json, '$.best_of'), "
                             "json_extract(meta_json, '$.best_of.resampled') FROM turns "
                             "WHERE turn_type = 'main' AND seq = 0") or []
    return {sid.split(":", 1)[-1]: ANSWER_KINDS[2] if again else ANSWER_KINDS[1] if kind == "object" else ANSWER_KINDS[0]
            for sid, kind, again in rows}


def wait_by_kind(sessions: Sequence[SessionLog], kinds: dict[str, str], seed: int) -> dict[str, dict[str, float]]:
    """`answer_kind` -> {"n", "mean_s", "max_s"} of the first answers' client-side waits; a session
    the store does not have (never recorded) counts under "unrecorded"."""
    waits: dict[str, list[float]] = {}
    for s in sessions:
        waits.setdefault(kinds.get(f"{s.persona}-{seed}-{s.index}", "unrecorded"), []).append(s.wait_s)
    return {k: {"n": len(w), "mean_s": statistics.fmean(w), "max_s": max(w)} for k, w in waits.items()}


def run_talk(proxy: Proxy, state_dir: Path, cfg: TalkConfig, say: Say = print) -> TalkResult:
    """Measure before, let the personas talk, settle, measure after (module docstring)."""
    t0 = time.monotonic()
    personas = [PERSONAS[p] for p in cfg.personas]
    together = len(personas) > 1
    keys = {p.key: (proxy.add_user(p.key) if together else proxy.client) for p in personas}
    result = TalkResult(asdict(cfg), {p.key: PersonaResult(p.key, p.wants) for p in personas})
    result.capability_before = capability(proxy, None)
    for p in personas:
        pr = result.personas[p.key]
        pr.held_out["before"] = held_out_answers(proxy, keys[p.key], p, cfg, notes=False)
        pr.before_rate = met_share(pr.held_out["before"])
        say(f"before: {p.key} preference {pr.before_rate:.2f}, on topic {share_text(on_topic_share(pr.held_out['before']))}")
    say(f"before: capability {result.capability_before:.2f}")
    def judged(session_id: str) -> bool:
        return session_judged(state_dir, session_id)

    threads = [threading.Thread(target=talk, args=(proxy, p, keys[p.key], cfg, result.personas[p.key], judged, say))
               for p in personas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    st = settle(proxy, cfg, say)
    promo = st.get("promotion") or {}
    result.steps, result.promoted, result.rejected = step_counts(state_dir)
    serving = promo.get("serving_version")
    result.final_version = int(serving if serving is not None else st.get("policy_version") or 0)
    served = sorted({s.policy_version for p in result.personas.values() for s in p.sessions} | {result.final_version})
    result.served_versions = served
    import openai

    for v in served:
        try:
            result.capability_by_version[v] = result.capability_before if v == 0 else capability(proxy, v)
        except openai.NotFoundError as exc:  # pruned by retention (the bench keeps them; a user's run may not)
            say(f"capability of v{v}: not measured ({exc.message})")
    lowest = min(result.capability_by_version, key=lambda v: (result.capability_by_version[v], -v), default=0)
    for v in sorted({0, result.final_version, lowest}):
        try:
            result.sampled_capability[v] = capability(proxy, v, CAPABILITY_SAMPLES)
        except openai.NotFoundError as exc:
            say(f"sampled capability of v{v}: not measured ({exc.message})")
    say("capability, greedy: " + ", ".join(f"v{v} {c:.2f}" for v, c in sorted(result.capability_by_version.items()))
        + "; sampled: " + ", ".join(f"v{v} {c:.2f}" for v, c in sorted(result.sampled_capability.items())))
    for p in personas:
        pr = result.personas[p.key]
        pr.held_out["served"] = held_out_answers(proxy, keys[p.key], p, cfg, notes=True)
        pr.held_out["weights"] = held_out_answers(proxy, keys[p.key], p, cfg, notes=False)
        pr.after_served, pr.after_weights = met_share(pr.held_out["served"]), met_share(pr.held_out["weights"])
        say(f"after: {p.key} preference served {pr.after_served:.2f}, weights alone {pr.after_weights:.2f}; "
            f"three in a row after {pr.stable_after} sessions; {on_topic_line(pr)}")
    r = httpx.get(f"{proxy.base}/rl/notes", headers={"Authorization": f"Bearer {proxy.admin}"}, timeout=60)
    result.notes = r.json().get("notes", []) if r.status_code == 200 else []
    result.teacher_gap, result.hinted_turns = teacher_gap(state_dir)
    echoes = note_echoes(state_dir)
    result.noted_answers, result.echoed_answers = len(echoes), sum(e for _, e in echoes)
    result.first_answer_wait = wait_by_kind([s for p in result.personas.values() for s in p.sessions],
                                            answer_kinds(state_dir), cfg.seed)
    result.seconds = time.monotonic() - t0
    return result


def save(result: TalkResult, path: Path) -> None:
    path.write_text(json.dumps(result.as_json(), indent=1, default=str))
