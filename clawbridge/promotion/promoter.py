"""`Promoter`: which committed version serves plain requests, and when a new one may.

Modes (`promotion_mode`):
- off: every version the trainer publishes serves at once (the router follows the backend);
  the store's serving version follows it, so turning promotion on later starts from it.
- probe (what `auto` means without an eval set): a version a step committed is a CANDIDATE; before
  the next step it must pass the built-in capability probe (`clawbridge.promotion.capability`)
  within `capability_probe_slack` items of the serving version and the anchor, and (where the
  sampler scores given tokens) the likelihood guards (`clawbridge.promotion.likelihood`: the
  anchor's correct probe answers, its everyday answers plain and in an agent's context) and the
  content check (`clawbridge.promotion.content`: everyday answers in the agent's own latest context
  still talk about their question), else it is rejected as below. Never worse by default, with
  nothing written by the user.
- eval: a version a step committed is a CANDIDATE. Before the next step it is evaluated
  (`clawbridge.promotion.runner`) beside the serving version on the eval set (or held-out
  sessions) and PROMOTED when `score >= serving score - tolerance` (and, with a tolerance, within it
  of the anchor version too, so promotions cannot drift down step by step), else REJECTED: the serving
  version stays and the trainer resumes from its committed state (weights and optimizer, a
  `rollback` version of it), so training goes on from what serves.
- The capability probe is also a floor in eval and canary modes (unless `capability_probe` is off):
  a candidate that fails it is rejected whatever else it scores, and never goes on canary.
- canary: the candidate answers `canary_share` of NEW sessions (sticky, `VersionRouter`); the
  trainer waits while it is on trial; the rewards of its sessions and of the incumbent's
  (explicit, else judged) are compared by the anytime-valid sequential test of
  `clawbridge.promotion.stats` (its error rates hold however often it looks) until it promotes or
  rolls back.

Invariants:
- Plain traffic moves only through `VersionRouter.set_serving` (pinned to the serving version
  whenever the backend can serve a version besides the one it published: `pinned`). A backend that
  cannot (Fireworks' deployment, SGLang with full weights) serves the candidate from its publish
  until the decision; a rejection then publishes the serving version's weights again.
- All decisions come from the store, never from memory: `settle()` (run by the trainer loop under
  its lock, before any step) looks at what the trainer holds (the published version, through
  rollback/restore versions to the step version whose weights it carries) and the store's
  decisions. The same trainer state in the same store gives the same action, so a `kill -9`
  anywhere (before the evaluation, between it and the decision, between the decision and the
  rollback) ends, after restart, with exactly the last promoted version serving and each candidate
  decided once (`PromotionStore.decide` refuses a second automatic decision).
- A server that does not train (`--no-train`) starts serving the store's serving version, not a
  newer candidate (`promoted_version`): nothing would ever decide that candidate.
- The serving version's checkpoint is never pruned, nor the base's nor the drift guard's anchor's
  (`VersionStore.prunable`).
- The baseline (`start_baseline`, from start-up) evaluates the serving version on the fixed sets
  and builds the guards' reference sets of its answers, before any candidate: the first decision
  then only scores the candidate.
- Written in parts: a candidate's checks make one decision (`clawbridge.promotion.checks`), the
  guards' reference sets and the rehearsal sets are built once per anchor
  (`likelihood.GuardReferences`, `rehearsal.RehearsalSets`), the admin's promote / rollback /
  resume act on this promoter (`clawbridge.promotion.admin`) and status reads it
  (`clawbridge.promotion.report`); the state (serving, hold, canary) lives here only.
- Promotion serves the shared policy: it reads only the shared lane's versions (a `VersionStore`
  is bound to its lane), so a user's adapter never serves everyone; the admin rolls a user's lane
  back through `clawbridge.trainer.lanes.UserLanes.rollback` (`clawbridge.proxy.promotion_routes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from clawbridge.access import OPERATOR
from clawbridge.promotion.backoff import FULL, WINDOW, StepScale, step_scale
from clawbridge.promotion.capability import capability_probe, probe_tolerance
from clawbridge.promotion.checks import Check, decision_of
from clawbridge.promotion.content import agent_context, content_set
from clawbridge.promotion.evalset import (
    EvalSet,
    EvalSetError,
    held_out,
    held_out_set,
    load_eval_set,
)
from clawbridge.promotion.everyday import everyday_set, in_context_set
from clawbridge.promotion.likelihood import (
    EVERYDAY,
    FACTS,
    GUARD_REASON,
    GUARDS,
    IN_CONTEXT,
    Guard,
    GuardReferences,
    nats_of,
    nats_tolerance,
)
from clawbridge.promotion.rehearsal import Rehearsal, RehearsalSets
from clawbridge.promotion.runner import Evaluator, VersionEval, VersionScorer
from clawbridge.promotion.stats import CanaryTest, canary_test
from clawbridge.rewards.judge import VoteConfig
from clawbridge.runtime.faults import fault_point
from clawbridge.serving.versions import VersionedServing, VersionNotFound, VersionRouter
from clawbridge.store import Store
from clawbridge.store.promotion import Decision, PromotionStore, Verdict
from clawbridge.store.versions import VersionStore

if TYPE_CHECKING:
    from clawbridge.chat.chatformat import ChatFormat
    from clawbridge.config import Settings
    from clawbridge.rewards.judge import JudgeModel

log = logging.getLogger("clawbridge.promotion")

NOISY_TOLERANCE = 0.05
"""Default tolerance for rubric sets, held-out sessions and canary rewards."""


HELD_PREFIX = "rolled back to v"


class PromotionError(ValueError):
    """An admin action that cannot be done (unknown or pruned version): answered 404."""

    status = 404
    code = "model_not_found"


class CheckpointUnavailable(PromotionError):
    """The store keeps the version's checkpoint but the backend could not load it (e.g. a hosted
    service lost it): nothing changed; answered 409."""

    status = 409
    code = "checkpoint_unavailable"


def held_words(version: int) -> str:
    """Why training waits while the admin's rollback holds (`clawbridge.promotion.admin`)."""
    return (f"{HELD_PREFIX}{version} by the admin: v{version} keeps serving and no training step runs until "
            "`clawbridge resume`")


