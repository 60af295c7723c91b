"""`clawbridge sessions ...`: read recorded sessions from the store (works while the server is down)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from clawbridge.cli.common import ConfigOpt, StateOpt, console, err, store_or_exit, table
from clawbridge.cli.target import resolve

app = typer.Typer(help="Read recorded sessions from the store (works while the server is down).",
                  no_args_is_help=True)


@app.command("list")
def sessions_list(
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
    limit: Annotated[int, typer.Option(help="How many, newest first.")] = 50,
    status_: Annotated[str | None, typer.Option("--status", help="active or ended.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List sessions, newest first."""
    store = store_or_exit(resolve(config, state_dir).settings)
    rows = store.list_sessions(limit=limit, status=status_)
    if as_json:
        print(json.dumps([r.__dict__ for r in rows], indent=2))
        return
    if not rows:
        console.print("no sessions" + (f" {status_}" if status_ else "") + " yet: every model call is recorded "
                      "in one", highlight=False)
        return
    import datetime as dt

    from clawbridge.store.observe import ObserveStore

    rewards = {s.session_id: s for s in ObserveStore(store).session_summaries(limit, 0, status_)}
    listing = table("session", "status", "source", "turns", "reward (mean of n)", "created", "end reason")
    for r in rows:
        summary = rewards.get(r.session_id)
        reward = "" if summary is None or summary.reward is None else f"{summary.reward:g} ({summary.rewards})"
        listing.add_row(r.session_id, r.status, r.source, str(r.turn_count), reward,
                      dt.datetime.fromtimestamp(r.created_at).strftime("%Y-%m-%d %H:%M:%S"), r.end_reason or "")
    console.print(listing)


@app.command("end")
def sessions_end(
    session_id: Annotated[str, typer.Argument(help="Session id.")],
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
) -> None:
    """End a session now (its rewarded turns become trainable), as /rl/end_session does: a session
    started with a session key or a trajectory that has no reward gets default_reward_value on its
    last turn (default_session_reward). Works while the server runs (the trainer picks it up at its
    next poll) and while it is down."""
    from clawbridge.runtime.lifecycle import SessionLifecycle

    settings = resolve(config, state_dir).settings
    store = store_or_exit(settings)
    if store.get_session(session_id) is None:
        err.print(f"no session {session_id!r}")
        raise typer.Exit(1)
    if SessionLifecycle(store, settings).end(session_id):
        console.print(f"ended session {session_id}")
    else:
        console.print(f"session {session_id} had already ended")


@app.command("show")
def sessions_show(
    session_id: Annotated[str, typer.Argument(help="Session id.")],
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the full record as JSON.")] = False,
) -> None:
    """Show one session: its turns (token ids, logprobs, policy version, reward) and rewards."""
    store = store_or_exit(resolve(config, state_dir).settings)
    view = store.session_view(session_id)
    if view is None:
        err.print(f"no session {session_id!r}")
        raise typer.Exit(1)
    if as_json:
        print(json.dumps(view))
        return
    console.print(f"[bold]{view['session_id']}[/bold] {view['status']} (source {view['source']})")
    turns = table("#", "turn", "type", "status", "prompt tok", "completion tok", "version", "reward", "finish")
    for t in view["turns"]:
        turns.add_row(str(t["seq"]), t["turn_id"], t["turn_type"], t["status"], str(len(t["prompt_token_ids"])),
                      str(len(t["completion_token_ids"])), str(t["policy_version"]),
                      "" if t["reward"] is None else f"{t['reward']:g}", t["finish_reason"] or "")
    console.print(turns)
    from clawbridge.chat.content import loose_text as text_of
    from clawbridge.shapes.recorded import answer_message

    for t in view["turns"]:
        answer = answer_message(t["response"])
        calls = ", ".join(str((c.get("function") or {}).get("name")) for c in answer.get("tool_calls") or [])
        text = text_of(answer.get("content")).strip().replace("\n", " ")
        console.print(f"#{t['seq']} answer: {text[:300]}{'…' if len(text) > 300 else ''}"
                      + (f" [tool calls: {calls}]" if calls else ""), highlight=False, markup=False)
    for r in view["rewards"]:
        console.print(f"reward {r['value']:g} on {r['turn_id'] or 'the session'} ({r['source']})")


