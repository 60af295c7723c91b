"""Promotion in words: what `clawbridge status` prints and the dashboard shows, from the
`/rl/status` promotion object (`Promoter.status`, or the store's when no server runs)."""

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
