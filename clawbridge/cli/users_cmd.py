"""`clawbridge users add|list|revoke|forget`: manage users on the running server (its `/rl/users`
API, with the admin key from the environment or the state dir; the address from the state dir's
server file, as `clawbridge status` finds it)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Annotated, Any

import httpx
import typer
from rich.markup import escape
from rich.table import Table

from clawbridge.address import candidate_urls, root_url_for
from clawbridge.cli.common import ConfigOpt, StateOpt, console, err, settings_or_exit
from clawbridge.cli.status import admin_key

app = typer.Typer(help="Create, list, revoke and forget users (each with their own key) on the running server; "
                  "see docs/users.md.", no_args_is_help=True)

UserArg = Annotated[str, typer.Argument(help="User name: 1-64 letters, digits, '.', '_' or '-'.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the server's JSON answer.")]


def _call(state_dir: Any, config: Any, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The running server's JSON answer to an admin request, or exit 1 saying what went wrong."""
    settings = settings_or_exit(config, state_dir=state_dir)
    key = admin_key(settings)
    if key is None:
        err.print(f"no admin key: set CLAWBRIDGE_ADMIN_KEY or start the server once with --state-dir "
                  f"{settings.state_path} (it writes admin_key there)")
        raise typer.Exit(1)
    tried = []
    for base in candidate_urls(settings.state_path, root_url_for(settings.host, settings.port)):
        try:
            r = httpx.request(method, f"{base}{path}", json=body, timeout=600.0,
                              headers={"Authorization": f"Bearer {key}"})
        except httpx.HTTPError as exc:
            tried.append(f"{base} ({type(exc).__name__})")
            continue
        try:
            doc = r.json()
        except ValueError:
            doc = {}
        if r.status_code != 200:
            message = (doc.get("error") or {}).get("message") if isinstance(doc, dict) else None
            err.print(f"[red]error {r.status_code}:[/red] {escape(str(message or r.text[:300]))}")
            raise typer.Exit(1)
        return dict(doc)
    err.print(f"no clawbridge server answered ({', '.join(tried)}); start it with `clawbridge up` "
              "(users are managed on the running server)")
    raise typer.Exit(1)


@app.command("add")
def add(user: UserArg, state_dir: StateOpt = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Create a user and print their key (shown this once; only its hash is stored)."""
    doc = _call(state_dir, config, "POST", "/rl/users", {"user": user})
    if as_json:
        print(json.dumps(doc))
        return
    console.print(f"user {doc['user']} created. Their key (shown once; give it to them as their API key):",
                  highlight=False)
    print(doc["api_key"])


@app.command("list")
def listing(state_dir: StateOpt = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """List users (never their keys) with their sessions, turns, pending turns and mean reward."""
    doc = _call(state_dir, config, "GET", "/rl/users")
    if as_json:
        print(json.dumps(doc, indent=2))
        return
    table = Table("user", "status", "created", "sessions", "turns", "pending turns", "mean reward")
    for u in doc["users"]:
        mean = u.get("mean_reward")
        table.add_row(u["user"], u["status"], dt.datetime.fromtimestamp(u["created_at"]).strftime("%Y-%m-%d %H:%M"),
                      str(u.get("sessions", 0)), str(u.get("turns", 0)), str(u.get("pending_turns", 0)),
                      "" if mean is None else f"{mean:.3g}")
    console.print(table)


@app.command("revoke")
def revoke(user: UserArg, state_dir: StateOpt = None, config: ConfigOpt = None) -> None:
    """Revoke a user's key: its calls get 401 from now on; its data stays (see `forget`)."""
    _call(state_dir, config, "DELETE", f"/rl/users/{user}")
    console.print(f"user {user} revoked: their key no longer works; their sessions stay until `clawbridge users "
                  f"forget {user}`", highlight=False)


@app.command("forget")
def forget(user: UserArg, state_dir: StateOpt = None, config: ConfigOpt = None, as_json: JsonOpt = False,
           yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False) -> None:
    """Delete a user and everything recorded for them (sessions, turns, rewards, samples, judge
    results), then rebuild the store file so none of it remains on disk. Cannot be undone."""
    if not yes and not typer.confirm(f"delete user {user} and all their sessions for good?"):
        raise typer.Exit(1)
    doc = _call(state_dir, config, "POST", f"/rl/users/{user}/forget")
    if as_json:
        print(json.dumps(doc))
        return
    parts = ", ".join(f"{n} {table}" for table, n in sorted(doc["deleted"].items())) or "nothing"
    console.print(f"forgot user {user}: deleted {parts}; store file vacuumed"
                  + ("" if doc.get("wal_truncated") else " (its WAL could not be truncated yet: another "
                     "process was reading; run `clawbridge users forget` again when it is idle)"), highlight=False)
