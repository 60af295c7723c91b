"""`RewardWorker`: the background task that turns ended sessions into judge verdicts and teacher scores.

Runs as one asyncio task beside the proxy (`start()` / `stop()`, from the app lifespan like the
trainer loop). Per ended session: extract next states, judge every main turn that has one, score
the hinted turns with the teacher (OPD), then `finish_session` (which makes it trainable).

Invariants:
- Off the request path: the worker only reads committed turns of ENDED sessions; store calls run
  in worker threads (`asyncio.to_thread`), judge calls are async HTTP (or base-model sampling).
  Serving bound: at most `concurrency` judge calls are in flight at any time (one semaphore over
  every vote of every turn); with `judge=base` on a backend whose base model shares the serving
  engine (SGLang without adapters), that is at most `concurrency` of its slots, never more. The
  local torch backend judges and scores on a separate base-model copy, sharing no slot.
- Exactly once: a turn whose judgement is `done` is never judged again, across restarts. A
  judgement left `running` by a killed process is reset at `start()` (`recover_interrupted`) and
  judged again. A turn whose votes ALL failed is retried (backoff) up to `max_attempts` times,
  then left without a verdict so its session can still finish.
- With a privacy guard that filters the judge, each judge prompt is masked once before its votes
  are sent (`clawbridge.privacy`); the votes stored are the judge's answers to the masked prompt.
- A session is finished only when every main turn with a next state is done or given up; teacher
  scoring failures are logged and leave that turn RL-only.
- A verdict of -1 with a rewrite of a text answer (no tool calls) is stored with the verdict; the
  rewrite is turned into demonstration ids and scored by the base model before the session is
  finished, like the teacher (`clawbridge.rewards.rewrites`); a failure leaves the turn without one.
- With notes on, a verdict of -1 with a hint becomes a note of the session's user before the
  session is finished, so a session that starts after it was judged carries it
  (`clawbridge.rewards.notes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clawbridge.config import Settings, default_of
from clawbridge.rewards.judge import (
    JudgementFailedWithVotes,
    JudgeModel,
    Verdict,
    VoteConfig,
    judge_messages,
    judge_turn,
    last_user_text,
)
from clawbridge.rewards.next_state import TurnView, extract_next_states, turn_view
from clawbridge.rewards.notes import CHECK_META, NoteBook
from clawbridge.rewards.opd import reference_input, request_tools, teacher_input
from clawbridge.rewards.rewrites import rewrite_ids, rewrite_input
from clawbridge.runtime.background import Background
from clawbridge.store import Store
from clawbridge.store.notes import Note
from clawbridge.store.rewards import RewardStore
from clawbridge.store.turns import StoredTurn

if TYPE_CHECKING:
    from clawbridge.backend import LogprobScorer, ServingBackend
    from clawbridge.chat.render import Renderer
    from clawbridge.privacy.guard import PrivacyGuard

log = logging.getLogger("clawbridge.rewards")

NOTES_REFRESH_S = 5.0
"""How often the worker reloads the notes book (which users' notes are trained enough for checks)."""


@dataclass(frozen=True)
class WorkerConfig:
    """The judge worker's options (`Settings`' rewards section, see `from_settings`)."""

    votes: VoteConfig = field(default_factory=VoteConfig)
    concurrency: int = default_of("judge_concurrency")
    """Judge calls in flight at once (the serving bound)."""
    max_attempts: int = default_of("judge_max_attempts")
    """Judge a turn at most this many times when all its votes fail."""
    poll_interval_s: float = default_of("judge_poll_interval_s")
    opd: bool = default_of("method") != "rl"
    """Score hinted turns with the teacher (needs a scorer and a renderer)."""
    rewrites: bool = default_of("rewrite_coef") > 0
    """Keep the judge's rewrites of corrected answers and score them as demonstrations."""
    sessions_per_pass: int = 8
    retry_backoff_s: float = 2.0
    """A session with failed judgements is retried after this, doubling per attempt."""

    @classmethod
    def from_settings(cls, s: Settings) -> WorkerConfig:
        return cls(
            votes=VoteConfig(votes=s.judge_votes, temperature=s.judge_temperature,
                             max_tokens=s.judge_max_tokens, retries=s.judge_retries),
            concurrency=s.judge_concurrency, max_attempts=s.judge_max_attempts,
            poll_interval_s=s.judge_poll_interval_s, opd=s.method != "rl", rewrites=s.rewrite_coef > 0,
        )


class RewardWorker:
    """Judges ended sessions in the background (see module invariants)."""

    def __init__(self, store: Store, judge: JudgeModel, config: WorkerConfig | None = None,
                 renderer: Renderer | None = None, scorer: LogprobScorer | None = None,
                 privacy: PrivacyGuard | None = None, notes: NoteBook | None = None) -> None:
        self.rstore = RewardStore(store)
        self.notes = notes
        """Users' notes from talk: a correction's hint becomes one (`clawbridge.rewards.notes`)."""
        self._notes_refreshed = float("-inf")
        self.privacy = privacy if privacy is not None and privacy.judge else None
        """Masks each judge prompt before it is sent (`clawbridge.privacy`); None: off."""
        self.clock = store.clock
        """Retry backoff and poll waits run on the store's clock (`clawbridge.runtime.clock`)."""
        self.judge = judge
        self.config = config or WorkerConfig()
        self.renderer = renderer
        self.scorer = scorer
        self.slots = asyncio.Semaphore(self.config.concurrency)
        """Bounds judge calls in flight (every vote of every turn)."""
        self.in_flight_max = 0
        """The most judge calls ever in flight at once (for the serving-bound check)."""
        self._in_flight = 0
        self._retry_at: dict[str, float] = {}
        self.background = Background("clawbridge-judge", self.clock)
        """The worker's task (start / stop / notify)."""
        self._recovered = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Recover interrupted judgements, then start the background task (idempotent)."""
        if self.background.running:
            return
        await self._recover()
        self.background.start(self._run)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop; judgements cut short stay `running` and are judged again after a restart."""
        if self.background.task is None:
            return
        await self.background.stop(timeout_s, cancel_first=True)
        close = getattr(self.judge, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()

    def notify(self) -> None:
        """Look for ended sessions now instead of at the next poll."""
        self.background.notify()

    @property
    def running(self) -> bool:
        return self.background.running

    async def _recover(self) -> None:
        if not self._recovered:
            n = await asyncio.to_thread(self.rstore.recover_interrupted)
            if n:
                log.warning("%d judgement(s) were interrupted by a restart; judging them again", n)
            self._recovered = True

    async def _run(self) -> None:
        while not self.background.stopping:
            try:
                await self.run_once()
            except Exception:
                log.exception("judge pass failed; retrying")
            await self.background.sleep(self.config.poll_interval_s)

    # ------------------------------------------------------------------ work
    async def run_once(self) -> int:
        """Process the pending ended sessions once; returns how many were finished."""
        await self._recover()
        now = self.clock.monotonic()
        if self.notes is not None and now - self._notes_refreshed >= NOTES_REFRESH_S:
            self._notes_refreshed = now  # which users' notes are trained enough for check sessions
            await asyncio.to_thread(self.notes.refresh)
        pending = await asyncio.to_thread(self.rstore.pending_sessions, self.config.sessions_per_pass * 4)
        todo = [s for s in pending if self._retry_at.get(s, 0.0) <= now][: self.config.sessions_per_pass]
        done = await asyncio.gather(*(self.process_session(s) for s in todo))
        return sum(done)

    async def process_session(self, session_id: str) -> bool:
        """Judge (and teacher-score) one ended session; True once it is finished."""
        turns = await asyncio.to_thread(self.rstore.transcript, session_id)
        views = {t.turn_id: _view(t) for t in turns}
        states = extract_next_states(list(views.values()))
        await asyncio.to_thread(
            self.rstore.save_next_states, session_id,
            {tid: (s.kind, s.messages, s.from_turn_id) for tid, s in states.items()},
        )
        known = await asyncio.to_thread(self.rstore.judgement_states, list(states))
        todo: list[str] = []
        for tid in states:
            status, attempt = known.get(tid, ("new", 0))
            if status == "done":
                continue
            if status == "failed" and attempt >= self.config.max_attempts:
                continue  # given up: no verdict for this turn
            todo.append(tid)
        results = await asyncio.gather(
            *(self._judge_one(session_id, views[tid], states[tid].messages) for tid in todo)
        )
        open_left = not all(results)
        if self.config.opd and self.scorer is not None and self.renderer is not None:
            await self._score_hinted(session_id, {t.turn_id: t for t in turns})
        if self.config.rewrites and self.scorer is not None and self.renderer is not None:
            await self._score_rewrites(session_id, {t.turn_id: t for t in turns})
        if open_left:
            attempt = max((known.get(t, ("", 0))[1] for t in todo), default=0) + 1
            self._retry_at[session_id] = self.clock.monotonic() + self.config.retry_backoff_s * 2 ** min(attempt, 6)
            return False
        self._retry_at.pop(session_id, None)
        n = await asyncio.to_thread(self.rstore.finish_session, session_id)
        log.info("judged session %s: %d verdict(s)", session_id, n)
        return True

    async def _judge_one(self, session_id: str, view: TurnView, next_state: list[dict[str, Any]]) -> bool:
        """Judge one turn; True when it needs no more work (done, or failed for the last time)."""
        attempt = await asyncio.to_thread(self.rstore.begin_judgement, view.turn_id, session_id, self.judge.name)
        user, noted, notes = "", None, []
        if self.notes is not None:  # the judge sees the user's notes, to say a correction asks for one again
            user, noted = await asyncio.to_thread(self.rstore.turn_notes_context, session_id, view.turn_id)
            notes = self.notes.active_of(user)
        messages = judge_messages(last_user_text(view.messages), view.answer, next_state, [n.text for n in notes],
                                  rewrite=self.config.rewrites)
        if self.privacy is not None:
            messages = self.privacy.mask_messages(messages)
        try:
            verdict = await judge_turn(_Counting(self.judge, self), messages, self.config.votes, self.slots,
                                       n_notes=len(notes))
        except JudgementFailedWithVotes as exc:
            log.warning("judging %s failed (attempt %d): %s", view.turn_id, attempt, exc)
            await asyncio.to_thread(self.rstore.fail_judgement, view.turn_id, attempt, exc.votes, str(exc))
            return attempt >= self.config.max_attempts  # given up: the session may finish
        rewrite = verdict.rewrite if self.config.rewrites and not view.answer.get("tool_calls") else None
        await asyncio.to_thread(
            self.rstore.finish_judgement, view.turn_id, attempt, verdict.votes, float(verdict.score),
            verdict.mean_vote, verdict.hint, rewrite,
        )
        if self.notes is not None:
            same = notes[verdict.same - 1] if verdict.same is not None else None
            await asyncio.to_thread(self._take_notes, user, noted, view.turn_id, verdict, same)
        return True

    def _take_notes(self, user: str, noted: Any, turn_id: str, verdict: Verdict, same: Note | None) -> None:
        """A correction's hint becomes a note of the session's user, or counts on the note the judge
        said it asks for again (`same`); a judged check session may retire their notes
        (`clawbridge.rewards.notes`)."""
        assert self.notes is not None
        if verdict.score < 0 and (verdict.hint or same is not None):
            self.notes.add_from_hint(user, verdict.hint or "", turn_id, same_as=same)
        elif noted == CHECK_META:
            self.notes.observe_check(user)

    async def _score_hinted(self, session_id: str, turns: dict[str, StoredTurn]) -> None:
        assert self.scorer is not None and self.renderer is not None
        hints = await asyncio.to_thread(self.rstore.hints, session_id)
        scored = await asyncio.to_thread(self.rstore.has_teacher, list(hints))
        want = [(tid, h) for tid, h in hints.items() if tid not in scored and tid in turns]
        if not want:
            return
        try:
            inputs = []
            for tid, hint in want:
                t = turns[tid]
                tools, choice = request_tools(t.request, t.api)
                msgs = _view(t).messages
                inputs.append(await asyncio.to_thread(
                    teacher_input, self.renderer, msgs, tools, choice, hint, t.completion_ids))
            # A turn served with notes is also scored on the plain prompt it trains on: the reference
            # its teacher is measured against (the rules of `clawbridge.rewards.opd`).
            noted = [tid for tid, _ in want if turns[tid].train_prompt_ids is not None]
            refs = [reference_input(turns[tid].trained_prompt_ids, turns[tid].completion_ids) for tid in noted]
            every = inputs + refs
            lps = await self.scorer.compute_logprobs([i.tokens for i in every], [i.prompt_len for i in every])
        except Exception:
            log.exception("teacher scoring failed for session %s; its turns stay RL-only", session_id)
            return
        if len(lps) != len(every):
            log.error("the scorer returned %d results for %d sequences of session %s; its turns stay RL-only",
                      len(lps), len(every), session_id)
            return
        reference = dict(zip(noted, lps[len(inputs):], strict=True))
        for (tid, _), inp, lp in zip(want, inputs, lps[:len(inputs)], strict=True):
            n = len(turns[tid].completion_ids)
            ref = reference.get(tid)
            if len(lp) != n or (ref is not None and len(ref) != n):
                log.error("teacher returned %d logprobs (reference %s) for %d tokens of %s; skipped", len(lp),
                          None if ref is None else len(ref), n, tid)
                continue
            await asyncio.to_thread(self.rstore.save_teacher_logprobs, tid, lp, inp.prompt_len, ref)

    async def _score_rewrites(self, session_id: str, turns: dict[str, StoredTurn]) -> None:
        """The session's rewrites as demonstration ids, with the base model's logprobs of them."""
        assert self.scorer is not None and self.renderer is not None
        texts = await asyncio.to_thread(self.rstore.unscored_rewrites, session_id)
        todo = []
        for tid, text in texts.items():
            t = turns.get(tid)
            inp = None if t is None else rewrite_input(self.renderer, t.trained_prompt_ids, text, t.completion_ids)
            if inp is not None:
                todo.append((tid, inp))
        if not todo:
            return
        try:
            lps = await self.scorer.compute_logprobs([i.tokens for _, i in todo], [i.prompt_len for _, i in todo])
        except Exception:
            log.exception("scoring rewrites failed for session %s; its turns get no demonstration", session_id)
            return
        for (tid, inp), lp in zip(todo, lps, strict=True):
            ids = rewrite_ids(inp)
            if len(lp) != len(ids):
                log.error("the scorer returned %d logprobs for the %d ids of %s's rewrite; skipped", len(lp),
                          len(ids), tid)
                continue
            await asyncio.to_thread(self.rstore.save_rewrite_tokens, tid, ids, lp)

    def status(self) -> dict[str, Any]:
        return {"running": self.running, "judge_model": self.judge.name, "concurrency": self.config.concurrency,
                "in_flight_max": self.in_flight_max, **self.rstore.stats()}


class _Counting:
    """Wraps a JudgeModel to track calls in flight (asserted by tests against the bound)."""

    def __init__(self, inner: JudgeModel, worker: RewardWorker) -> None:
        self.inner, self.worker, self.name = inner, worker, inner.name

    async def complete(self, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int,
                       seed: int | None = None) -> str:
        w = self.worker
        w._in_flight += 1
        w.in_flight_max = max(w.in_flight_max, w._in_flight)
        try:
            return await self.inner.complete(messages, temperature=temperature, max_tokens=max_tokens, seed=seed)
        finally:
            w._in_flight -= 1


def _view(t: StoredTurn) -> TurnView:
    return turn_view(t.turn_id, t.seq, t.turn_type, t.request, t.response, t.api)


async def build_reward_worker(settings: Settings, store: Store, backend: ServingBackend,
                              renderer: Renderer, privacy: PrivacyGuard | None = None,
                              notes: NoteBook | None = None) -> RewardWorker | None:
    """The worker `settings.judge` asks for (None when off); raises ValueError on a bad setup."""
    from clawbridge.backend import LogprobScorer
    from clawbridge.rewards.judge import BaseModelJudge, OpenAIJudge

    if settings.judge == "off":
        return None
    judge: JudgeModel
    if settings.judge == "endpoint":
        if not settings.judge_base_url or not settings.judge_model:
            raise ValueError("judge=endpoint needs judge_base_url and judge_model")
        key = settings.judge_api_key.get_secret_value() if settings.judge_api_key else None
        judge = OpenAIJudge(settings.judge_base_url, settings.judge_model, key, settings.judge_timeout_s)
    else:
        base = getattr(backend, "base_sampler", None)
        if base is None:
            raise ValueError(f"judge=base: the {backend.name} backend has no base-model sampler; use judge=endpoint")
        judge = BaseModelJudge(await base(), renderer, name=f"base:{settings.model_name}")
    scorer = backend if isinstance(backend, LogprobScorer) else None
    if settings.method != "rl" and scorer is None:
        log.warning("method %s: the %s backend cannot score logprobs; turns get no OPD part",
                    settings.method, backend.name)
    return RewardWorker(store, judge, WorkerConfig.from_settings(settings), renderer, scorer, privacy, notes)
