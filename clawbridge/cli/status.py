"""`clawbridge status`: ask the running server, fall back to the store."""

from __future__ import annotations

import datetime as dt
from typing import Any

import httpx
from rich.console import Console

from clawbridge.cli.target import Target, admin_key
from clawbridge.config import Settings


def gather_status(target: Target) -> dict[str, Any]:
    """The view of the target's server when one runs on its state dir (`clawbridge.cli.target`),
    else the view of its store; never one server's answers beside another state dir's store."""
    from clawbridge.store import DB_FILENAME, Store

    settings = target.settings
    info: dict[str, Any] = {"state_dir": str(target.state_dir), "state_dir_from": target.chosen_by,
                            "server": None, "running": False}
    health: dict[str, Any] = {}
    if target.server is not None:
        base = target.server.url
        try:
            health = dict(httpx.get(f"{base}/health", timeout=5.0).json())
        except (httpx.HTTPError, ValueError):
            health = {}
    if health:
        info.update(server=base, running=True, model=health.get("model"), backend=health.get("backend"),
                    policy_version=health.get("policy_version"))
        key = admin_key(settings)
        if key:
            try:
                r = httpx.get(f"{base}/rl/status", headers={"Authorization": f"Bearer {key}"}, timeout=5.0)
                if r.status_code == 200:
                    doc = r.json()
                    info["store"] = doc["store"]
                    for part in ("trainer", "privacy", "engine", "users", "lanes", "promotion",
                                 "remote_deletions", "notes"):
                        info[part] = doc.get(part)
            except (httpx.HTTPError, ValueError, KeyError):
                pass
        if health.get("status") == "failing":
            info.setdefault("warnings", []).append(f"the server cannot record turns: {health.get('store')}")
    if "store" not in info:
        path = settings.state_path / DB_FILENAME
        if path.exists():
            from clawbridge.store.deletions import OwedDeletionStore
            from clawbridge.store.training import TrainingStore
            from clawbridge.store.users import UserStore

            store = Store(path)
            try:
                info["store"] = store.stats()
                info["users"] = UserStore(store).stats()
                ts = TrainingStore(store, wait_for_judge=settings.judge != "off")
                info["trainer"] = {**ts.training_stats(),
                                   "waiting": ts.waiting(settings.reward_wait_s, settings.batch_size)}
                info["promotion"] = stored_promotion(store)
                info["notes"] = stored_notes(settings, store)
                info["remote_deletions"] = OwedDeletionStore(store).status()
            finally:
                store.close()
    size = (info.get("store") or {}).get("size_bytes")
    budget = settings.store_budget_bytes
    if isinstance(size, int) and budget and size > budget:
        info.setdefault("warnings", []).append(
            f"the store is {size / 1024**3:.2f} GiB, over store_budget_bytes ({budget / 1024**3:.2f} GiB): export "
            "old sessions (`clawbridge sessions export`) and move the state dir to a bigger disk before it fills")
    return info


def print_status(console: Console, info: dict[str, Any]) -> None:
    if info["running"]:
        console.print(f"server: [green]running[/green] at {info['server']} — model {info.get('model')!r}, "
                      f"backend {info.get('backend')}, serving policy v{info.get('policy_version')}")
    else:
        console.print(f"server: [yellow]not running[/yellow] on state dir {info['state_dir']} (the store's view)")
    for warning in info.get("warnings", []):
        console.print(f"[red]warning:[/red] {warning}", highlight=False)
    s = info.get("store")
    if not s:
        console.print("store: none yet (run `clawbridge up`)")
        return
    last = dt.datetime.fromtimestamp(s["last_turn_at"]).strftime("%Y-%m-%d %H:%M:%S") if s["last_turn_at"] else "-"
    console.print(f"sessions: {s['sessions']['active']} active, {s['sessions']['ended']} ended")
    console.print(f"turns: {s['turns']['main']} main, {s['turns']['side']} side (last at {last}); "
                  f"tokens: {s['prompt_tokens']} prompt, {s['completion_tokens']} completion")
    trained = s["last_trained_policy_version"]
    console.print(f"rewards: {s['rewards']}; training steps: {s['training_steps']}; last trained policy: "
                  + ("none yet (no training step has run)" if trained is None else f"v{trained}"))
    print_users(console, info.get("users"), info.get("lanes"))
    print_promotion(console, info.get("promotion"))
    print_talk(console, info.get("notes"), info.get("promotion"))
    print_trainer(console, info.get("trainer"))
    for line in owed_lines(info.get("remote_deletions")):
        console.print(line, highlight=False, soft_wrap=True)
    if info["running"] and "store" in info:
        console.print(privacy_line(info.get("privacy"), (info.get("trainer") or {}).get("samples", {})), highlight=False)
    if info.get("engine"):
        console.print(engine_line(info["engine"]), highlight=False, soft_wrap=True)


