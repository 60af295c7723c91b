"""Wiring for `clawbridge up`: settings -> backend -> renderer, store, keys -> app -> uvicorn.

Invariants:
- A non-loopback bind is refused unless both keys come from the environment (a generated key in a
  file on this machine is no protection for a port others can reach), each is strong
  (`MIN_BIND_KEY_LENGTH` characters, `MIN_BIND_KEY_DISTINCT` distinct ones) and they differ (a
  client key that is also the admin key would give every agent the management API).
- Nothing is announced ("serving ...") before the state dir is known to be usable: private
  (0700), writable, and its store intact (`clawbridge.store.health`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import json
import logging
import math
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from clawbridge.backend import (
    ModelInfo,
    RemoteCheckpoints,
    ServingBackend,
    TrainingBackend,
    UnsupportedSettings,
    check_capabilities,
)
from clawbridge.chat.render import Renderer
from clawbridge.config import Settings
from clawbridge.openclaw.installer import DEFAULT_PROVIDER_ID, InstallOptions, provider_entry
from clawbridge.plugins import load_backend
from clawbridge.privacy.guard import build_guard
from clawbridge.promotion.announce import lanes_line, promotion_line, rehearsal_words
from clawbridge.promotion.describe import probe_line
from clawbridge.promotion.promoter import build_promoter, promoted_version
from clawbridge.promotion.report import promotion_status
from clawbridge.proxy.app import build_app
from clawbridge.proxy.auth import Keys
from clawbridge.proxy.connections import header_timeout_protocol
from clawbridge.proxy.guard import Drain
from clawbridge.proxy.state import ProxyState, StoreWriter
from clawbridge.rewards.note_check import NoteChecker
from clawbridge.rewards.notes import NoteBook, NotesConfig
from clawbridge.rewards.worker import build_reward_worker
from clawbridge.runtime.address import base_url_for, clear_address, root_url_for, write_address
from clawbridge.runtime.clock import SYSTEM_CLOCK, Clock
from clawbridge.runtime.instance import StateDirLock, bind_listener
from clawbridge.runtime.keys import ADMIN_KEY_FILE, CLIENT_KEY_FILE, ResolvedKey, ensure_key
from clawbridge.serving.sampler import SequenceScorer
from clawbridge.store import DB_FILENAME, Store
from clawbridge.store.health import check_store_file, prepare_state_dir
from clawbridge.telemetry.reporting import build_reporter
from clawbridge.trainer import TrainerLoop
from clawbridge.trainer.checkpoints import CheckpointKeeper, check_identity
from clawbridge.trainer.deletions import DeletionRetrier
from clawbridge.trainer.identity import checkpoint_identity
from clawbridge.trainer.lanes import PerUserTraining, UserLanes, per_user_problem

log = logging.getLogger("clawbridge")


class UnsafeBind(RuntimeError):
    """Refused to listen beyond loopback without configured keys."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ResolvedKeys:
    client: ResolvedKey
    admin: ResolvedKey


def resolve_keys(settings: Settings) -> ResolvedKeys:
    state = settings.state_path
    client = ensure_key(state, CLIENT_KEY_FILE, settings.api_key.get_secret_value() if settings.api_key else None, "cb")
    admin = ensure_key(state, ADMIN_KEY_FILE,
                       settings.admin_key.get_secret_value() if settings.admin_key else None, "cbadmin")
    return ResolvedKeys(client, admin)


MIN_BIND_KEY_LENGTH = 24
MIN_BIND_KEY_DISTINCT = 10


def _weak(key: str) -> bool:
    return len(key) < MIN_BIND_KEY_LENGTH or len(set(key)) < MIN_BIND_KEY_DISTINCT


