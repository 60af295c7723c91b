"""`clawbridge checkpoints list` and `clawbridge rollback VERSION`: the trainer's checkpoints and
policy versions as the store records them (`clawbridge.store.versions`).

Invariant: a rollback never reuses a number. While a server runs, `rollback` asks it
(`/rl/rollback`, the promotion API), which serves the version and trains on from it. Otherwise it
commits a NEW version (kind `rollback`) that names the older version's checkpoint; the next
`clawbridge up` serves it and trains on from it. Offline it runs only while no server holds the
state dir (the state dir lock), so a running trainer never has its versions changed underneath it.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Annotated

import typer

from clawbridge.cli.common import ConfigOpt, StateOpt, console, err, store_or_exit, table
from clawbridge.cli.target import resolve

checkpoints_app = typer.Typer(help="The trainer's checkpoints (one per committed policy version).",
                              no_args_is_help=True)


@checkpoints_app.command("list")
def checkpoints_list(
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
    limit: Annotated[int, typer.Option(help="How many, newest first.")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Committed policy versions, newest first: what produced each one and where its checkpoint is.
    The newest is what `clawbridge up` serves; any not pruned is a `clawbridge rollback` target."""
    from clawbridge.store.versions import VersionStore

    store = store_or_exit(resolve(config, state_dir).settings)
    rows = VersionStore(store).listing(limit)
    if as_json:
        print(json.dumps([r.__dict__ for r in rows], indent=2))
        return
    if not rows:
        console.print("no checkpoints yet: the first one is written before the first training step")
        return
    listing = table("version", "kind", "from", "step", "committed", "checkpoint", "model")
    for r in rows:
        src = f"v{r.source_version}" if r.source_version is not None else ""
        when = dt.datetime.fromtimestamp(r.committed_at).strftime("%Y-%m-%d %H:%M:%S") if r.committed_at else ""
        model = (r.identity or {}).get("model") or ""
        where = f"pruned ({r.checkpoint})" if r.pruned_at is not None else (r.checkpoint or "")
        listing.add_row(f"v{r.version}", r.kind, src, "" if r.step is None else str(r.step), when, where, str(model))
    console.print(listing)
    pruned = sum(r.pruned_at is not None for r in rows)
    if pruned:
        console.print(f"{pruned} pruned: their checkpoints were deleted (keep_checkpoints); "
                      "they cannot be rolled back to")


def rollback(
    version: Annotated[int, typer.Argument(help="The committed policy version to go back to.")],
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Serve an earlier committed version again. While a server runs: at once (with promotion on it
    is the serving version; the trainer goes on from it), recorded as an admin decision. Stopped:
    its checkpoint under a new version number, served and trained on from at the next `up`."""
    from clawbridge.cli.promotion_cmd import set_serving_online
    from clawbridge.instance import StateDirBusy, StateDirLock
    from clawbridge.store.versions import VersionStore
    from clawbridge.trainer.checkpoints import no_checkpoint_message

    target = resolve(config, state_dir)
    if set_serving_online(target, version, "rollback"):
        return
    store = store_or_exit(target.settings)
    lock = StateDirLock(target.state_dir)
    try:
        lock.acquire()
    except StateDirBusy as exc:
        store.close()
        err.print(f"[red]cannot roll back now:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    try:
        versions = VersionStore(store)
        row = versions.get(version)
        if row is None or not row.restorable or row.checkpoint is None:
            err.print(no_checkpoint_message(version, row))
            raise typer.Exit(1)
        new = versions.reserve("rollback", None, version)
        versions.commit(new, row.checkpoint, row.identity)
    finally:
        lock.release()
        store.close()
    console.print(f"rolled back: v{new} serves v{version}'s checkpoint ({row.checkpoint}); "
                  "the next `clawbridge up` serves it and trains on from it")