def stored_promotion(store: Any) -> dict[str, Any] | None:
    """The promotion state and decisions as the store has them (no server running)."""
    from clawbridge.store.promotion import PromotionStore

    ps = PromotionStore(store)
    state = ps.state()
    if state is None:
        return None
    return {"mode": state.mode, "serving_version": state.serving_version,
            "candidate_version": state.candidate_version, "holding": None, "eval_set": None, "tolerance": None,
            "held_version": state.held_version, "held_since": state.held_since,
            "decisions": [d.as_dict() for d in ps.decisions(20)], "rejected_samples": ps.rejected_samples()}


def stored_notes(settings: Settings, store: Any) -> list[dict[str, Any]] | None:
    """Every note as the store has them (no server running); None when notes are off."""
    from clawbridge.rewards.notes import NoteBook

    return NoteBook(store).status() if settings.notes else None


def print_talk(console: Console, notes: list[dict[str, Any]] | None, promotion: dict[str, Any] | None) -> None:
    """"Is it learning what I asked, and is it still good?": the notes from talk, grouped by user,
    and the capability probe of the serving version against the base (nothing when neither)."""
    from clawbridge.promotion.describe import still_good_line
    from clawbridge.rewards.notes_describe import notes_lines

    for line in notes_lines(notes):
        console.print(line, highlight=False, soft_wrap=True)
    good = still_good_line(promotion)
    if good is not None:
        console.print(good, highlight=False, soft_wrap=True)


def print_promotion(console: Console, p: dict[str, Any] | None) -> None:
    from clawbridge.promotion.describe import promotion_lines

    for line in promotion_lines(p):
        console.print(line, highlight=False, soft_wrap=True)


