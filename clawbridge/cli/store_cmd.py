"""`clawbridge store check | recover | backup`: the store's health, salvage and backups."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from clawbridge.cli.common import ConfigOpt, StateOpt, console, err
from clawbridge.cli.target import resolve

app = typer.Typer(help="Check, back up and recover the store (the SQLite file in the state dir).",
                  no_args_is_help=True)


def _db(state_dir: Path | None, config: Path | None) -> Path:
    from clawbridge.store import DB_FILENAME

    return resolve(config, state_dir).settings.state_path / DB_FILENAME


@app.command("check")
def check(state_dir: StateOpt = None, config: ConfigOpt = None,
          full: Annotated[bool, typer.Option("--full", help="integrity_check (slower) instead of quick_check.")] = False,
          ) -> None:
    """Check the store file; exit 1 (saying how to recover) when it is damaged."""
    from clawbridge.store.health import quick_check, recovery_hint

    db = _db(state_dir, config)
    if not db.exists():
        err.print(f"no store at {db}")
        raise typer.Exit(1)
    problems = ["the file is 0 bytes"] if db.stat().st_size == 0 else quick_check(db, full=full)
    if problems:
        err.print(f"[red]{db} is damaged:[/red] " + "; ".join(problems[:5]), highlight=False, soft_wrap=True)
        err.print(recovery_hint(db), highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    console.print(f"{db}: ok ({db.stat().st_size} bytes)", highlight=False, soft_wrap=True)


@app.command("recover")
def recover(state_dir: StateOpt = None, config: ConfigOpt = None) -> None:
    """Copy every readable row into a fresh store in its place (stop the server first).

    The damaged file is kept beside it as clawbridge.db.damaged-<time>.
    """
    from clawbridge.runtime.instance import StateDirBusy, StateDirLock
    from clawbridge.store.health import recover_store

    db = _db(state_dir, config)
    if not db.exists():
        err.print(f"no store at {db}")
        raise typer.Exit(1)
    lock = StateDirLock(db.parent)  # a running server writes to the file being replaced
    try:
        lock.acquire()
    except StateDirBusy as exc:
        err.print(f"[red]cannot recover now:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    try:
        report = recover_store(db)
    finally:
        lock.release()
    for table, n in report.rows.items():
        lost = report.lost.get(table, 0)
        console.print(f"  {table}: {n} rows recovered" + (f", {lost} unreadable" if lost else ""), highlight=False, soft_wrap=True)
    console.print(f"recovered store: {report.recovered}; damaged file kept at {report.damaged_kept_at}",
                  highlight=False, soft_wrap=True)


@app.command("backup")
def backup(state_dir: StateOpt = None, config: ConfigOpt = None) -> None:
    """A consistent copy of the store into <state dir>/backups (safe while the server runs)."""
    from clawbridge.store.health import backup_store, quick_check

    db = _db(state_dir, config)
    if not db.exists():
        err.print(f"no store at {db}")
        raise typer.Exit(1)
    problems = quick_check(db)
    if problems:
        err.print(f"[red]not backing up a damaged store:[/red] {'; '.join(problems[:3])}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    console.print(f"backup written: {backup_store(db)}", highlight=False, soft_wrap=True)