def check_bind(settings: Settings) -> None:
    if is_loopback(settings.host):
        return
    if settings.api_key is None or settings.admin_key is None:
        raise UnsafeBind(
            f"refusing to bind {settings.host}: set CLAWBRIDGE_API_KEY and CLAWBRIDGE_ADMIN_KEY in the environment "
            "before listening beyond 127.0.0.1"
        )
    client, admin = settings.api_key.get_secret_value(), settings.admin_key.get_secret_value()
    weak = [name for name, key in (("CLAWBRIDGE_API_KEY", client), ("CLAWBRIDGE_ADMIN_KEY", admin)) if _weak(key)]
    if weak:
        raise UnsafeBind(
            f"refusing to bind {settings.host}: {' and '.join(weak)} must be at least {MIN_BIND_KEY_LENGTH} characters "
            f"with {MIN_BIND_KEY_DISTINCT}+ distinct ones (e.g. `python -c \"import secrets; print(secrets.token_urlsafe(32))\"`)"
        )
    if client == admin:
        raise UnsafeBind(f"refusing to bind {settings.host}: CLAWBRIDGE_API_KEY and CLAWBRIDGE_ADMIN_KEY must differ")


async def build_state(settings: Settings, backend: ServingBackend | None = None,
                      clock: Clock = SYSTEM_CLOCK) -> ProxyState:
    """Start the backend and assemble what the app needs.

    `clock` is the store's (`clawbridge.runtime.clock`): tests pass a `FakeClock` to move time.
    The store is opened first, so a state dir whose checkpoints belong to another model, LoRA
    config or backend refuses before any model loads (`clawbridge.trainer.identity`)."""
    check_bind(settings)
    for note in prepare_state_dir(settings.state_path):
        log.warning("%s", note)
    log.info("checking the store's integrity")
    check_store_file(settings.state_path / DB_FILENAME)
    keys = resolve_keys(settings)
    store = Store.open(settings.state_path, clock)
    try:
        identity = checkpoint_identity(settings, backend.name if backend is not None else settings.backend)
        check_identity(store, identity)
        if backend is None:
            backend = load_backend(settings.backend, settings)
        problems = check_capabilities(settings, backend)
        lanes_problem = per_user_problem(settings, backend) if settings.train else None
        if lanes_problem:
            problems.append(lanes_problem)
        if problems:
            raise UnsupportedSettings("; ".join(problems))
        await backend.start()
        info = backend.model_info()
        renderer = await asyncio.to_thread(Renderer.from_pretrained, info.tokenizer_path)
        log.info("%s: %s", info.name, renderer.describe())
        keeper: CheckpointKeeper | None = None
        if isinstance(backend, TrainingBackend):
            # Serve the newest committed version, with or without training: checkpoints belong to
            # the trainer loop (clawbridge.trainer.checkpoints), never to the backend's start().
            keeper = CheckpointKeeper(store, backend, identity, keep=settings.keep_checkpoints)
            await keeper.resume(None if settings.train else promoted_version(settings, store))
    except BaseException:
        store.close()
        if backend is not None:
            await backend.close()
        raise
    state = ProxyState(settings=settings, backend=backend, model_info=info, renderer=renderer, store=store,
                       writer=StoreWriter(store), keys=Keys(client=keys.client.value, admin=keys.admin.value,
                                                           trust_user_header=settings.trust_user_header))
    state.privacy = build_guard(settings, backend, renderer)
    if isinstance(backend, RemoteCheckpoints):
        state.deletions = DeletionRetrier(store, backend)
    if settings.train and keeper is not None and isinstance(backend, TrainingBackend):
        if settings.per_user_adapters and isinstance(backend, PerUserTraining):
            step_lock = asyncio.Lock()  # every lane's steps take turns (clawbridge.trainer.lanes)
            state.trainer = TrainerLoop.from_settings(settings, store, backend, keeper, state.privacy, lane="",
                                                      step_lock=step_lock)
            state.lanes = UserLanes(settings, store, backend, step_lock, identity, state.privacy)
            state.router.lanes = state.lanes
        else:
            state.trainer = TrainerLoop.from_settings(settings, store, backend, keeper, state.privacy)
    if settings.notes:  # a user's notes: from the judge's hints when one is on, or written by hand
        state.notes = NoteBook(store, NotesConfig.from_settings(settings))
        state.notes.refresh()
    state.judge = await build_reward_worker(settings, store, backend, renderer, state.privacy, state.notes)
    if state.judge is not None and state.notes is not None and settings.notes_pick_by_judge:
        state.note_checker = NoteChecker(state.judge.judge, timeout_s=settings.notes_pick_timeout_s,
                                         max_tokens=settings.judge_max_tokens, privacy=state.privacy)
    try:
        state.promotion = build_promoter(settings, state.store, state.router, renderer,
                                         state.judge.judge if state.judge is not None else None)
        await state.promotion.recover()
    except BaseException:
        store.close()
        await backend.close()
        raise
    if state.trainer is not None:
        state.trainer.gate = state.promotion
        if state.lanes is not None:
            state.lanes.rehearsals = state.promotion
        state.reporter = build_reporter(settings, store)
    return state


