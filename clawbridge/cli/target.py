"""Which state dir, and which running server, a command acts on.

Every command that reads a store or talks to a server resolves its target here, in this order:
`--state-dir` > `CLAWBRIDGE_STATE_DIR` (or `state_dir` in the `--config` file) > the one server
that runs for this OS user (`clawbridge.runtime.address.running_servers`) > the default state dir.

Invariants:
- Several servers running and none chosen: the command refuses (exit 2), listing each one's state
  dir and address and how to choose; it never picks one.
- A command talks only to the server of the state dir it resolved (`clawbridge.runtime.address.server_for`:
  its recorded pid alive and its URL listening), never to whatever answers at the configured port,
  so a server's answers are never shown beside another store's rows.
- Its first line, on stderr (stdout stays for pipes and `--json`), names the state dir, why it was
  chosen, and the server it found there (or that none runs).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.markup import escape

from clawbridge.cli.common import err, settings_or_exit
from clawbridge.config import Settings
from clawbridge.runtime.address import RunningServer, running_servers, server_for
from clawbridge.runtime.keys import ADMIN_KEY_FILE, read_key_file

STATE_DIR_ENV = "CLAWBRIDGE_STATE_DIR"


@dataclass(frozen=True)
class Target:
    """What a command acts on."""

    settings: Settings
    """The resolved settings, `state_dir` the chosen one."""
    chosen_by: str
    """Why this state dir: `--state-dir`, `CLAWBRIDGE_STATE_DIR`, `the config file`, `the only running
    server` or `the default`."""
    server: RunningServer | None
    """The live server on that state dir, if one runs."""

    @property
    def state_dir(self) -> Path:
        return self.settings.state_path

    def line(self) -> str:
        """The first line a command prints (see the module invariants)."""
        where = f"state dir {self.state_dir} ({self.chosen_by})"
        if self.server is not None:
            return f"using the clawbridge server at {self.server.describe()}, {where}"
        return f"using {where}; no clawbridge server runs on it"


def target_of(settings: Settings, chosen_by: str = "--state-dir") -> Target:
    """The target for settings whose state dir is already chosen (`chosen_by` says how)."""
    return Target(settings, chosen_by, server_for(settings.state_path))


def _home(path: Path) -> str:
    """`path` with the home folder written `~` (shorter in messages)."""
    home = str(Path.home())
    text = str(path)
    return "~" + text[len(home):] if text == home or text.startswith(home + os.sep) else text


def several_message(servers: list[RunningServer]) -> str:
    """The refusal when several servers run and the command was not told which."""
    lines = [f"{len(servers)} clawbridge servers are running; say which one with --state-dir DIR "
             f"(or {STATE_DIR_ENV}=DIR):"]
    width = max(len(_home(s.state_dir)) for s in servers)
    lines += [f"  --state-dir {_home(s.state_dir):<{width}}  {s.describe()}" for s in servers]
    return "\n".join(lines)


def resolve(config: Path | None, state_dir: Path | None, *, announce: bool = True, **overrides: Any) -> Target:
    """The command's target (see the module docstring); exits 2 on a configuration error or when
    several servers run and none was chosen. `announce`: print `Target.line()` to stderr."""
    settings = settings_or_exit(config, state_dir=state_dir, **overrides)
    if state_dir is not None:
        chosen_by = "--state-dir"
    elif os.environ.get(STATE_DIR_ENV):
        chosen_by = STATE_DIR_ENV
    elif "state_dir" in settings.model_fields_set:
        chosen_by = "the config file"
    else:
        servers = running_servers()
        if len(servers) > 1:
            err.print(escape(several_message(servers)), highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        if servers:
            settings = settings.model_copy(update={"state_dir": servers[0].state_dir})
            chosen_by = "the only running server"
        else:
            chosen_by = "the default"
    target = target_of(settings, chosen_by)
    if announce:
        err.print(escape(target.line()), highlight=False, soft_wrap=True)
    return target


def no_server_message(target: Target, what: str) -> str:
    """Why a command that needs a running server (`what` it does) cannot go on, and how to fix it:
    start one on the chosen state dir, or choose one of those that run."""
    text = (f"no clawbridge server runs on state dir {target.state_dir} ({target.chosen_by}); {what} acts on a "
            f"running server: start it with `clawbridge up --state-dir {_home(target.state_dir)} --model ...`")
    others = [s for s in running_servers() if s.state_dir.resolve() != target.state_dir.resolve()]
    if others:
        text += "; or choose one that runs: " + "; ".join(
            f"--state-dir {_home(s.state_dir)} ({s.describe()})" for s in others)
    return text


def admin_key(settings: Settings) -> str | None:
    """The admin key from the settings (environment) or the state dir's key file; None if neither."""
    if settings.admin_key is not None:
        return settings.admin_key.get_secret_value()
    try:
        return read_key_file(settings.state_path / ADMIN_KEY_FILE)
    except Exception:
        return None


class NoServer(Exception):
    """No server runs on the target's state dir."""


def server_request(target: Target, method: str, path: str, body: dict[str, Any] | None = None,
                   timeout_s: float = 120.0) -> httpx.Response:
    """`method path` on the target's server with the admin key; `NoServer` when none runs there;
    exit 1, saying why, when there is no admin key or the server does not answer."""
    if target.server is None:
        raise NoServer()
    key = admin_key(target.settings)
    if key is None:
        err.print(f"a server runs at {target.server.url}, but state dir {target.state_dir} has no admin_key file "
                  "and CLAWBRIDGE_ADMIN_KEY is not set", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    try:
        return httpx.request(method, f"{target.server.url}{path}", json=body, timeout=timeout_s,
                             headers={"Authorization": f"Bearer {key}"})
    except httpx.HTTPError as exc:
        err.print(f"[red]the server at {target.server.url} did not answer:[/red] {type(exc).__name__} "
                  f"{escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def answer_of(r: httpx.Response) -> dict[str, Any]:
    """The server's JSON answer, or exit 1 printing the error message it gave."""
    try:
        body = r.json()
    except ValueError:
        body = {}
    if r.status_code != 200:
        message = (body.get("error") or {}).get("message") if isinstance(body, dict) else None
        err.print(f"[red]the server refused ({r.status_code}):[/red] {escape(str(message or r.text[:500]))}",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    return dict(body)


def own_state_dir_advice(settings: Settings, argv: list[str]) -> str:
    """When `up` refuses a state dir whose checkpoints belong to another model or LoRA setup: the
    one command that starts this setup anyway, on a state dir of its own beside the first
    (`<state dir>-<model folder>`), with the rest of the command line as it was given."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(settings.model.rstrip("/")).name or "model").strip("-") or "model"
    suggested = f"{_home(settings.state_path)}-{name}"
    args = argv[argv.index("up") + 1:] if "up" in argv else []
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--state-dir":
            skip = True
        elif not arg.startswith("--state-dir="):
            kept.append(arg)
    where = suggested if re.fullmatch(r"~/[A-Za-z0-9._/-]+", suggested) else shlex.quote(suggested)  # ~ expands
    command = f"{shlex.join(['clawbridge', 'up', *kept])} --state-dir {where}"
    return (f"to serve it beside the other one, give it a state dir of its own (its sessions, keys and "
            f"checkpoints are kept apart; the old state dir is left as it is):\n  {command}")
