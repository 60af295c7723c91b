"""`clawbridge users add|list|revoke|forget`: manage users on the running server (its `/rl/users`
API, with the admin key from the environment or the state dir; the server found as every command
finds it: `clawbridge.cli.target`)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Annotated, Any

import typer
from rich.markup import escape

from clawbridge.cli.common import ConfigOpt, StateOpt, console, err, table
from clawbridge.cli.target import NoServer, Target, answer_of, no_server_message, resolve, server_request

app = typer.Typer(help="Create, list, revoke and forget users (each with their own key) on the running server; "
                  "see docs/users.md.", no_args_is_help=True)

UserArg = Annotated[str, typer.Argument(help="User name: 1-64 letters, digits, '.', '_' or '-'.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the server's JSON answer.")]


def _call(target: Target, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The running server's JSON answer to an admin request, or exit 1 saying what went wrong."""
    try:
        return answer_of(server_request(target, method, path, body, timeout_s=600.0))
    except NoServer:
        err.print(escape(no_server_message(target, "`clawbridge users`")), highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


@app.command("add")
def add(user: UserArg, state_dir: StateOpt = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Create a user and print their key (shown this once; only its hash is stored)."""
    doc = _call(resolve(config, state_dir), "POST", "/rl/users", {"user": user})
    if as_json:
        print(json.dumps(doc))
        return
    console.print(f"user {doc['user']} created. Their key (shown once; give it to them as their API key):",
                  highlight=False)
    print(doc["api_key"])


@app.command("list")
def listing(state_dir: StateOpt = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """List users (never their keys) with their sessions, turns, pending turns and mean reward."""
    doc = _call(resolve(config, state_dir), "GET", "/rl/users")
    if as_json:
        print(json.dumps(doc, indent=2))
        return
    if not doc["users"]:
        console.print("no users yet: `clawbridge users add NAME` creates one (calls with the shared client key "
                      "are recorded without a user)", highlight=False)
        return
    listing = table("user", "status", "created", "sessions", "turns", "pending turns", "mean reward")
    for u in doc["users"]:
        mean = u.get("mean_reward")
        listing.add_row(u["user"], u["status"], dt.datetime.fromtimestamp(u["created_at"]).strftime("%Y-%m-%d %H:%M"),
                        str(u.get("sessions", 0)), str(u.get("turns", 0)), str(u.get("pending_turns", 0)),
                        "" if mean is None else f"{mean:.3g}")
    console.print(listing)


@app.command("revoke")
def revoke(user: UserArg, state_dir: StateOpt = None, config: ConfigOpt = None) -> None:
    """Revoke a user's key: its calls get 401 from now on; its data stays (see `forget`)."""
    _call(resolve(config, state_dir), "DELETE", f"/rl/users/{user}")
    console.print(f"user {user} revoked: their key no longer works; their sessions stay until `clawbridge users "
                  f"forget {user}`", highlight=False)


@app.command("forget")
def forget(user: UserArg, state_dir: StateOpt = None, config: ConfigOpt = None, as_json: JsonOpt = False,
           yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False) -> None:
    """Delete a user and everything recorded for them (sessions, turns, rewards, samples, judge
    results), then rebuild the store file so none of it remains on disk. Cannot be undone."""
    target = resolve(config, state_dir)
    if not yes and not typer.confirm(f"delete user {user} and all their sessions for good?"):
        raise typer.Exit(1)
    doc = _call(target, "POST", f"/rl/users/{user}/forget")
    if as_json:
        print(json.dumps(doc))
        return
    parts = ", ".join(f"{n} {table}" for table, n in sorted(doc["deleted"].items())) or "nothing"
    console.print(f"forgot user {user}: deleted {parts}; store file vacuumed"
                  + ("" if doc.get("wal_truncated") else " (its WAL could not be truncated yet: another "
                     "process was reading; run `clawbridge users forget` again when it is idle)"), highlight=False)