def print_users(console: Console, users: list[dict[str, Any]] | None,
                lanes: dict[str, dict[str, Any]] | None = None) -> None:
    """One line per user (and one for sessions without a user), when there are users; with
    per-user adapters, what each user's own adapter is doing (`lane_text`)."""
    if not users or all(u["user"] is None for u in users):
        return
    console.print("users:")
    for u in users:
        mean = "-" if u["mean_reward"] is None else f"{u['mean_reward']:.3g}"
        name = u["user"] if u["user"] is not None else "(no user: shared client key / admin)"
        status = "" if u["status"] in (None, "active") else f" [{u['status']}]"
        console.print(f"  {name}{status}: {u['sessions']} session(s), {u['turns']} turn(s), "
                      f"{u['pending_turns']} pending, mean reward {mean} over {u['rewards']} reward(s)"
                      + (lane_text(lanes.get(u["user"])) if lanes is not None and u["user"] is not None else ""),
                      highlight=False)


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    """`values` as block characters between their min and max (a flat line when all are equal)."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo
    return "".join(SPARKS[0 if span == 0 else round((v - lo) / span * (len(SPARKS) - 1))] for v in values)


def lane_text(lane: dict[str, Any] | None) -> str:
    """A user's adapter: the version their calls get (promotion does not gate it: docs/users.md), its
    steps, what its last step rehearsed and the reward trend of its last steps."""
    if lane is None:
        return "; own adapter: nothing to train yet (the shared policy answers)"
    served = lane["serving_version"]
    text = (f"; own adapter v{served} (not gated)" if served is not None
            else "; own adapter: not trained yet (the shared policy answers)")
    text += f", {lane['steps']['ok']} step(s)" + (", training now" if lane["in_step"] else "")
    if lane.get("rehearsed"):
        text += f", {lane['rehearsed']} known facts rehearsed per step"
    trend = lane["reward_trend"]
    if trend:
        text += f", step reward {trend[0]:.2f} -> {trend[-1]:.2f} {sparkline(trend)}"
    if lane.get("last_error"):
        text += f", last step failed: {lane['last_error']}"
    return text


def _fmt_metrics(m: dict[str, Any] | None) -> str:
    if not m:
        return ""
    keys = ("loss", "reward_mean", "kl", "clip_fraction", "tokens", "rewrite_datums", "seconds")
    parts = []
    for k in keys:
        v = m.get(k)
        if k == "rewrite_datums" and not v:
            continue  # rewrites off (the default), or none in this step: nothing to say
        if isinstance(v, int | float):
            parts.append(f"{k} {v:.4g}")
    return ", ".join(parts)


def print_trainer(console: Console, t: dict[str, Any] | None) -> None:
    if not t:
        console.print("trainer: off")
        return
    s = t["samples"]
    dropped = ", ".join(f"{k} {v}" for k, v in s["dropped"].items()) or "none"
    console.print(f"trainer: samples {s['pending']} pending, {s['consumed']} trained, dropped: {dropped}; "
                  f"steps {t['steps']['ok']} ok, {t['steps']['failed']} failed")
    w = t.get("waiting")
    if w:
        console.print("  " + waiting_line(w), highlight=False)
    m = t.get("merging")
    if m and not m.get("enabled", True):
        console.print("  merging: off (merge_session_turns = false): one datum per turn", highlight=False)
    elif m and m.get("turns"):
        console.print(f"  merging: {m['merged']} of {m['turns']} trained turns joined their session's sequence "
                      f"({m['datums']} datums), {m['breaks']} prefix breaks; {m['tokens_sent']} tokens sent instead "
                      f"of {m['tokens_unmerged']} (since start-up)", highlight=False)
    for step in t.get("recent_steps", [])[:5]:
        version = step["policy_version"]
        made = f" -> policy v{version}" if version is not None else " (no version committed)"
        metrics = _fmt_metrics(step.get("metrics"))
        console.print(f"  step {step['step']} {step['status']}{made}" + (f": {metrics}" if metrics else ""),
                      highlight=False)
    if t.get("last_error"):
        console.print(f"  last error (step {t['last_error']['step']}): {t['last_error']['error']}", highlight=False)


def owed_lines(owed: dict[str, Any] | None) -> list[str]:
    """What is still to delete on the hosted service (nothing when the list is empty)."""
    if not owed or not owed.get("owed"):
        return []
    why = ", ".join(f"{n} for {'pruned checkpoints' if r == 'prune' else 'forgotten users'}"
                    for r, n in sorted(owed["by_reason"].items()))
    when = dt.datetime.fromtimestamp(owed["next_try_at"]).strftime("%Y-%m-%d %H:%M:%S")
    lines = [f"remote deletions owed: {owed['owed']} ({why}); next try at {when}, retried until the service "
             "confirms each gone"]
    for item in owed.get("items", []):
        error = f": {item['last_error']}" if item.get("last_error") else ""
        lines.append(f"  {item['kind']} {item['object']} ({item['attempts']} tries){error}")
    return lines


def privacy_line(p: dict[str, Any] | None, samples: dict[str, Any]) -> str:
    """One line saying where the privacy filter is on and what it filtered (kinds and counts only)."""
    if not p:
        return "privacy filter: off (nothing is sent off this machine for training or judging, or privacy = off)"
    where = [w for w, on in (("training data", p["train"]), ("judge prompts", p["judge"])) if on]

    def kinds(c: dict[str, int]) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(c.items())) or "nothing"

    masked = p["masked"]
    private = (samples.get("dropped") or {}).get("private", 0)
    return (f"privacy filter: on for {' and '.join(where)}; masked in trained data: {kinds(masked['train'])}; "
            f"in judge prompts: {kinds(masked['judge'])} (since start-up); turns dropped as private: {private}")


def engine_line(e: dict[str, Any]) -> str:
    """What the serving engine's KV budget is (and why), how full it is and how many requests wait."""
    budget = f"engine: {e['kv_budget']}\n  " if e.get("kv_budget") else "engine: "
    written = (f"; {e['kv_high_water_tokens']} positions written so far"
               if e.get("kv_high_water_tokens") is not None else "")
    return (f"{budget}KV budget {e['kv_used_fraction']:.0%} reserved ({e['kv_used_tokens']} of "
            f"{e['kv_budget_tokens']} tokens; {e['kv_cached_tokens']} more hold reusable prefixes{written}), "
            f"{e['running']} running, {e['waiting']} waiting; {e['waited_for_budget']} request(s) so far "
            "waited for room (raise kv_budget_tokens if this grows)")


def waiting_line(w: dict[str, Any]) -> str:
    """One line saying what the next training step waits for."""
    parts = []
    if w["active_sessions"]:
        parts.append(f"{w['active_sessions']} active session(s) to end ({w['active_session_turns']} turn(s); "
                     "`clawbridge sessions end ID`, X-Session-Done or the idle timeout ends them)")
    if w["unrewarded_turns"]:
        when = dt.datetime.fromtimestamp(w["first_unrewarded_drop_at"]).strftime("%Y-%m-%d %H:%M:%S")
        parts.append(f"rewards for {w['unrewarded_turns']} turn(s) of ended sessions (`clawbridge reward`; "
                     f"unrewarded ones are dropped from {when})")
    if w.get("sessions_waiting_for_judge"):
        parts.append(f"the judge on {w['sessions_waiting_for_judge']} session(s)")
    if w.get("held_for_group"):
        parts.append(f"the rest of their task group for {w['held_for_group']} ready turn(s) (a group baseline "
                     "compares a task's sessions; held up to batch_wait_s)")
    need = w["datums_until_next_step"]
    head = (f"next step: {need} more rewarded turn(s) needed ({w['ready_datums']} ready)" if need
            else f"next step: ready ({w['ready_datums']} turn(s))")
    if need and w.get("short_batch_in_s") is not None:
        head += f", or the {w['ready_datums']} train as a short batch in {w['short_batch_in_s']:.0f} s"
    return head + ("; waiting for " + ", ".join(parts) if parts else "")
