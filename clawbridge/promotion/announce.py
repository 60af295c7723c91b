"""What `clawbridge up` says at start-up about the gate and rehearsal, in words.

Invariant: a line never promises what this backend cannot do. The likelihood guard and rehearsal
both score given tokens under a version's own weights (`clawbridge.serving.sampler.SequenceScorer`:
the local torch engine, Tinker); where the sampler cannot (a Fireworks deployment, SGLang), the line
says they are off and why, as the promoter's log does when it first meets them.
"""

from __future__ import annotations

from clawbridge.config import Settings

NO_SCORER = "this backend's sampler cannot score given tokens"
"""Why the likelihood guard and rehearsal are off where the sampler is not a `SequenceScorer`."""


def rehearsal_words(settings: Settings, scores: bool) -> str:
    """The training line's words on rehearsal ('' when the settings turn it off)."""
    if settings.rehearsal_coef <= 0 or settings.promotion_mode == "off":
        return ""
    if not scores:
        return f", no rehearsal ({NO_SCORER})"
    return f", rehearsal of known facts {settings.rehearsal_coef:g}"


def promotion_line(settings: Settings, scores: bool) -> str:
    """What `clawbridge up` says about promotion; `scores`: whether the backend's sampler scores
    given tokens (module invariant)."""
    mode = settings.promotion_mode
    bars = [f"of the base's {what} within {nats:g} nats/token" for what, nats in
            (("correct answers", settings.capability_probe_nats),
             ("everyday answers (plain and in an agent's context)", settings.everyday_guard_nats))
            if nats > 0]
    likely = f"its likelihood {' and '.join(bars)}" if bars and scores else ""
    content = (f", and only if its everyday answers in the agent's own context still talk about the question within "
               f"{settings.content_check_slack} item(s)" if settings.content_check else "")
    floor = (f"; and only if it keeps the built-in capability probe within {settings.capability_probe_slack} item(s)"
             f"{' and ' + likely if likely else ''}{content}" if settings.capability_probe else "")
    unguarded = f"; no likelihood guard: {NO_SCORER}" if settings.capability_probe and bars and not scores else ""
    if mode == "off":
        return ("promotion: off (every trained version serves at once, even one that lost capability; the default "
                "gate is promotion_mode = auto: docs/promotion.md)")
    if mode == "probe":
        return ("promotion: probe (a new version serves only if it still answers the built-in capability probe within "
                f"{settings.capability_probe_slack} item(s) of the serving version and the base{', and ' + likely if likely else ''}"
                f"{content}{unguarded}; name your own eval set, CLAWBRIDGE_EVAL_SET, to gate on it too; `clawbridge status` "
                "shows decisions)")
    if mode == "eval":
        where = settings.eval_set or f"{settings.held_out_share:.0%} held-out sessions"
        return (f"promotion: eval (a new version serves only if not worse on {where}{floor}{unguarded}; "
                "`clawbridge status` shows decisions)")
    return (f"promotion: canary (a new version answers {settings.canary_share:.0%} of new sessions until a sequential "
            f"test of their rewards promotes or rolls it back{floor}{unguarded})")


def lanes_line(settings: Settings, scores: bool) -> str | None:
    """What `clawbridge up` says about users' adapters and the gate (None without them)."""
    if not settings.per_user_adapters or not settings.train:
        return None
    rehearses = scores and settings.rehearsal_coef > 0 and settings.promotion_mode != "off"
    kept = f"; their steps add the shared policy's rehearsal of known facts {settings.rehearsal_coef:g}" \
        if rehearses else ""
    if settings.promotion_mode == "off":
        return f"users' adapters: each serves its user once trained (promotion is off){kept}"
    return (f"users' adapters: each serves its user once trained, not gated (promotion gates the shared policy)"
            f"{kept}; docs/users.md")
