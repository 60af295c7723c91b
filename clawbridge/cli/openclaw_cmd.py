"""`clawbridge openclaw install | uninstall | status` (mounted by `clawbridge.cli.main`).

Invariants:
- The client key is never printed; the config path and the key's source are.
- install asks the running server (`GET <base_url>/models`) for the served model's id,
  `context_window` and `max_output_tokens`; when the server is not reachable it says so and uses
  the defaults (re-run install after `clawbridge up` to pick up the real values).
- install and uninstall say what they did and where: which OpenClaw command ran (or that none was
  found and the file was edited by hand), every file written or created (openclaw.json, its
  backup, the extension copy, the install record), and how to undo it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from clawbridge.cli.common import StateOpt, console, err
from clawbridge.cli.target import resolve
from clawbridge.openclaw import install_status, installer
from clawbridge.openclaw.openclaw_cli import OpenClawCli, OpenClawCliError, find_openclaw_cli
from clawbridge.runtime.address import base_url_for

app = typer.Typer(
    help="Connect OpenClaw to clawbridge (provider + session-header extension).", no_args_is_help=True
)

OpenClawConfigOpt = Annotated[
    Path | None,
    typer.Option("--openclaw-config", help="openclaw.json to edit (default: where OpenClaw looks for it)."),
]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="clawbridge TOML config file.")]
OpenClawCliOpt = Annotated[
    str,
    typer.Option(
        "--openclaw-cli",
        help="OpenClaw's CLI for the plugin part: auto (`openclaw` on PATH, if any), none (edit "
        "openclaw.json by hand), or the path of an `openclaw` executable.",
    ),
]


def _openclaw_cli(choice: str) -> OpenClawCli | None:
    try:
        return find_openclaw_cli(choice)
    except OpenClawCliError as exc:
        err.print(f"[red]{escape(str(exc))}[/red]")
        raise typer.Exit(2) from None


def _settings_state_and_url(config: Path | None, state_dir: Path | None) -> tuple[Path, str]:
    """The state dir (`clawbridge.cli.target`) and the OpenAI base URL of its running server (or,
    when none runs, the configured address)."""
    target = resolve(config, state_dir)
    if target.server is not None:
        return target.state_dir, f"{target.server.url}/v1"
    return target.state_dir, base_url_for(target.settings.host, target.settings.port)


def served_model(base_url: str, api_key: str, timeout_s: float = 3.0) -> dict[str, Any] | None:
    """The first model the server lists (id, context_window, max_output_tokens), or None."""
    import httpx

    try:
        resp = httpx.get(
            f"{base_url.rstrip('/')}/models",
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout_s,
        )
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    models = [m for m in data if isinstance(m, dict) and m.get("id")]
    named = [m for m in models if m.get("id") != "default"]
    candidates = named or models
    return candidates[0] if candidates else None


@app.command()
def install(
    openclaw_config: OpenClawConfigOpt = None,
    base_url: Annotated[
        str | None, typer.Option("--base-url", help="clawbridge URL (default from settings).")
    ] = None,
    provider_id: Annotated[str, typer.Option("--provider-id", help="OpenClaw provider id.")] = "clawbridge",
    model_id: Annotated[
        str | None, typer.Option("--model-id", help="Model id (default: what the server serves).")
    ] = None,
    set_default: Annotated[
        bool, typer.Option("--set-default", help="Make it OpenClaw's default model.")
    ] = False,
    agent_as_user: Annotated[bool, typer.Option(
        "--agent-as-user", help="The extension sends each agent's id as X-User-Id, so clawbridge records every "
        "agent as its own user (start the server with trust_user_header = true; see docs/users.md).")] = False,
    openclaw_cli: OpenClawCliOpt = "auto",
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Add the clawbridge provider and extension to openclaw.json (idempotent, backed up first)."""
    state, settings_url = _settings_state_and_url(config, state_dir)
    cli = _openclaw_cli(openclaw_cli)
    url = (base_url or settings_url).rstrip("/")
    try:
        key = installer.resolve_client_key(state)
    except Exception as exc:
        err.print(f"[red]cannot read the client key:[/red] {exc}")
        raise typer.Exit(1) from None
    info = served_model(url, key)
    if info is None:
        err.print(
            f"[yellow]clawbridge is not answering at {url}; using default model limits "
            f"(context {installer.DEFAULT_CONTEXT_WINDOW}, max tokens {installer.DEFAULT_MAX_TOKENS}).[/yellow]"
        )
        info = {}
    opts = installer.InstallOptions(
        api_key=key,
        config_path=openclaw_config,
        base_url=url,
        provider_id=provider_id,
        model_id=model_id or str(info.get("id") or installer.DEFAULT_MODEL_ID),
        context_window=int(info.get("context_window") or installer.DEFAULT_CONTEXT_WINDOW),
        max_tokens=int(info.get("max_output_tokens") or installer.DEFAULT_MAX_TOKENS),
        set_default=set_default,
        agent_as_user=agent_as_user,
    )
    if cli is not None:
        console.print(f"OpenClaw's CLI: {cli.describe()} (installs the plugin; this can take a minute)")
    try:
        result = installer.install(state, opts, cli)
    except installer.InstallError as exc:
        err.print(f"[red]{escape(str(exc))}[/red]")
        raise typer.Exit(1) from None
    _report_install(result, opts, openclaw_cli, set_default)


