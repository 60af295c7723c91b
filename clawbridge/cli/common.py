"""What the `clawbridge` commands share: the consoles, the --config/--state-dir options, and
reading the settings and the store with a clear error instead of a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

import clawbridge.plugins  # noqa: F401  (registers where a backend's old flat option moved: clawbridge.plugins)
from clawbridge.config import Settings, load_settings

console = Console()
"""Where command output goes."""
err = Console(stderr=True)
"""Where errors and progress go (stdout stays machine-readable)."""

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML config file (keys = option names).")]
StateOpt = Annotated[Path | None, typer.Option("--state-dir", help="State dir (default ~/.clawbridge).")]


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
