"""`/rl/status`' `promotion` object: what the gate is doing and why, read from a `Promoter`.

Invariants:
- Read only: building it changes nothing in the promoter or the store, so status, the dashboard
  and `clawbridge doctor` may call it as often as they like (off the event loop: it reads SQLite).
- Every figure comes from the store's cached evaluations and decisions, never from a new
  evaluation: a figure not measured yet is None, and `describe` says "not measured yet".
- The shape is what `describe.promotion_lines` / `describe.still_good_line` and the dashboard read;
  a key is added, never renamed.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from clawbridge.promotion.likelihood import GUARDS, Guard, nats_of
from clawbridge.promotion.promoter import held_words

if TYPE_CHECKING:
    from clawbridge.promotion.promoter import Promoter


def promotion_status(p: Promoter) -> dict[str, Any]:
    """The `promotion` object of `/rl/status` for `p` (module invariants)."""
    state = p.pstore.state()
    scale = p.step_scale()
    if p.mode == "probe" and p.probe is not None:
        es: str | None = p.probe.source
    else:
        es = p.eval_file.source if p.eval_file is not None else (
            f"held-out sessions ({p.settings.held_out_share:.0%})" if p.mode == "eval" else None)
    return {
        "mode": p.mode,
        "serving_version": p.serving if p.mode != "off" else p.router.serving_version,
        "candidate_version": state.candidate_version if state is not None and p.mode == "canary"
        else (p.pending_candidate() if p.hold else None),
        "pinned": p.pinned,
        "eval_set": es,
        "tolerance": p.tolerance if p.mode != "off" else None,
        "anchor_version": p.anchor_version() if p.mode in ("eval", "probe") and p.tolerance > 0 else None,
        "capability_probe": probe_status(p),
        "holding": p.hold or (held_words(state.held_version) if state is not None
                              and state.held_version is not None else None),
        "held_version": state.held_version if state is not None else None,
        "held_since": state.held_since if state is not None else None,
        "canary": p.canary.as_dict() if p.canary is not None else None,
        "decisions": [d.as_dict() for d in p.pstore.decisions(20)],
        "rejected_samples": p.pstore.rejected_samples(),
        "step_scale": asdict(scale) | {"words": scale.words()},
        "rehearsal": rehearsal_status(p),
        "evaluation_seconds": {str(v): round(s, 3) for v, s in sorted(p.eval_seconds.items())},
    }


def probe_status(p: Promoter) -> dict[str, Any] | None:
    """The capability probe's figures: the serving version's, the anchor's (the base until an admin
    chooses another) and the base's, so a person sees "still good?" at a glance
    (`describe.still_good_line`), with each likelihood guard's. None when the probe is off."""
    probe = p.probe
    if probe is None:
        return None
    anchor = p.anchor_version()

    def score(version: int) -> dict[str, Any] | None:
        cached = p.pstore.cached_eval(version, probe.digest)
        if cached is None:
            return None
        return {"version": version, "passed": cached["passed"], "items": cached["items"],
                "score": cached["score"], "failed": cached["failed"][:10]}

    return {"items": len(probe.items), "slack_items": p.settings.capability_probe_slack,
            "floor": p.mode != "probe", "serving": score(p.serving), "measuring": p.measuring,
            "anchor": score(anchor) if anchor != p.serving else None,
            "base": score(0),  # the shared lane's base is version 0 (`VersionStore.commit_base`)
            **{guard.key: guard_status(p, guard, anchor) for guard in GUARDS},
            "content": content_status(p, anchor)}


def content_status(p: Promoter, anchor: int) -> dict[str, Any] | None:
    """The content check's figures in the context the last decision asked in: how many of the
    serving version's and the anchor's everyday answers talked about their question; None before
    the first decision that ran it (or when it is off)."""
    digest = p.content_digest
    if digest is None or not p.settings.content_check:
        return None
    serving, anchored = p.pstore.cached_eval(p.serving, digest), p.pstore.cached_eval(anchor, digest)
    if serving is None:
        return None
    return {"items": serving["items"], "slack_items": p.settings.content_check_slack, "serving": serving["passed"],
            "anchor_version": anchor, "anchor": anchored["passed"] if anchored is not None else None}


def guard_status(p: Promoter, guard: Guard, anchor: int) -> dict[str, Any] | None:
    """A likelihood guard's figure of the serving version (nats per token against the anchor's
    reference answers), once its reference set is built; None when off."""
    refs = p.references.built(guard, anchor)
    bar = guard.bar(p.settings)
    if refs is None or bar <= 0:
        return None
    cached = p.pstore.cached_eval(p.serving, refs.digest)
    return {"anchor": anchor, "answers": len(refs.items), "bar_nats": bar,
            "serving_nats": nats_of(float(cached["score"])) if cached is not None else None}


def rehearsal_status(p: Promoter) -> dict[str, Any] | None:
    """What rehearsal trains beside each step, once its set is built; None when off."""
    newest = p.rehearsals.built(p.anchor_version()) if p.settings.rehearsal_coef > 0 else None
    if newest is None:
        return None
    return {"anchor": newest.anchor, "answers": len(newest.items), "per_step": p.settings.rehearsal_items,
            "coef": p.settings.rehearsal_coef, "build_seconds": p.rehearsals.build_seconds.get(newest.anchor)}
