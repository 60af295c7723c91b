"""`clawbridge checkpoints list` and `clawbridge rollback VERSION`: the trainer's checkpoints and
policy versions as the store records them (`clawbridge.store.versions`).

Invariant: a rollback never reuses a number, and it holds: training waits until `clawbridge
resume`. While a server runs, `rollback` asks it (`/rl/rollback`, the promotion API), which serves
the version. Otherwise it commits a NEW version (kind `rollback`) that names the older version's
checkpoint and records the admin's decision with its hold; the next `clawbridge up` serves it. Offline it runs only while no server holds the
state dir (the state dir lock), so a running trainer never has its versions changed underneath it.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Annotated, Any

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
    user: Annotated[str | None, typer.Option(
        "--user", help="The lane: VERSION is one of this user's own adapter (per_user_adapters).")] = None,
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Serve an earlier committed version again, and hold it: no training step runs until
    `clawbridge resume` (then training goes on from it). While a server runs: at once, recorded as
    an admin decision. Stopped: its checkpoint under a new version number, served at the next `up`.
    A version of a user's own adapter goes back only in her lane, and only with `--user` naming her
    (her lane trains on from it; the shared policy's training does not hold)."""
    from clawbridge.cli.promotion_cmd import set_serving_online
    from clawbridge.runtime.instance import StateDirBusy, StateDirLock
    from clawbridge.store.versions import VersionStore
    from clawbridge.trainer.checkpoints import no_checkpoint_message

    target = resolve(config, state_dir)
    if set_serving_online(target, version, "rollback", user):
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
        versions = VersionStore(store, user or "")  # bound to the lane: another lane's version is not found
        row = versions.get(version)
        if row is None or not row.restorable or row.checkpoint is None:
            other = VersionStore(store).find(version)
            if row is None and other is not None:
                lane = f"user {other.lane}'s adapter" if other.lane else "the shared policy"
                asked = f"user {user}'s lane" if user else "the shared policy's lane"
                how = f"pass --user {other.lane}" if other.lane else "leave out --user"
                err.print(f"policy version {version} is {lane}, not in {asked}; {how}")
            else:
                err.print(no_checkpoint_message(version, row))
            raise typer.Exit(1)
        new = versions.reserve("rollback", None, version)
        versions.commit(new, row.checkpoint, row.identity)
        if not user:  # the hold is the shared policy's (promotion's state); a lane trains on from it
            hold_offline_rollback(store, version)
    finally:
        lock.release()
        store.close()
    if user:
        console.print(f"rolled back {user}'s adapter: v{new} serves v{version}'s checkpoint ({row.checkpoint}); "
                      f"from the next `clawbridge up`, {user}'s calls get it and her lane trains on from it")
        return
    console.print(f"rolled back: v{new} serves v{version}'s checkpoint ({row.checkpoint}); the next `clawbridge up` "
                  "serves it, and training holds until `clawbridge resume`")


def hold_offline_rollback(store: Any, version: int) -> None:
    """Record an offline rollback to `version` as the admin's decision, holding training (as a
    rollback through the running server does: `clawbridge.promotion.admin.set_serving`)."""
    from clawbridge.store.promotion import Decision, PromotionStore

    ps = PromotionStore(store)
    state = ps.state()
    previous = state.serving_version if state is not None else None
    was = f"serving was v{previous}" if previous is not None else "no server running"
    ps.decide(Decision(version, "promoted", "admin", f"rollback by the admin, offline ({was}); training holds "
                       "until `clawbridge resume`", previous), state.mode if state is not None else "off", True)