def _report_install(
    result: installer.InstallResult, opts: installer.InstallOptions, cli_choice: str, set_default: bool
) -> None:
    """Say what install did, where, and how to undo it (never the key itself)."""
    path = result.config_path
    if result.plugin_managed_by_openclaw:
        console.print(f"plugin: installed by OpenClaw itself at {result.extension_dir} (left as it is)")
    elif result.openclaw_command:
        console.print(f"plugin: ran `{' '.join(result.openclaw_command)}`")
        console.print("  (OpenClaw rewrites openclaw.json as plain JSON: comments are dropped; the backup keeps them)")
    else:
        if cli_choice == "auto":
            err.print(
                "[yellow]OpenClaw's CLI (`openclaw`) is not on PATH: openclaw.json was edited by hand "
                "(plugins.load.paths names the extension copy).[/yellow]"
            )
        console.print(f"plugin: extension files copied to {result.extension_dir}")
    if result.created_config:
        console.print(
            f"created {path} (mode 0600: it holds the clawbridge client key, as "
            f"models.providers.{opts.provider_id}.apiKey)"
        )
    if result.changed:
        console.print(f"wrote in {path}: " + ", ".join(result.changed))
        for backup in result.backups:
            console.print(f"backup of the file as it was: {backup}")
    else:
        console.print(
            f"{path} already has clawbridge ({opts.provider_id}/{opts.model_id}); nothing to do"
        )
    console.print(
        f"model: {opts.provider_id}/{opts.model_id} at {opts.base_url}"
        + ("" if set_default else f"  (use --set-default or `--model {opts.provider_id}/{opts.model_id}`)")
    )
    if result.record_path is not None:
        undo = "clawbridge openclaw uninstall" + (
            "" if path == installer.resolve_config_path() else f" --openclaw-config {path}"
        )
        console.print(
            f"recorded in {result.record_path}; to undo: `{undo}`"
            + (" (deletes the file it created)" if result.created_config else "")
        )


@app.command()
def uninstall(
    openclaw_config: OpenClawConfigOpt = None,
    openclaw_cli: OpenClawCliOpt = "auto",
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Undo what install changed in openclaw.json and remove the extension copy."""
    state, _ = _settings_state_and_url(config, state_dir)
    cli = _openclaw_cli(openclaw_cli)
    try:
        result = installer.uninstall(state, openclaw_config, cli)
    except installer.InstallError as exc:
        err.print(f"[red]{escape(str(exc))}[/red]")
        raise typer.Exit(1) from None
    if not result.was_installed:
        console.print(f"clawbridge has no record of installing into {result.config_path}; nothing to do")
        return
    if result.openclaw_command:
        console.print(f"plugin: ran `{' '.join(result.openclaw_command)}`")
    console.print(
        f"restored in {result.config_path}: " + (", ".join(result.restored) or "nothing to restore")
    )
    if result.deleted_config:
        console.print(f"deleted {result.config_path}: install had created it and nothing else was in it")
    if result.kept:
        err.print("[yellow]left alone (changed since install): " + ", ".join(result.kept) + "[/yellow]")
    for item in result.leftover:
        err.print(f"[yellow]left: {escape(item)}[/yellow]")
    if result.backup_path:
        console.print(f"backup: {result.backup_path}")


@app.command()
def status(
    openclaw_config: OpenClawConfigOpt = None,
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Say what is installed and whether recent calls carried the session headers."""
    state, _ = _settings_state_and_url(config, state_dir)
    try:
        report = install_status.status(state, openclaw_config)
    except installer.InstallError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    if as_json:
        console.print_json(json.dumps(report))
        return
    ok = "[green]yes[/green]"
    no = "[red]no[/red]"
    console.print(
        f"openclaw config: {report['config_path']}" + ("" if report["config_exists"] else " (missing)")
    )
    console.print(f"installed: {ok if report['installed'] else no}")
    provider = report["provider"]
    console.print(
        f"provider {report['provider_id']}: "
        + (f"{provider['baseUrl']} models={provider['models']}" if provider else "absent")
    )
    console.print(
        f"plugin enabled: {ok if report['plugin_enabled'] else no}; "
        f"conversation access: {ok if report['conversation_access'] else no}; "
        f"load path: {ok if report['load_path_configured'] else no}; "
        f"extension files: {ok if report['extension_present'] else no}"
        + ("" if report["extension_current"] is not False else " (outdated: run install again)")
    )
    if report["allowlist"] is not None:
        console.print(f"in plugins.allow: {ok if report['allowlist'] else no}")
    console.print(f"default model: {report['default_model'] or '(not set)'}")
    calls = report["recent_calls"]
    if calls is None:
        console.print("recent calls: no store yet (start `clawbridge up` and run an OpenClaw turn)")
    elif calls["turns"] == 0:
        console.print("recent calls: none recorded yet")
    else:
        console.print(
            f"recent calls: {calls['with_turn_headers']}/{calls['turns']} carried the turn headers, "
            f"{calls['in_header_sessions']} in X-Session-Id sessions; main={calls['main']} "
            f"side={calls['side']} triggers={calls['triggers']}"
        )