@dataclass(frozen=True)
class Settled:
    """What the trainer loop must do before its next step."""

    hold: str | None = None
    """Why no step may run now (a candidate on trial), or None."""
    resume_from: int | None = None
    """Reload the trainer from this committed version first (a rejected candidate's trainer state)."""
    step: StepScale = FULL
    """The next step's learning-rate scale (`clawbridge.promotion.backoff`)."""


class Promoter:
    """Promotion for one running server (module invariants)."""

    def __init__(self, settings: Settings, store: Store, router: VersionRouter, evaluator: VersionScorer) -> None:
        self.settings = settings
        self.mode = settings.promotion_mode
        self.store = store
        self.pstore = PromotionStore(store)
        self.versions = VersionStore(store)
        self.router = router
        self.evaluator = evaluator
        self.eval_file: EvalSet | None = (
            load_eval_set(settings.eval_set, settings.eval_max_tokens) if settings.eval_set else None)
        """The user's eval set (loaded once at start-up: a bad line refuses to start)."""
        self.probe: EvalSet | None = (
            capability_probe(settings.capability_probe_max_tokens)
            if self.mode != "off" and (settings.capability_probe or self.mode == "probe") else None)
        """The built-in capability probe: the whole check in probe mode, a floor in eval and canary."""
        self.everyday: EvalSet | None = everyday_set() if self.probe is not None else None
        """The everyday guard's questions (`clawbridge.promotion.everyday`): with the probe only."""
        self.in_context: EvalSet | None = in_context_set(settings.notes_place) if self.probe is not None else None
        """The same questions in an agent's context (a profile and a note): with the probe only."""
        self.pinned = isinstance(router.backend, VersionedServing)
        """The router pins plain traffic to the serving version (module invariants)."""
        self.serving: int = router.published_version
        self.hold: str | None = None
        self.canary: CanaryTest | None = None
        self.eval_seconds: dict[int, float] = {}
        """Seconds each version's evaluation took (since start-up)."""
        self._retry_at = 0.0
        self._failures = 0
        self.baseline_done = False
        """The serving version's figures on the fixed sets are cached (`_baseline`)."""
        self._baseline_task: asyncio.Task[None] | None = None
        self._baseline_lock = asyncio.Lock()
        self._canary_at = 0.0
        self.references = GuardReferences(
            evaluator, {g: q for g, q in ((FACTS, self.probe), (EVERYDAY, self.everyday), (IN_CONTEXT, self.in_context))
                        if q is not None},
            settings.eval_max_tokens)
        """Each likelihood guard's reference set per anchor (`_guarded`)."""
        self.content_digest: str | None = None
        """The digest of the content check's set the last decision used (status reads its figures)."""
        self.rehearsals = RehearsalSets(evaluator, settings.capability_probe_max_tokens, settings.rehearsal_items)
        """The rehearsal set per anchor (`rehearsal`)."""

    @property
    def probe_tolerance(self) -> float:
        """The probe's tolerance: `capability_probe_slack` of its items."""
        return probe_tolerance(self.probe, self.settings.capability_probe_slack) if self.probe is not None else 0.0

    @property
    def tolerance(self) -> float:
        if self.mode == "probe":
            return self.probe_tolerance
        if self.settings.promotion_tolerance is not None:
            return self.settings.promotion_tolerance
        if self.mode == "eval" and self.eval_file is not None and self.eval_file.regex_only:
            return 0.0
        return NOISY_TOLERANCE

    # ------------------------------------------------------------------ start-up
    async def recover(self) -> None:
        """At start-up, after the trainer's checkpoint was restored: serve the store's serving
        version (the last promoted), and put a canary candidate back on trial."""
        if self.eval_file is not None and self.eval_file.needs_judge and self.evaluator.judge is None:
            raise EvalSetError(f"{self.eval_file.source}: rubric lines need a judge (set judge = endpoint or base)")
        state = await self._read(self.pstore.state)
        published = self.router.published_version
        if self.mode == "off":
            self.serving = published
            await self._read(self.pstore.set_state, "off", published)
            return
        if self.mode == "canary" and not self.pinned:
            raise PromotionError(f"promotion_mode canary needs a backend that serves two versions at once; the "
                                 f"{self.router.backend.name} backend serves only the version it published "
                                 "(use promotion_mode eval)")
        serving = state.serving_version if state is not None and state.mode != "off" else None
        if serving is None or not await self.servable(serving):
            if serving is not None:
                log.error("promotion: the serving version v%d cannot be served any more; serving v%d", serving, published)
            serving = published
        self.serving = serving
        if self.pinned and serving != published:
            try:
                await self.router.sampler_for(serving, OPERATOR, "serve")
            except VersionNotFound as exc:
                self.pinned = False
                log.warning("promotion: the %s backend cannot serve v%d beside the published v%d (%s); a candidate "
                            "will serve from its publish until it is decided", self.router.backend.name, serving,
                            published, exc)
        self.router.set_serving(serving if self.pinned else None)
        candidate = state.candidate_version if state is not None and self.mode == "canary" else None
        await self._read(self.pstore.set_state, self.mode, serving, candidate,
                         state.candidate_since if candidate is not None and state is not None else None,
                         self.settings.canary_share if candidate is not None else None)
        if candidate is not None:
            self.router.set_candidate(candidate, self.settings.canary_share)
        log.info("promotion %s: serving v%d%s%s", self.mode, serving, "" if self.pinned else
                 " (the backend serves one version: candidates serve until decided)",
                 f", v{candidate} on canary" if candidate is not None else "")

    def held_out(self, session_id: str) -> bool:
        """Whether this session's turns are kept out of training to evaluate versions."""
        return self.mode == "eval" and self.eval_file is None and held_out(session_id, self.settings.held_out_share)

    # ------------------------------------------------------------------ the trainer's gate
    async def settle(self) -> Settled:
        """Decide what is pending (module invariants); run by the trainer loop before each step.
        While the admin's rollback holds (`PromotionStore.release_hold`), it holds training. With
        it comes the next step's learning-rate scale, from the decisions so far."""
        settled = await self._settle()
        return replace(settled, step=await self._read(self.step_scale))

    async def rehearsal(self) -> Rehearsal | None:
        """The anchor's rehearsal set, built once per anchor (`clawbridge.promotion.rehearsal`);
        None when off, or while the anchor's probe figures are not yet in the store. Asked by a
        step that trains (after `settle`), never by an idle loop: building it generates."""
        if self.mode == "off" or self.settings.rehearsal_coef <= 0:
            return None
        anchor = await self._read(self.anchor_version)
        if not self.rehearsals.decided(anchor) and self.probe is not None:
            known = await self._read(self.pstore.cached_eval, anchor, self.probe.digest)
            if known is None:
                return None  # the anchor's probe figures come with the first decision (or the baseline): wait for them
            return await self.rehearsals.get(anchor, self._nothing_to_lose(known, "probe facts", "keep"))
        return await self.rehearsals.get(anchor, None)

    def step_scale(self) -> StepScale:
        """The next step's learning-rate scale from the store's decisions (`clawbridge.promotion.backoff`)."""
        if self.mode == "off" or self.settings.step_backoff >= 1.0:
            return FULL
        return step_scale(self.pstore.verdicts(WINDOW), self.settings.step_backoff, self.settings.step_backoff_floor)

    async def _settle(self) -> Settled:
        state = await self._read(self.pstore.state)
        if state is not None and state.held_version is not None:
            self.hold = held_words(state.held_version)
            return Settled(hold=self.hold)
        if self.hold is not None and self.hold.startswith(HELD_PREFIX):
            self.hold = None
        published = self.router.published_version
        if self.mode == "off":
            if published != self.serving:
                self.serving = published
                await self._read(self.pstore.set_state, "off", published)
            return Settled()
        held = await self._read(self.weights_of, published)
        if held == await self._read(self.weights_of, self.serving):
            self.hold = None
            if not self.pinned and not self.baseline_done:
                # a backend that serves only its newest publish could never evaluate the serving
                # version once a candidate is published: its figures come first
                self.hold = f"evaluating the serving v{self.serving} before the first step"
                await self._baseline()
                self.hold = None if self.baseline_done else self.hold
                return Settled(hold=self.hold)
            return Settled()
        last = await self._read(self.pstore.last_decision, held)
        if last is not None:  # decided, and what the trainer holds is not what serves
            self.hold = None
            return Settled(resume_from=self.serving)
        if time.monotonic() < self._retry_at:
            return Settled(hold=self.hold)
        try:
            decision = await (self._canary(held) if self.mode == "canary" else self._evaluate(held))
        except Exception as exc:
            self._failures += 1
            wait = min(60.0, 2.0 ** self._failures)
            self._retry_at = time.monotonic() + wait
            self.hold = f"deciding candidate v{held} failed ({type(exc).__name__}: {exc}); retrying in {wait:.0f} s"
            log.error("promotion: %s", self.hold)
            return Settled(hold=self.hold)
        self._failures = 0
        if decision is None:
            return Settled(hold=self.hold)
        await fault_point("promotion.evaluated")
        return await self._apply(decision)

    async def _apply(self, d: Decision) -> Settled:
        taken = await self._read(self.pstore.decide, d, self.mode)
        await fault_point("promotion.decided")
        if not taken:  # decided by an earlier process: apply what the store says
            prior = await self._read(self.pstore.decision_for, d.version)
            assert prior is not None
            d = prior
        self.router.set_candidate(None)
        self.canary = None
        self.hold = None
        if d.verdict == "promoted":
            self.serving = d.version
            self.router.set_serving(d.version if self.pinned else None)
            log.info("promotion: v%d promoted (serving it now; was v%s): %s", d.version, d.incumbent_version, d.reason)
            return Settled()
        log.warning("promotion: v%d rejected, v%d keeps serving and training resumes from it: %s",
                    d.version, self.serving, d.reason)
        return Settled(resume_from=self.serving)

    def start_baseline(self) -> None:
        """Evaluate the serving version on the fixed sets and build the guards' reference sets of
        its answers in the background, from start-up, while the engine is usually still idle
        (`_baseline`): `up` never waits for it, and the first decision finds them made."""
        if self.mode != "off" and self._baseline_task is None:
            self._baseline_task = asyncio.get_running_loop().create_task(self._baseline(), name="promotion-baseline")

    async def stop(self) -> None:
        """Cancel a baseline evaluation still running (at shutdown)."""
        task, self._baseline_task = self._baseline_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def _baseline(self, attempts: int = 6) -> None:
        """Evaluate the serving version on the fixed sets (the probe, the user's file) while it is
        the one the backend publishes, before any candidate: its figures are cached, so a backend
        that serves only its newest publish (Fireworks, SGLang with full weights) can still compare
        a candidate with it later, and status shows "still good?" from the start. Once per version
        and set, never under the trainer's lock (a backend that serves two versions trains
        meanwhile); a failure is retried with backoff."""
        async with self._baseline_lock:
            for attempt in range(attempts):
                try:
                    for es in (self.probe, self.eval_file if self.mode == "eval" else None):
                        if self.serving != self.router.published_version:
                            return  # a candidate came first: its decision evaluates the serving version
                        if es is not None and await self._read(self.pstore.cached_eval, self.serving,
                                                               es.digest) is None:
                            await self.evaluate(self.serving, es)
                    for guard in GUARDS:  # the anchor's reference answers: the first decision's longest part
                        if self.serving != self.router.published_version:
                            return
                        built = await self._references(guard)
                        if built is not None and built[0] == self.serving:
                            await self.evaluate(self.serving, built[1])
                    self.baseline_done = True
                    return
                except Exception as exc:
                    log.warning("promotion: evaluating the serving v%d failed (%s: %s)%s", self.serving,
                                type(exc).__name__, exc, "; retrying" if attempt + 1 < attempts else "")
                    if attempt + 1 < attempts:
                        await asyncio.sleep(min(60.0, 2.0 ** attempt))

    # ------------------------------------------------------------------ eval mode
    def eval_set(self) -> EvalSet:
        """The set versions are scored on now: the probe (probe mode), the user's file, else the
        held-out sessions."""
        if self.mode == "probe" and self.probe is not None:
            return self.probe
        if self.eval_file is not None:
            return self.eval_file
        return held_out_set(self.store, self.settings.eval_max_items, self.settings.eval_max_tokens)

    async def evaluate(self, version: int, eval_set: EvalSet | None = None) -> VersionEval:
        """`version`'s figures on `eval_set` (default: `eval_set()`), from the cache when known."""
        es = eval_set if eval_set is not None else await self._read(self.eval_set)
        cached = await self._read(self.pstore.cached_eval, version, es.digest)
        if cached is not None:
            return VersionEval.from_dict(cached)
        result = await self.evaluator.evaluate(version, es)
        self.eval_seconds[version] = result.seconds
        await self._read(self.pstore.save_eval, version, es.digest, result.as_dict())
        log.info("promotion: evaluated v%d on %s: pass rate %.3f (%d/%d), score %.3f in %.1f s", version, es.source,
                 result.pass_rate, result.passed, result.items, result.score, result.seconds)
        return result

    async def _evaluate(self, candidate: int) -> Decision:
        self.hold = f"evaluating candidate v{candidate} against the serving v{self.serving}"
        es = await self._read(self.eval_set)
        if not es.items:
            return Decision(candidate, "promoted", "eval", "no evaluation items yet (no held-out session has a "
                            "verdict): promoted unevaluated", self.serving)
        main = await self._check(candidate, es, self.tolerance)
        checks = [main]
        if self.probe is not None and es is not self.probe:
            checks.append(await self._check(candidate, self.probe, self.probe_tolerance))
        checks += await self._guards(candidate)
        checks += await self._content(candidate)
        return decision_of(candidate, self.serving, checks)

    async def _content(self, candidate: int) -> list[Check]:
        """The content check (`clawbridge.promotion.content`), when on: `candidate`'s everyday answers
        in the agent's latest context, on topic within `content_check_slack` of the serving version's
        and the anchor's."""
        s = self.settings
        if self.probe is None or not s.content_check or not self.pinned:
            return []  # unpinned: the serving version cannot answer a new context once a candidate is published
        anchor = await self._read(self.anchor_version)
        known = await self._read(self.pstore.cached_eval, anchor, self.probe.digest)
        if self._nothing_to_lose(known, "probe items", "lose") is not None:
            return []  # a model that knows nothing (a random tiny one) has no answers to keep, as with the guards
        context = await self._read(agent_context, self.store, s.per_user_adapters, s.notes)
        if context is None:  # no recorded call, so no context to ask in (and nothing trained on yet)
            return []
        es = content_set(context, s.notes_place)
        self.content_digest = es.digest
        return [await self._check(candidate, es, probe_tolerance(es, s.content_check_slack))]

    async def _guards(self, candidate: int) -> list[Check]:
        """The likelihood guards that are on, in order (`GUARDS`)."""
        checks = [await self._guarded(candidate, guard) for guard in GUARDS]
        return [c for c in checks if c is not None]

    async def _guarded(self, candidate: int, guard: Guard) -> Check | None:
        """A likelihood guard (`clawbridge.promotion.likelihood`): `candidate` within its bar per
        token of the anchor's reference answers; None when off."""
        built = await self._references(guard)
        if built is None:
            return None
        anchor, refs = built
        nats = guard.bar(self.settings)
        check = await self._check(candidate, refs, nats_tolerance(nats))
        if check.score is None:
            return check
        verb = "within" if check.passed else "beyond"
        return replace(check, reason=(
            f"{GUARD_REASON} v{anchor}'s {len(refs.items)} {guard.answers} {nats_of(check.score):+.3f} "
            f"nats per token, {verb} the bar of -{nats:g} ({guard.setting})"))

    async def _references(self, guard: Guard) -> tuple[int, EvalSet] | None:
        """(anchor, `guard`'s reference set of the anchor's answers), built at the first ask: the
        baseline's, from start-up, so that the first decision does not wait for the anchor's
        answers, and a backend that serves only its newest publish still has them; None when off."""
        if self.probe is None or guard.bar(self.settings) <= 0 or not self.references.on(guard):
            return None
        anchor = await self._read(self.anchor_version)
        nothing_to_lose = None
        if not self.references.decided(guard, anchor):
            known = await self._read(self.pstore.cached_eval, anchor, self.probe.digest)
            nothing_to_lose = self._nothing_to_lose(known, "probe items", "lose")
        refs = await self.references.get(guard, anchor, nothing_to_lose)
        return None if refs is None else (anchor, refs)

    def _nothing_to_lose(self, known: dict[str, Any] | None, what: str, verb: str) -> str | None:
        """Why the anchor, by its probe figures `known`, knows too little to guard or rehearse
        (it passes no more than the slack); None when it knows something, or is not yet measured."""
        if known is None or float(known["score"]) > self.probe_tolerance:
            return None
        return f"it answers {known['passed']} of {known['items']} {what}: nothing to {verb}"

    async def _check(self, candidate: int, es: EvalSet, tol: float) -> Check:
        """`candidate` against the serving version (and the anchor, with a tolerance) on `es`. A
        check that cannot fail is not run: when the floor is at or below 0 (the serving version and
        the anchor pass nothing, e.g. a random tiny model on the probe) the candidate passes
        unevaluated, so such a model pays for the probe once, not per version. The probe protects
        what the anchor knows: when the anchor passes no more than the slack, nothing is evaluated
        (the serving version may be one promoted so, never evaluated itself)."""
        if es is self.probe:
            anchor_version = await self._read(self.pstore.anchor_version)
            anchor_version = self.serving if anchor_version is None else anchor_version
            task = self._baseline_task
            if task is not None and not task.done():  # the start-up evaluation is on it: wait, never twice
                await asyncio.shield(task)
            known = await self._read(self.pstore.cached_eval, anchor_version, es.digest)
            if known is not None and float(known["score"]) <= tol:
                return Check(es.source, True, f"anchor v{anchor_version} answers {known['passed']} of {known['items']} "
                             f"on {es.source}: nothing to lose, not evaluated", None, float(known["score"]),
                             {"anchor": known, "tolerance": tol})
        inc = await self.evaluate(self.serving, es)
        figures: dict[str, Any] = {"incumbent": inc.as_dict(), "tolerance": tol}
        floor, against = inc.score - tol, f"serving v{self.serving}'s {inc.score:.3f}"
        anchor = await self._anchor(es, tol)
        if anchor is not None and anchor[1] is None:
            figures["anchor_unavailable"] = anchor[0]
        elif anchor is not None and anchor[1] is not None:
            figures["anchor"] = anchor[1].as_dict()
            if anchor[1].score - tol > floor:
                floor, against = anchor[1].score - tol, f"anchor v{anchor[0]}'s {anchor[1].score:.3f}"
        if floor <= 0:
            return Check(es.source, True, f"{against} on {es.source} leaves nothing to lose: not evaluated",
                         None, inc.score, figures)
        cand = await self.evaluate(candidate, es)
        figures["candidate"] = cand.as_dict()
        passed = cand.score >= floor
        cmp = ">=" if passed else "<"
        shown = [i.split("/", 1)[-1] for i in cand.failed[:5]]  # a content item without its context's turn id
        failed = f"; failed: {', '.join(shown)}" if not passed and shown else ""
        reason = (f"score {cand.score:.3f} ({cand.passed}/{cand.items} passed) {cmp} {against} - tolerance "
                  f"{tol:.3g} on {es.source}{failed}")
        return Check(es.source, passed, reason, cand.score, inc.score, figures)

    async def _anchor(self, es: EvalSet, tol: float) -> tuple[int, VersionEval | None] | None:
        """The drift guard's anchor and its figures, when it binds: with a tolerance, each promotion
        may lose up to `tol` against the serving version, so a chain of them could drift far below
        where the gate started; a candidate must also score within `tol` of the anchor
        (`PromotionStore.anchor_version`). None with tolerance 0 (the chain cannot drop then) or
        when the anchor serves. Retention never prunes the anchor's checkpoint; one pruned before
        that rule (an older state dir) gives (anchor, None), said in the log and the decision's
        figures, never silently."""
        anchor = await self._read(self.pstore.anchor_version)
        if tol <= 0 or anchor is None or anchor == self.serving:
            return None
        cached = await self._read(self.pstore.cached_eval, anchor, es.digest)
        if cached is None and not await self.servable(anchor):
            log.warning("promotion: the drift guard's anchor v%d has no checkpoint left and no evaluation on %s; "
                        "candidates are compared with the serving version only", anchor, es.source)
            return anchor, None
        return anchor, await self.evaluate(anchor, es)

    # ------------------------------------------------------------------ canary mode
    async def _canary(self, candidate: int) -> Decision | None:
        share = self.settings.canary_share
        if self.router.candidate_version != candidate and self.probe is not None:
            probe = await self._check(candidate, self.probe, self.probe_tolerance)
            checks = [probe, *await self._guards(candidate), *await self._content(candidate)]
            if not all(c.passed for c in checks):  # a floor: a candidate that lost capability never answers anyone
                return decision_of(candidate, self.serving, checks)
        if self.router.candidate_version != candidate:
            since = self.store.clock.now()
            await self._read(self.pstore.set_state, self.mode, self.serving, candidate, since, share)
            self.router.set_candidate(candidate, share)
            self.hold = f"candidate v{candidate} answers {share:.0%} of new sessions (canary) until the test decides"
            log.info("promotion: %s", self.hold)
            return None
        if time.monotonic() < self._canary_at:
            return None
        self._canary_at = time.monotonic() + self.settings.promotion_poll_interval_s
        state = await self._read(self.pstore.state)
        since = state.candidate_since if state is not None and state.candidate_since is not None else 0.0
        outcomes = await self._read(self.pstore.canary_outcomes, candidate, self.serving, since)
        s = self.settings
        test = canary_test(outcomes[candidate], outcomes[self.serving], share=share, tolerance=self.tolerance,
                           min_sessions=s.canary_min_sessions, max_sessions=s.canary_max_sessions,
                           confidence=s.canary_confidence)
        cn, cw, inn, iw = test.cand_n, test.cand_successes, test.inc_n, test.inc_successes
        self.canary = test
        self.hold = f"canary of v{candidate}: {test.why}"
        if test.outcome == "continue":
            return None
        verdict: Verdict = "promoted" if test.outcome == "promote" else "rejected"
        figures = {"canary": test.as_dict(), "tolerance": self.tolerance, "share": share}
        return Decision(candidate, verdict, "canary", test.why, self.serving,
                        cw / cn if cn else None, iw / inn if inn else None, figures)

    # ------------------------------------------------------------------ status (`clawbridge.promotion.report`)
    @property
    def measuring(self) -> bool:
        """Whether the start-up evaluation of the serving version is still running."""
        return self._baseline_task is not None and not self._baseline_task.done()

    def anchor_version(self) -> int:
        """The drift guard's anchor (`_anchor`): the serving version before any decision."""
        anchor = self.pstore.anchor_version()
        return self.serving if anchor is None else anchor

    def pending_candidate(self) -> int | None:
        held = self.weights_of(self.router.published_version)
        return held if held != self.weights_of(self.serving) else None

    # ------------------------------------------------------------------ helpers
    def weights_of(self, version: int) -> int:
        """The step (or base) version whose weights `version` serves: through rollback and
        restore versions to their source."""
        seen = 0
        while seen < 10_000:
            row = self.versions.get(version)
            if row is None or row.kind not in ("rollback", "restore") or row.source_version is None:
                return version
            version = row.source_version
            seen += 1
        return version

    async def servable(self, version: int) -> bool:
        if version == self.router.published_version:
            return True
        row = await self._read(self.versions.get, version)
        return row is not None and row.restorable

    @staticmethod
    async def _read(fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)


def promoted_version(settings: Settings, store: Store) -> int | None:
    """The version a server that does not train serves at start-up: the last promoted (the store's
    serving version) when promotion is on, so a candidate that was rejected or never decided does
    not serve from a backend that publishes one version only (Fireworks, SGLang with full weights);
    None (the newest committed) when promotion is off."""
    if settings.promotion_mode == "off":
        return None
    state = PromotionStore(store).state()
    return state.serving_version if state is not None and state.mode != "off" else None


def build_promoter(settings: Settings, store: Store, router: VersionRouter, renderer: ChatFormat,
                   judge: JudgeModel | None) -> Promoter:
    """The promoter of a server (`recover()` it before serving); `EvalSetError` for a bad eval set."""
    votes = VoteConfig(votes=settings.judge_votes, temperature=settings.judge_temperature,
                       max_tokens=settings.judge_max_tokens)
    evaluator = Evaluator(router, renderer, judge, settings.eval_max_tokens, votes=votes)
    return Promoter(settings, store, router, evaluator)
