"""How a candidate is checked before it may serve: against the serving version and the drift
guard's anchor on one set (`compare`), and by the likelihood guards that are on (`guards`).

Invariants:
- A check reads and writes only cached evaluations (`Promoter.evaluate`): the same version on the
  same set is evaluated once, whichever decision asks first, and the start-up evaluation of the
  serving version is waited for, never run twice.
- A check that cannot fail is not run: when the floor (the serving version's score, or the
  anchor's, less the tolerance) is at or below 0, the candidate passes unevaluated and says so.
- The probe protects what the anchor knows: an anchor that passes no more than the slack leaves
  nothing to lose, and neither the probe nor a guard built on it evaluates anything.
- Every figure a check used goes into its `Check.figures` (incumbent, anchor, candidate,
  tolerance), and an anchor with no checkpoint and no cached figures is named there and in the
  log, never skipped silently.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from clawbridge.promotion.checks import Check
from clawbridge.promotion.likelihood import GUARD_REASON, GUARDS, Guard, nats_of, nats_tolerance

if TYPE_CHECKING:
    from clawbridge.promotion.evalset import EvalSet
    from clawbridge.promotion.promoter import Promoter
    from clawbridge.promotion.runner import VersionEval

log = logging.getLogger("clawbridge.promotion")


async def compare(p: Promoter, candidate: int, es: EvalSet, tol: float) -> Check:
    """`candidate` against the serving version (and the anchor, with a tolerance) on `es`
    (module invariants)."""
    if es is p.probe:
        anchor_version = await asyncio.to_thread(p.pstore.anchor_version)
        anchor_version = p.serving if anchor_version is None else anchor_version
        await p.baseline_finished()  # the start-up evaluation may be on it: wait, never twice
        known = await asyncio.to_thread(p.pstore.cached_eval, anchor_version, es.digest)
        if known is not None and float(known["score"]) <= tol:
            return Check(es.source, True, f"anchor v{anchor_version} answers {known['passed']} of {known['items']} "
                         f"on {es.source}: nothing to lose, not evaluated", None, float(known["score"]),
                         {"anchor": known, "tolerance": tol})
    inc = await p.evaluate(p.serving, es)
    figures: dict[str, Any] = {"incumbent": inc.as_dict(), "tolerance": tol}
    floor, against = inc.score - tol, f"serving v{p.serving}'s {inc.score:.3f}"
    anchor = await _anchor(p, es, tol)
    if anchor is not None and anchor[1] is None:
        figures["anchor_unavailable"] = anchor[0]
    elif anchor is not None and anchor[1] is not None:
        figures["anchor"] = anchor[1].as_dict()
        if anchor[1].score - tol > floor:
            floor, against = anchor[1].score - tol, f"anchor v{anchor[0]}'s {anchor[1].score:.3f}"
    if floor <= 0:
        return Check(es.source, True, f"{against} on {es.source} leaves nothing to lose: not evaluated",
                     None, inc.score, figures)
    cand = await p.evaluate(candidate, es)
    figures["candidate"] = cand.as_dict()
    passed = cand.score >= floor
    cmp = ">=" if passed else "<"
    failed = f"; failed: {', '.join(cand.failed[:5])}" if not passed and cand.failed else ""
    reason = (f"score {cand.score:.3f} ({cand.passed}/{cand.items} passed) {cmp} {against} - tolerance "
              f"{tol:.3g} on {es.source}{failed}")
    return Check(es.source, passed, reason, cand.score, inc.score, figures)


async def _anchor(p: Promoter, es: EvalSet, tol: float) -> tuple[int, VersionEval | None] | None:
    """The drift guard's anchor and its figures, when it binds: with a tolerance, each promotion
    may lose up to `tol` against the serving version, so a chain of them could drift far below
    where the gate started; a candidate must also score within `tol` of the anchor
    (`PromotionStore.anchor_version`). None with tolerance 0 (the chain cannot drop then) or
    when the anchor serves. Retention never prunes the anchor's checkpoint; one pruned before
    that rule (an older state dir) gives (anchor, None), said in the log and the decision's
    figures, never silently."""
    anchor = await asyncio.to_thread(p.pstore.anchor_version)
    if tol <= 0 or anchor is None or anchor == p.serving:
        return None
    cached = await asyncio.to_thread(p.pstore.cached_eval, anchor, es.digest)
    if cached is None and not await p.servable(anchor):
        log.warning("promotion: the drift guard's anchor v%d has no checkpoint left and no evaluation on %s; "
                    "candidates are compared with the serving version only", anchor, es.source)
        return anchor, None
    return anchor, await p.evaluate(anchor, es)


async def guards(p: Promoter, candidate: int) -> list[Check]:
    """The likelihood guards that are on, in order (`GUARDS`)."""
    checks = [await guarded(p, candidate, guard) for guard in GUARDS]
    return [c for c in checks if c is not None]


async def guarded(p: Promoter, candidate: int, guard: Guard) -> Check | None:
    """A likelihood guard (`clawbridge.promotion.likelihood`): `candidate` within its bar per
    token of the anchor's reference answers; None when off."""
    nats = guard.bar(p.settings)
    if p.probe is None or nats <= 0 or not p.references.on(guard):
        return None
    anchor = await asyncio.to_thread(p.anchor_version)
    nothing_to_lose = None
    if not p.references.decided(guard, anchor):
        known = await asyncio.to_thread(p.pstore.cached_eval, anchor, p.probe.digest)
        nothing_to_lose = p.nothing_to_lose(known, "probe items", "lose")
    refs = await p.references.get(guard, anchor, nothing_to_lose)
    if refs is None:
        return None
    check = await compare(p, candidate, refs, nats_tolerance(nats))
    if check.score is None:
        return check
    verb = "within" if check.passed else "beyond"
    return replace(check, reason=(
        f"{GUARD_REASON} v{anchor}'s {len(refs.items)} {guard.answers} {nats_of(check.score):+.3f} "
        f"nats per token, {verb} the bar of -{nats:g} ({guard.setting})"))