def openclaw_provider_snippet(base_url: str, key_hint: str, info: ModelInfo) -> str:
    """The `models.providers.clawbridge` block for openclaw.json, as the installer writes it."""
    entry = provider_entry(InstallOptions(api_key=key_hint, base_url=base_url, model_id=info.name,
                                          context_window=info.context_window,
                                          max_tokens=info.max_output_tokens))
    return json.dumps({"models": {"providers": {DEFAULT_PROVIDER_ID: entry}}}, indent=2)


YOUNG_GC_THRESHOLD = 10_000
"""Container allocations between collections of the youngest generation (CPython's default: 700)."""


def tune_gc() -> None:
    """Set the cyclic collector for serving, once start-up is over.

    - What start-up made (modules, the tokenizer, the model) lives as long as the server, so it is
      frozen out of the collector's generations: a full collection (about 120 ms over all of it
      with the tiny model loaded) then scans only what serving allocated.
    - Calls in flight hold their parsed bodies, so at 16 clients with 40 KB requests the default
      threshold ran about one young collection per call, each pausing the event loop, and promoted
      live request data into older generations. At `YOUNG_GC_THRESHOLD` that was 42 young
      collections per 1,300 calls instead of 1,080 (`bench/proxy_overhead.py`, docs/benchmarks.md).
      Garbage without cycles is freed by reference counting as before; only cycles wait longer.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, older, oldest)


class ProxyServer(uvicorn.Server):
    """uvicorn's server that records its address once listening, and does not re-raise a caught
    SIGTERM/SIGINT once it has shut down.

    uvicorn re-raises the signal so the default handler ends the process; that ends it before
    `serve`'s cleanup (flush the store writer, close the backend: stop the trainer, delete the
    Fireworks resources it was asked to) has run. We stop gracefully instead and return.
    """

    def __init__(self, config: uvicorn.Config, state_dir: Path, drain: Drain | None = None,
                 drain_grace_s: float = 0.0, lock: StateDirLock | None = None, tune_gc: bool = False,
                 model: str = "") -> None:
        """`tune_gc`: this process only serves (`clawbridge serve`/`up`), so `tune_gc()` once it
        listens; off for a server embedded in another program (a test run). `model`: the served
        name, recorded with the address (`clawbridge.runtime.address`) so commands can say which server
        they found."""
        super().__init__(config)
        self.model = model
        self.tunes_gc = tune_gc
        self.state_dir = state_dir
        self.drain = drain
        self.drain_grace_s = drain_grace_s
        self.lock = lock

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Drain first (see `clawbridge.proxy.guard.Drain`), then uvicorn's own graceful shutdown,
        whose timeout is set past the grace period so our error answers go out before it cancels."""
        if self.drain is not None:
            self.drain.begin(self.drain_grace_s)
        clear_address(self.state_dir)  # no command finds a server that no longer takes requests
        await super().shutdown(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # bound: a failed bind must not overwrite another server's address
            url = root_url_for(self.config.host, self.config.port)
            write_address(self.state_dir, url, self.model)
            if self.lock is not None:
                self.lock.record(url)
            if self.tunes_gc:
                tune_gc()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                captured = getattr(self, "_captured_signals", None)
                if isinstance(captured, list) and captured:
                    log.info("stopping on signal %s", ", ".join(signal.Signals(s).name for s in captured))
                    captured.clear()


def uvicorn_config(app: Any, settings: Settings, log_level: str | None = None) -> uvicorn.Config:
    """uvicorn with clawbridge's connection limits (see `clawbridge.proxy.connections`)."""
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level or settings.log_level,
                          access_log=settings.log_level == "debug",
                          timeout_graceful_shutdown=math.ceil(settings.drain_grace_s) + 3,
                          http=header_timeout_protocol(settings.header_timeout_s),
                          limit_concurrency=settings.max_connections, timeout_keep_alive=5)


