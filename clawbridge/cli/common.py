"""What the `clawbridge` commands share: the consoles, the --config/--state-dir options, and
reading the settings and the store with a clear error instead of a traceback.

Invariant: output is never cut. In a terminal, lines wrap at its width and table cells fold; in a
pipe or a log (not a terminal) nothing is wrapped at all (`PIPE_WIDTH`), so `clawbridge config show
| grep keep` sees whole lines. Progress (bars, spinners) is drawn only in a terminal (`interactive`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

import clawbridge.plugins  # noqa: F401  (registers where a backend's old flat option moved: clawbridge.plugins)
from clawbridge.config import Settings, load_settings

PIPE_WIDTH = 100_000
"""The width output is laid out for when it does not go to a terminal: wider than any line we print."""


def make_console(stderr: bool = False) -> Console:
    """A console for stdout (or stderr) that wraps at the terminal's width, or not at all when the
    stream is not a terminal (see the module invariant)."""
    probe = Console(stderr=stderr)
    if probe.is_terminal:
        return probe
    return Console(stderr=stderr, width=PIPE_WIDTH, soft_wrap=True)


def interactive(c: Console) -> bool:
    """Whether progress may be drawn on `c` (a terminal, not a pipe or a log file)."""
    return c.is_terminal and not c.is_dumb_terminal


def table(*headers: str) -> Table:
    """A table whose cells fold (wrap inside the cell) where a terminal is too narrow, never cut."""
    return Table(*(Column(h, overflow="fold") for h in headers))


console = make_console()
"""Where command output goes."""
err = make_console(stderr=True)
"""Where errors and progress go (stdout stays machine-readable)."""

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML config file (keys = option names).")]
StateOpt = Annotated[Path | None, typer.Option("--state-dir", help=(
    "State dir (default: $CLAWBRIDGE_STATE_DIR, else the running server's when one runs, else ~/.clawbridge)."))]
UpStateOpt = Annotated[Path | None, typer.Option("--state-dir", help=(
    "State dir: store, keys, checkpoints (default: $CLAWBRIDGE_STATE_DIR, else ~/.clawbridge)."))]


def settings_or_exit(config: Path | None, *, backend_flags: dict[str, dict[str, Any]] | None = None,
                     **overrides: Any) -> Settings:
    """The resolved settings, or exit 2 with the configuration error (never a traceback)."""
    try:
        return load_settings(config, backend_flags=backend_flags, **overrides)
    except Exception as exc:  # pydantic errors, missing file
        err.print(f"[red]configuration error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None


def store_or_exit(settings: Settings) -> Any:
    """The store in the settings' state dir, or exit 1 when there is none yet."""
    from clawbridge.store import DB_FILENAME, Store

    path = settings.state_path / DB_FILENAME
    if not path.exists():
        err.print(f"no store at {path}; run `clawbridge up` first or pass --state-dir")
        raise typer.Exit(1)
    return Store(path)
