"""`clawbridge notes [list|add TEXT|delete ID|clear] [--user U]`: the notes learned from talk
(`clawbridge.rewards.notes`) on the running server, through its `/rl/notes` API with the admin key.

Invariants:
- These commands change nothing themselves: the server decides and records (a deleted note is gone
  from the store and from the next call), so what they print is what the server committed.
- The server is found, and the admin key read, as every admin command finds them
  (`clawbridge.cli.target`), in one function here (`_request`).
- Output is a table; when it does not go to a terminal the shared console lays it out whole (no
  cell folded or cut), so `clawbridge notes | grep Sam` sees whole notes.
"""

from __future__ import annotations

import json
from typing import Annotated, Any
from urllib.parse import quote

import typer
from rich.markup import escape
from rich.table import Column, Table

from clawbridge.cli.common import ConfigOpt, StateOpt, console, err
from clawbridge.rewards.notes_describe import described

app = typer.Typer(help="See, add and delete the notes learned from talk (a judge's hints from your corrections, "
                  "carried by your next calls until the weights carry them) on the running server.",
                  invoke_without_command=True)

UserOpt = Annotated[str | None, typer.Option("--user", help="Whose notes: a user's name; '' for calls made without "
                                             "a user (the shared client key). Default: everyone's (list), the "
                                             "shared key's (add, clear).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the server's JSON answer.")]


def _request(state_dir: Any, config: Any, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The running server's answer to an admin request on `/rl/notes...`, or exit 1 saying what
    went wrong (no server, no key, notes off, an unknown note)."""
    from clawbridge.cli.target import NoServer, answer_of, no_server_message, resolve, server_request

    target = resolve(config, state_dir)
    try:
        return answer_of(server_request(target, method, path, body))
    except NoServer:
        err.print(escape(no_server_message(target, "`clawbridge notes`") + " (`clawbridge status` shows notes from "
                         "the store)"), highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def _user_query(user: str | None) -> str:
    return "" if user is None else f"?user={quote(user, safe='')}"


def notes_table(notes: list[dict[str, Any]]) -> Table:
    """One row per note, in words (`clawbridge.rewards.notes_describe`), newest first."""
    table = Table(*(Column(h, overflow="fold") for h in ("id", "user", "note", "correction", "met since",
                                                           "stable", "state")))
    for n in notes:
        d = described(n)
        table.add_row(str(n["note_id"]), escape(d["owner"]), escape(d["text"]), d["corrections"], d["met"],
                      d["stable"], escape(d["state"]))
    return table


def _list(state_dir: Any, config: Any, user: str | None, as_json: bool) -> None:
    doc = _request(state_dir, config, "GET", "/rl/notes" + _user_query(user))
    if as_json:
        print(json.dumps(doc, indent=2))
        return
    if not doc["notes"]:
        whose = "" if user is None else f" of {user or 'the shared key'}"
        console.print(f"no notes{whose} yet: a note is made when the judge reads a correction in what a user says "
                      "next (or add one: `clawbridge notes add TEXT`)", highlight=False, soft_wrap=True)
        return
    console.print(notes_table(doc["notes"]))


@app.callback()
def _default(ctx: typer.Context, user: UserOpt = None, state_dir: StateOpt = None, config: ConfigOpt = None,
             as_json: JsonOpt = False) -> None:
    """List every note (with no sub-command): its text, how often the correction was said, how
    often the user's sessions met it since, whether that is stable, and whether it is retired."""
    if ctx.invoked_subcommand is None:
        _list(state_dir, config, user, as_json)


@app.command("list")
def listing(user: UserOpt = None, state_dir: StateOpt = None, config: ConfigOpt = None,
            as_json: JsonOpt = False) -> None:
    """List the notes (everyone's, or --user's), newest first."""
    _list(state_dir, config, user, as_json)


@app.command("add")
def add(text: Annotated[str, typer.Argument(help="The preference, in so many words (at most 300 characters).")],
        user: UserOpt = None, state_dir: StateOpt = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Add a note by hand: the user's next calls carry it, as if the judge had read it in a correction."""
    body: dict[str, Any] = {"text": text}
    if user is not None:
        body["user"] = user
    note = _request(state_dir, config, "POST", "/rl/notes", body)
    if as_json:
        print(json.dumps(note))
        return
    d = described(note)
    console.print(f"note {note['note_id']} of {escape(d['owner'])}: \"{escape(d['text'])}\" ({d['state']})",
                  highlight=False, soft_wrap=True)


@app.command("delete")
def delete(note_id: Annotated[int, typer.Argument(help="The note's id (`clawbridge notes`).")],
           state_dir: StateOpt = None, config: ConfigOpt = None) -> None:
    """Delete one note: gone from the store and from the next call."""
    _request(state_dir, config, "DELETE", f"/rl/notes/{note_id}")
    console.print(f"note {note_id} deleted", highlight=False)


@app.command("clear")
def clear(user: UserOpt = None, state_dir: StateOpt = None, config: ConfigOpt = None,
          yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False) -> None:
    """Delete every note of one user (--user; default the shared key's)."""
    whose = user or "the shared key"
    if not yes and not typer.confirm(f"delete every note of {whose}?"):
        raise typer.Exit(1)
    doc = _request(state_dir, config, "DELETE", "/rl/notes" + _user_query(user if user is not None else ""))
    console.print(f"deleted {doc['deleted']} note(s) of {escape(whose)}", highlight=False)