async def serve(settings: Settings, announce: Any = print) -> None:
    """Run the proxy until interrupted.

    Before anything loads: the state dir lock (`clawbridge.runtime.instance`: a second server on it exits
    at once, naming the first) and the listening socket (a port in use is reported at once)."""
    check_bind(settings)
    for note in prepare_state_dir(settings.state_path):  # an unusable state dir is reported as such
        log.warning("%s", note)
    lock = StateDirLock(settings.state_path)
    lock.acquire()
    try:
        sock = bind_listener(settings.host, settings.port)
        try:
            await _serve_locked(settings, announce, lock, sock)
        finally:
            sock.close()
    finally:
        lock.release()


async def _serve_locked(settings: Settings, announce: Any, lock: StateDirLock, sock: socket.socket) -> None:
    state = await build_state(settings)
    app = build_app(state)
    config = uvicorn_config(app, settings)
    server = ProxyServer(config, settings.state_path, state.drain, settings.drain_grace_s, lock, tune_gc=True,
                         model=state.model_info.name)
    keys = resolve_keys(settings)
    base = base_url_for(settings.host, settings.port)
    key_where = "$CLAWBRIDGE_API_KEY" if keys.client.source == "env" else f"contents of {keys.client.source}"
    announce(f"clawbridge serving {state.model_info.name!r} (backend {state.backend.name}, "
             f"policy v{state.sampler.policy_version}) at {base}")
    announce(f"client key: {key_where}")
    admin_where = "$CLAWBRIDGE_ADMIN_KEY" if keys.admin.source == "env" else keys.admin.source
    announce(f"admin key (for /rl/*): {admin_where}")
    announce(f"store: {state.store.path}")
    root = root_url_for(settings.host, settings.port)
    announce(f"dashboard: {root}/dashboard (log in with the admin key, or once within 10 min via "
             f"{root}/dashboard/link/{app.state.dashboard.issue_link()}); metrics: {root}/metrics")
    scores = isinstance(state.sampler, SequenceScorer)
    if state.trainer is not None:
        announce(f"training: on (batch {settings.batch_size}, loss {settings.loss}"
                 f"{rehearsal_words(settings, scores)}); watch with "
                 "`clawbridge status`")
        if state.reporter is not None:
            announce(f"step metrics also go to {settings.report_to} (under "
                     f"{settings.report_dir or settings.state_path / 'runs'})")
    else:
        announce("training: off (the backend serves only, or train = false)")
    announce(promotion_line(settings, scores))
    lanes = lanes_line(settings, scores)
    if lanes is not None:
        announce(lanes)
    probe = promotion_status(state.promotion).get("capability_probe") if state.promotion is not None else None
    if probe:
        announce("  " + probe_line(probe))
    if state.notes is not None:
        how = ("a correction the judge reads becomes a note" if state.judge is not None
               else "with no judge, only notes written by hand (`clawbridge notes add`)")
        announce(f"notes: on ({how}; a user's next calls carry their notes while training teaches them; "
                 "`clawbridge notes` lists and deletes them)")
    if state.privacy is not None:
        where = " and ".join(w for w, on in (("training data", state.privacy.train), ("judge prompts", state.privacy.judge))
                             if on)
        announce(f"privacy filter: on for {where} leaving this machine (privacy = {settings.privacy}; docs/privacy.md)")
    if state.judge is not None:
        announce(f"judge: {state.judge.judge.name} ({settings.judge_votes} votes, at most "
                 f"{settings.judge_concurrency} calls in flight); method {settings.method}")
    announce("OpenClaw provider block (or run `clawbridge openclaw install`):\n"
             + openclaw_provider_snippet(base, f"<{key_where}>", state.model_info))
    try:
        await server.serve(sockets=[sock])
    finally:
        clear_address(settings.state_path)
        state.writer.close()
        await state.backend.close()
        state.store.close()
