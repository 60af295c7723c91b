"""`clawbridge eval`, `clawbridge promote N`, `clawbridge resume` and (while a server runs)
`clawbridge rollback N`: the promotion API of the running server
(`clawbridge.proxy.promotion_routes`), with the admin key; `resume` also works on the store alone.

Invariant: these commands change nothing themselves; the server decides and records, so what
they print is what the server committed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from clawbridge.cli.common import ConfigOpt, StateOpt, console, err, table
from clawbridge.cli.target import NoServer, Target, answer_of, no_server_message, resolve, server_request

EVAL_TIMEOUT_S = 3600.0
"""`clawbridge eval` waits this long for the server's answers (a big set on a slow model)."""


UserOpt = Annotated[str | None, typer.Option(
    "--user", help="The lane: VERSION is one of this user's own adapter (per_user_adapters), served to her calls.")]


def set_serving_online(target: Target, version: int, action: str, user: str | None = None) -> bool:
    """Ask the target's running server to serve `version` (`action`: promote or rollback) in the
    shared policy's lane, or in `user`'s; False when no server runs on its state dir."""
    body: dict[str, Any] = {"version": version} if user is None else {"version": version, "user": user}
    try:
        r = server_request(target, "POST", f"/rl/{action}", body)
    except NoServer:
        return False
    out = answer_of(r)
    if user is not None:
        was = f"v{out['previous']}" if out.get("previous") is not None else "the shared policy"
        console.print(f"{action}: {user}'s calls get v{out['serving_version']} now, v{version}'s adapter (was {was}); "
                      "her lane trains on from it", highlight=False)
        return True
    trainer = (f"; the trainer goes on from it (as v{out['trainer_version']})"
               if out.get("trainer_version") is not None else "")
    held = "; training holds until `clawbridge resume`" if out.get("held") else ""
    console.print(f"{action}: v{out['serving_version']} serves now (was v{out['previous']}){trainer}{held}",
                  highlight=False)
    return True


def resume(
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
) -> None:
    """End the hold of a `clawbridge rollback`: training goes on from the version that serves
    (its later versions gated as promotion_mode says). Works with or without a running server."""
    target = resolve(config, state_dir)
    try:
        out = answer_of(server_request(target, "POST", "/rl/resume", {}))
    except NoServer:
        out = resume_offline(target.state_dir)
    if out["resumed"]:
        console.print(f"resumed: training goes on from v{out['serving_version']} (v{out['held_version']} was held "
                      "by a rollback)", highlight=False)
    else:
        console.print("nothing to resume: no rollback holds training", highlight=False)


def resume_offline(state_dir: Path) -> dict[str, Any]:
    """`resume` on the store while no server runs (under the state dir lock)."""
    from clawbridge.runtime.instance import StateDirBusy, StateDirLock
    from clawbridge.store import DB_FILENAME, Store
    from clawbridge.store.promotion import PromotionStore

    if not (state_dir / DB_FILENAME).exists():
        return {"resumed": False, "held_version": None, "serving_version": None}
    lock = StateDirLock(state_dir)
    try:
        lock.acquire()
    except StateDirBusy as exc:
        err.print(f"[red]cannot resume now:[/red] {exc}")
        raise typer.Exit(1) from None
    store = Store.open(state_dir)
    try:
        ps = PromotionStore(store)
        held = ps.release_hold()
        state = ps.state()
    finally:
        store.close()
        lock.release()
    return {"resumed": held is not None, "held_version": held,
            "serving_version": state.serving_version if state is not None else None}


def promote(
    version: Annotated[int, typer.Argument(help="The committed policy version to serve.")],
    user: UserOpt = None,
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Serve a committed version now (e.g. one promotion rejected), on the running server; the
    trainer goes on from it. Recorded as an admin decision (`clawbridge status`). A version of a
    user's own adapter serves only her, and only with `--user` naming her."""
    target = resolve(config, state_dir)
    if not set_serving_online(target, version, "promote", user):
        err.print(escape(no_server_message(target, "`clawbridge promote`") + " (`clawbridge rollback N` also works "
                         "with no server running)"), highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _parse_versions(text: str) -> list[int | str]:
    out: list[int | str] = []
    for part in (p.strip() for p in text.split(",")):
        if part in ("latest", "serving"):
            out.append(part)
        elif part.isdigit():
            out.append(int(part))
        else:
            err.print(f"--versions: {part!r} is not a version number, 'latest' or 'serving'")
            raise typer.Exit(2)
    return out


def evaluate(
    versions: Annotated[str, typer.Option(
        help="Comma-separated versions: numbers, 'latest' (the newest trained) and 'serving'.")] = "serving,latest",
    eval_set: Annotated[Path | None, typer.Option(
        "--eval-set", help="A JSONL eval set (default: the server's eval_set, or its held-out sessions).")] = None,
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Evaluate policy versions on the running server (greedy answers): per version its pass rate
    with a 95% (Wilson) interval, mean judge score (rubric lines) and mean answer length."""
    from clawbridge.promotion.evalset import EvalSetError, load_eval_set

    target = resolve(config, state_dir)
    settings = target.settings
    body: dict[str, Any] = {"versions": _parse_versions(versions)}
    if eval_set is not None:
        try:
            load_eval_set(eval_set, settings.eval_max_tokens)  # a bad line is named here, before any call
        except EvalSetError as exc:
            err.print(f"[red]bad eval set:[/red] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(2) from None
        body["eval_set"] = eval_set.expanduser().read_text(encoding="utf-8")
    try:
        out = answer_of(server_request(target, "POST", "/rl/eval", body, EVAL_TIMEOUT_S))
    except NoServer:
        err.print(escape(no_server_message(target, "`clawbridge eval`")), highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if as_json:
        import json

        print(json.dumps(out, indent=2))
        return
    console.print(f"eval set: {out['eval_set']} ({out['items']} items)", highlight=False)
    results = table("version", "passed", "pass rate (95% CI)", "score", "mean judge score", "mean answer tokens",
                    "seconds")
    for r in out["results"]:
        judge = "-" if r["mean_judge_score"] is None else f"{r['mean_judge_score']:+.2f}"
        results.add_row(f"v{r['version']}", f"{r['passed']}/{r['items']}",
                        f"{r['pass_rate']:.3f} ({r['ci_low']:.3f}-{r['ci_high']:.3f})", f"{r['score']:.3f}", judge,
                        f"{r['mean_answer_tokens']:.1f}", f"{r['seconds']:.1f}")
    console.print(results)