def _when(value: str | None, name: str) -> float | None:
    """A Unix time from seconds since the epoch or an ISO 8601 date/time (UTC unless it says)."""
    if value is None:
        return None
    import datetime as dt

    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        err.print(f"{name}: {value!r} is neither seconds since the epoch nor an ISO date (2026-05-01T12:00)")
        raise typer.Exit(2) from None
    return (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp()


@app.command("export")
def sessions_export(
    out: Annotated[Path, typer.Argument(help="File to write ('-' for stdout; a folder for --format hf).")],
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
    format_: Annotated[str, typer.Option(
        "--format", help="sessions: one `show --json` document per session; chat: JSONL of {messages, tools} "
        "per turn (TRL / SFT); tokens: JSONL of prompt ids, completion ids, logprobs, advantages, reward, "
        "policy version per turn; parquet: the same as a Parquet file; hf: a folder datasets.load_dataset reads."
    )] = "sessions",
    status_: Annotated[str | None, typer.Option("--status", help="Only active or ended sessions.")] = None,
    since: Annotated[str | None, typer.Option(help="Turns created at or after (epoch seconds or ISO date).")] = None,
    until: Annotated[str | None, typer.Option(help="Turns created at or before (epoch seconds or ISO date).")] = None,
    min_reward: Annotated[float | None, typer.Option(help="Turns whose reward is at least this.")] = None,
    max_reward: Annotated[float | None, typer.Option(help="Turns whose reward is at most this.")] = None,
    turn_type: Annotated[str | None, typer.Option(help="main or side turns only.")] = None,
    include_failed: Annotated[bool, typer.Option(help="Also cancelled and errored turns.")] = False,
    user: Annotated[str | None, typer.Option(help="Only this user's sessions (see `clawbridge users`).")] = None,
) -> None:
    """Export recorded sessions or turns in a format other tools read (rewards and advantages by the
    trainer's own rules; see clawbridge/export/records.py)."""
    from clawbridge.export import FORMATS, ExportFilter, export_records
    from clawbridge.export import formats as fmt

    if format_ not in FORMATS:
        err.print(f"--format must be one of {', '.join(FORMATS)}")
        raise typer.Exit(2)
    if status_ not in (None, "active", "ended") or turn_type not in (None, "main", "side"):
        err.print("--status must be active or ended; --turn-type main or side")
        raise typer.Exit(2)
    settings = resolve(config, state_dir).settings
    store = store_or_exit(settings)
    if format_ == "sessions":
        n = _export_sessions(store, out, status_, _when(since, "--since"), _when(until, "--until"), user)
        err.print(f"exported {n} session(s)")
        return
    flt = ExportFilter(since=_when(since, "--since"), until=_when(until, "--until"), min_reward=min_reward,
                       max_reward=max_reward, status=status_, turn_type=turn_type,  # type: ignore[arg-type]
                       include_failed=include_failed, user=user)
    records = export_records(store, settings, flt)
    if format_ == "hf":
        if str(out) == "-":
            err.print("--format hf writes a folder; give its path")
            raise typer.Exit(2)
        path = fmt.write_hf_folder(records, out, settings.model_name)
        err.print(f"exported {len(records)} turn(s) to {path} (datasets.load_dataset({str(out)!r}))")
        return
    if format_ == "parquet":
        if str(out) == "-":
            err.print("--format parquet writes a file; give its path")
            raise typer.Exit(2)
        fmt.write_parquet(records, out)
    else:
        rows = [fmt.chat_row(r) for r in records] if format_ == "chat" else [fmt.token_row(r) for r in records]
        fh = sys.stdout if str(out) == "-" else out.open("w")
        try:
            fmt.write_jsonl(rows, fh)
        finally:
            if fh is not sys.stdout:
                fh.close()
    err.print(f"exported {len(records)} turn(s) as {format_}")


def _export_sessions(store: Any, out: Path, status: str | None, since: float | None, until: float | None,
                     user: str | None = None) -> int:
    fh = sys.stdout if str(out) == "-" else out.open("w")
    n, offset = 0, 0
    try:
        while True:
            rows = store.list_sessions(limit=500, offset=offset, status=status, user=user)
            if not rows:
                break
            for r in rows:
                if (since is not None and r.updated_at < since) or (until is not None and r.created_at > until):
                    continue
                fh.write(json.dumps(store.session_view(r.session_id)) + "\n")
                n += 1
            offset += len(rows)
    finally:
        if fh is not sys.stdout:
            fh.close()
    return n
