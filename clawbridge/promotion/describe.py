"""Promotion in words: what `clawbridge status` prints and the dashboard shows, from the
`/rl/status` promotion object (`report.promotion_status`, or the store's when no server runs)."""

from __future__ import annotations

from typing import Any


def promotion_lines(p: dict[str, Any] | None) -> list[str]:
    """What `clawbridge status` (and the dashboard) say about promotion, in words."""
    if not p:
        return []
    held = p.get("held_version")
    if held is not None:
        hold = [f"  rollback holds: v{held} serves and training waits until `clawbridge resume` (rolled back by "
                "the admin; later versions are then trained from it and gated as the mode says)"]
    else:
        hold = []
    if p["mode"] == "off" and not p["decisions"]:
        return [f"promotion: off: every trained version serves at once (serving v{p['serving_version']})", *hold]
    head = f"promotion: {p['mode']}"
    if p.get("eval_set"):
        head += f" on {p['eval_set']}"
    if p.get("tolerance") is not None:
        anchor = (f" against the serving version and anchor v{p['anchor_version']}"
                  if p.get("anchor_version") is not None else "")
        head += f" (tolerance {p['tolerance']:g}{anchor})"
    head += f": serving v{p['serving_version']}"
    head += (f"; candidate v{p['candidate_version']} on trial" if p.get("candidate_version") is not None
             else "; no candidate on trial")
    lines = [head, *hold]
    probe = p.get("capability_probe")
    if probe:
        lines.append("  " + probe_line(probe))
    if p.get("holding") and held is None:
        lines.append(f"  training waits: {p['holding']}")
    scale = p.get("step_scale")
    if scale and scale["scale"] < 1:
        lines.append(f"  next step at {scale['words']}: a rejected step was too far from the serving version, so "
                     "the next is shorter; each promotion lengthens it again (step_backoff)")
    rehearsal = p.get("rehearsal")
    if rehearsal:
        lines.append(f"  rehearsing {min(rehearsal['per_step'], rehearsal['answers'])} of anchor v{rehearsal['anchor']}'s "
                     f"{rehearsal['answers']} correct answers to built-in facts beside each step, so the preference "
                     f"costs less of what it knew (rehearsal_coef {rehearsal['coef']:g})")
    for d in p["decisions"][:5]:
        if d["source"] == "admin":
            lines.append(f"  v{d['version']} {d['verdict']} by the admin: {d['reason']}")
            continue
        scores = ""
        if d["score"] is not None and d["incumbent_score"] is not None:
            scores = f" (score {d['score']:.3f} vs v{d['incumbent_version']}'s {d['incumbent_score']:.3f})"
        lines.append(f"  v{d['version']} {d['verdict']}{scores}: {d['reason']}")
    if p.get("rejected_samples"):
        lines.append(f"  {p['rejected_samples']} trained turn(s) built rejected versions (kept, marked, never "
                     "trained again)")
    return lines


def probe_line(probe: dict[str, Any]) -> str:
    """"Still good?" in one line: the capability probe of the serving version against the anchor."""
    serving, anchor = probe.get("serving"), probe.get("anchor")
    if serving is None:
        return f"capability probe ({probe['items']} facts): the serving version is being evaluated"
    line = f"capability probe: serving v{serving['version']} answers {serving['passed']} of {serving['items']} facts"
    if anchor is not None:
        diff = serving["passed"] - anchor["passed"]
        line += f" (anchor v{anchor['version']}: {anchor['passed']}; {diff:+d})"
    if serving.get("failed"):
        line += f"; misses {', '.join(serving['failed'][:5])}"
    return line


def still_good_line(p: dict[str, Any] | None) -> str | None:
    """"Still good?" in words: the capability probe of the serving version against the base (and
    the gate's anchor, when that is another version), from `/rl/status`' `promotion` object; None
    when the probe is off."""
    probe = (p or {}).get("capability_probe")
    if not probe:
        return None
    assert p is not None
    serving, base, anchor = probe.get("serving"), probe.get("base"), probe.get("anchor")
    slack = int(probe.get("slack_items") or 0)
    items = probe["items"]
    if serving is None:
        if base is not None and base["passed"] <= slack:  # the promoter's rule: such a check cannot fail
            known = "none" if base["passed"] == 0 else f"{base['passed']} (within the {slack}-fact slack)"
            return (f"still good? nothing to lose: the base v0 answers {known} of the {items} probe facts, so "
                    "trained versions are not probed (a version cannot lose more facts than the slack allows)")
        if probe.get("measuring"):
            return (f"still good? measuring now: the capability probe ({items} facts) runs on the serving "
                    f"v{p.get('serving_version')} in the background (started with the server)")
        return (f"still good? not measured yet: the capability probe ({items} facts) has not run on the serving "
                f"v{p.get('serving_version')}; it runs when a trained version is gated")
    facts = f"{serving['passed']} of {serving['items']} probe facts"
    if serving["version"] == 0:
        return f"still good? the base (v0) serves: {facts}; no trained version serves yet"
    if base is None:
        return f"still good? serving v{serving['version']} answers {facts}; the base was not probed"
    diff = serving["passed"] - base["passed"]
    if diff >= -slack:
        verdict = "yes" if diff >= 0 else "yes, within the slack"
        tail = f" ({diff:+d}; a version may lose {slack} fact(s))"
    else:
        verdict = "no"
        tail = (f" ({diff:+d}, past the {slack}-fact slack: `clawbridge rollback N` serves an earlier version "
                "again)")
    line = f"still good? {verdict}: serving v{serving['version']} answers {facts}, the base v0 {base['passed']}{tail}"
    if anchor is not None and anchor["version"] != 0:
        line += f"; the gate's anchor v{anchor['version']}: {anchor['passed']}"
    likely = probe.get("likelihood")
    if likely and likely.get("serving_nats") is not None:
        line += (f"; likely to say them: {likely['serving_nats']:+.3f} nats per token against anchor "
                 f"v{likely['anchor']}'s {likely['answers']} correct answers (bar -{likely['bar_nats']:g})")
    for key, what in (("everyday", "everyday answers"), ("in_context", "in an agent's context")):
        everyday = probe.get(key)
        if everyday and everyday.get("serving_nats") is not None:
            line += (f"; {what}: {everyday['serving_nats']:+.3f} nats per token against anchor "
                     f"v{everyday['anchor']}'s {everyday['answers']} (bar -{everyday['bar_nats']:g})")
    content = probe.get("content")
    if content:
        anchored = "" if content["anchor"] is None or content["anchor_version"] == serving["version"] else (
            f" (anchor v{content['anchor_version']}: {content['anchor']})")
        line += (f"; on topic in the agent's context: {content['serving']} of {content['items']} everyday "
                 f"answers{anchored}")
    return line
