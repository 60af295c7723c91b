"""`LocalBackend`: the `local` ServingBackend (entry point `clawbridge.backends:local`).

Invariants:
- `create(settings)` only checks settings; nothing loads until `start()`, which loads the model
  off the event loop (`asyncio.to_thread`) so the proxy stays responsive. The backend's own
  options (`engine`, `device`, `sglang_*`, ...) are `[backends.local]`
  (`clawbridge_local.settings.LocalSettings`), read once into `LocalBackend.options`.
- `engine="torch"` serves with the in-process `TorchEngine`; `engine="sglang"` with `SGLangEngine`
  over a launched `python -m sglang.launch_server` (or `sglang_url`, a server already running);
  `engine="auto"` picks SGLang when `sglang_url` is set, or when CUDA and the sglang package are
  both present, else torch.
- `model_info()` and `sampler()` are valid between `start()` and `close()`; the engine is used only
  through `clawbridge_local.serving.ServingEngine` (publish, aclose), never by its concrete type.
- Training (`train_step`, `publish`, checkpoints) goes through `LocalTrainer`, started lazily; a
  publish swaps the engine's weights under a new version, so serving never pauses (SGLang: LoRA
  adapters load under versioned names; full weights load from disk while in-flight requests drain,
  see `sglang_engine`). Checkpoints are saved and restored only when the trainer loop says so
  (`clawbridge.trainer.checkpoints`); `start()` serves the base model at version 0.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from clawbridge.backend import Datum, LossConfig, ModelInfo, StepResult
from clawbridge.config import Settings
from clawbridge.runtime.faults import fault_point
from clawbridge.serving.sampler import Sampler
from clawbridge.serving.versions import LoadedVersions, VersionUnavailable
from clawbridge_local.engine import TorchEngine
from clawbridge_local.kvbudget import MemoryShare, resolve_kv_dtype
from clawbridge_local.loading import resolve_device, resolve_dtype
from clawbridge_local.malloc import fix_mmap_threshold
from clawbridge_local.scoring import BaseModelScorer
from clawbridge_local.serving import ServingEngine
from clawbridge_local.settings import LocalSettings, local_settings
from clawbridge_local.sglang_engine import SGLangEngine
from clawbridge_local.sglang_launch import DEFAULT_COMMAND, SGLangLaunchConfig, SGLangServer, serving_gpus
from clawbridge_local.trainer.client import Launcher
from clawbridge_local.training import LocalTrainer, on_training_thread, resolve_model_folder
from clawbridge_local.user_lane import LaneTrainers, UserLaneBackend

log = logging.getLogger("clawbridge.local")


def engine_threads(setting: int) -> int:
    """The torch thread count: `setting` when > 0, else OMP_NUM_THREADS when set, else one per two
    cores. On a busy 2-core machine torch's default (all cores) decoded several times slower than 1
    thread (OpenMP workers spin-wait for cores others use); bench/engine_threads.py measures it."""
    if setting > 0:
        return setting
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (os.cpu_count() or 1) // 2)


class EngineNotAvailable(RuntimeError):
    """The configured serving engine is not available in this build."""


def trainer_launcher(options: LocalSettings) -> Launcher:
    """`train_launcher` for the trainer client: `auto` keeps world size 1 in-process."""
    if options.train_launcher != "auto":
        return options.train_launcher
    return "inprocess" if options.train_world_size == 1 and options.train_nnodes == 1 else "torchrun"


def sglang_installed() -> bool:
    """Whether the sglang package can be imported here (it is never imported by clawbridge)."""
    return importlib.util.find_spec("sglang") is not None


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _check_engine(options: LocalSettings) -> str:
    """The engine to run: 'torch' or 'sglang' (auto: SGLang with a GPU and the package)."""
    if options.engine == "auto":
        if options.sglang_url or options.sglang_urls or (cuda_available() and sglang_installed()):
            return "sglang"
        return "torch"
    return options.engine


class LocalBackend:
    """Serves `settings.model` on this machine with a `ServingEngine` (`TorchEngine` or `SGLangEngine`)."""

    name = "local"

    def __init__(
        self, settings: Settings, *, progress: bool = True, sglang_command: Sequence[str] | None = None
    ) -> None:
        self.settings = settings
        """The resolved configuration this backend was created from."""
        self.options = local_settings(settings)
        """Its own options, `[backends.local]`."""
        self.engine_name = _check_engine(self.options)
        """Which engine serves ('torch' or 'sglang')."""
        if not settings.model:
            raise ValueError("the local backend needs a model: set --model (a folder or a cached HF id)")
        self._progress = progress
        self._sglang_command = list(sglang_command) if sglang_command else None
        """Replaces `python -m sglang.launch_server` (tests)."""
        self._server: SGLangServer | None = None
        self._engine: ServingEngine | None = None
        self._trainer: LocalTrainer | None = None
        loaded = self.options.max_loaded_versions + (settings.max_user_adapters if settings.per_user_adapters else 0)
        self._versions = LoadedVersions(loaded, self._load_version, self._drop_version)
        self._lane_trainers = LaneTrainers(self.options.max_lane_trainers)
        self._lane_base: torch.nn.Module | None = None
        """Beside SGLang: the base all users' lane trainers share (`_lanes_base`)."""
        """Committed versions served beside the published one (`clawbridge.serving.versions.VersionedServing`)."""

    async def start(self) -> None:
        """Load the model (with a progress bar) in a thread and start the engine's worker."""
        if self._engine is not None:
            return
        s, o = self.settings, self.options
        fix_mmap_threshold(o.malloc_mmap_threshold_kib * 1024)
        if self.engine_name == "sglang":
            await self._start_sglang()
            return
        threads = engine_threads(o.engine_threads)
        torch.set_num_threads(threads)
        log.info("torch engine: %d CPU thread(s) (engine_threads)", threads)
        device = resolve_device(o.device)
        rule = MemoryShare(o.kv_memory_fraction, training=s.train, lora=s.lora_rank > 0,
                           trainer_in_process=trainer_launcher(o) == "inprocess")
        self._engine = await asyncio.to_thread(
            TorchEngine.load,
            s.model,
            device=o.device,
            dtype=o.dtype,
            max_running=o.max_running_requests,
            max_queued=o.max_queued_requests,
            progress=self._progress,
            batch_decode=o.engine_batch_decode,
            kv_budget_tokens=o.kv_budget_tokens or None,
            graphs="auto" if o.engine_cuda_graphs else "off",
            kv_dtype=resolve_kv_dtype(o.kv_dtype, resolve_dtype(o.dtype, device), device),
            kv_budget_rule=rule,
        )
        log.info("torch engine: %s", self._engine.kv_budget.describe())

    async def _start_sglang(self) -> None:
        """Connect to `sglang_urls` (replicas) or `sglang_url`, or launch SGLang and wait until healthy."""
        s, o = self.settings, self.options
        url: str | list[str] = o.sglang_urls or o.sglang_url
        if not url:
            if self._sglang_command is None and not sglang_installed():
                raise EngineNotAvailable(
                    "engine 'sglang' needs the sglang package and a GPU (pip install 'sglang[all]'), "
                    "or sglang_url of a running server; use --engine torch to serve with torch."
                )
            self._server = self._sglang_server()
            url = await asyncio.to_thread(self._server.start)
        lora = s.lora_rank > 0
        try:
            self._engine = await SGLangEngine.connect(
                url, lora=lora, max_in_flight=o.max_running_requests + o.max_queued_requests,
                read_timeout_s=s.request_timeout_s, held=self._versions.holds,
                max_loaded_loras=self.sglang_max_loaded_loras() if lora else None,
            )
        except BaseException:
            await self.close()
            raise

    def _sglang_server(self) -> SGLangServer:
        s, o = self.settings, self.options
        model = str(resolve_model_folder(s.model))
        cfg = SGLangLaunchConfig(
            model_path=model, port=o.sglang_port or _free_port(),
            lora_rank=s.lora_rank, lora_target_modules=tuple(s.lora_target_modules) if s.lora_rank > 0 else (),
            tp_size=o.sglang_tp_size, dp_size=o.sglang_dp_size, mem_fraction=o.sglang_mem_fraction,
            max_running_requests=o.max_running_requests, max_queued_requests=o.max_queued_requests,
            served_model_name=s.model_name, extra_args=tuple(o.sglang_extra_args),
            max_loaded_loras=self.sglang_max_loaded_loras() if s.lora_rank > 0 else 0,
            max_loras_per_batch=o.sglang_max_loras_per_batch if s.lora_rank > 0 else 0,
            lora_eviction_policy=o.sglang_lora_eviction_policy if s.lora_rank > 0 else "",
        )
        env: dict[str, str] = {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(_gpu_count())]
        gpus = serving_gpus(devices, o.sglang_tp_size, o.sglang_dp_size)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        return SGLangServer(cfg, s.state_path / "logs" / "sglang.log", command=self._sglang_command or DEFAULT_COMMAND,
                            env=env, startup_timeout_s=o.sglang_startup_timeout_s)

    def sglang_max_loaded_loras(self) -> int:
        """The adapters SGLang may hold at once (`--max-loaded-loras`): `sglang_max_loaded_loras`, or
        the served version, the committed versions kept beside it and the users' adapters, and at
        least the adapters one batch may mix (SGLang requires that)."""
        o, s = self.options, self.settings
        if o.sglang_max_loaded_loras > 0:
            return max(o.sglang_max_loaded_loras, o.sglang_max_loras_per_batch)
        users = s.max_user_adapters if s.per_user_adapters else 0
        return max(1 + o.max_loaded_versions + users, o.sglang_max_loras_per_batch)

    def _require(self) -> ServingEngine:
        if self._engine is None:
            raise RuntimeError("LocalBackend.start() has not been called (or close() was)")
        return self._engine

    def model_info(self) -> ModelInfo:
        """Name, tokenizer source, context window and default max_tokens of the served model."""
        engine = self._require()
        return ModelInfo(
            name=self.settings.model_name,
            tokenizer_path=self.settings.tokenizer_source,
            context_window=engine.context_window,
            max_output_tokens=self.settings.default_max_tokens,
        )

    def sampler(self) -> ServingEngine:
        """The engine, which is the Sampler."""
        return self._require()

    async def load_version(self, version: int, checkpoint: str) -> Sampler:
        """`clawbridge.serving.versions.VersionedServing`: committed `version` from its checkpoint, kept
        among the `max_loaded_versions` most recently used (torch engine only)."""
        return await self._versions.get(version, checkpoint)

    async def _load_version(self, version: int, checkpoint: str) -> Sampler:
        try:
            return await self._load_checkpoint_version(version, checkpoint)
        except (OSError, ValueError, KeyError) as exc:  # a checkpoint deleted or damaged outside retention
            log.warning("policy version %d: cannot load %s: %s", version, checkpoint, exc)
            raise VersionUnavailable(f"the checkpoint of policy version {version} cannot be loaded ({exc})",
                                     only_published=False) from None

    async def _load_checkpoint_version(self, version: int, checkpoint: str) -> Sampler:
        engine = self._require()
        if isinstance(engine, SGLangEngine) and engine.lora:
            folder = self.version_dir(version)
            if version > 0:
                await asyncio.to_thread(self._training().checkpoint_adapter, Path(checkpoint), folder)
            sampler: Sampler = await engine.load_lora_version(folder if version > 0 else None, version)
        elif isinstance(engine, TorchEngine):
            update = await asyncio.to_thread(self._training().checkpoint_update, Path(checkpoint))
            sampler = await engine.load_version(update, version)
        else:
            raise VersionUnavailable(f"engine {self.engine_name} with full weights serves one version at a time "
                                     f"(the published one, {engine.policy_version}); use engine torch or LoRA")
        log.info("loaded policy version %d from %s beside the published one", version, checkpoint)
        return sampler

    async def _drop_version(self, version: int) -> None:
        """A version left the cache of loaded versions (the LRU, or a forgotten user's): SGLang
        unloads its adapter (now, or when its last stream ends) and the folder written for it is
        deleted (the torch engine frees its copy when its last stream ends)."""
        engine = self._engine
        if isinstance(engine, SGLangEngine) and engine.lora:
            await engine.release(version)
            await asyncio.to_thread(shutil.rmtree, self.version_dir(version), True)

    @property
    def loaded_versions(self) -> LoadedVersions:
        """The committed versions served beside the published one (users' adapters among them)."""
        return self._versions

    # ---- per-user adapters (clawbridge.trainer.lanes, clawbridge_local.user_lane) ---------------
    def user_lanes_unsupported(self) -> str | None:
        """Why this backend cannot train an adapter per user, or None when it can."""
        if self.settings.lora_rank <= 0:
            return "per_user_adapters needs LoRA (lora_rank > 0): each user's weights are an adapter"
        if trainer_launcher(self.options) != "inprocess":
            return "per_user_adapters trains each user in this process: train_world_size 1 on one node"
        return None

    def user_lane(self, user: str) -> UserLaneBackend:
        """A training backend for `user`'s own adapter (`clawbridge_local.user_lane`): over the torch
        engine's served base, or, beside SGLang, over one base copy all users' trainers share."""
        engine = self._require()
        base = engine.lend_base if isinstance(engine, TorchEngine) else self._lanes_base
        trainer = LocalTrainer(self.settings, launcher="inprocess", cpu_threads=engine_threads(self.options.engine_threads),
                               base_weights=base, lane=user)
        return UserLaneBackend(self, user, trainer)

    def _lanes_base(self) -> torch.nn.Module:
        """The frozen base the users' trainers share when serving is another process (SGLang):
        loaded once, fp32, on the trainer's device (`clawbridge_local.trainer.model.over_base`)."""
        if self._lane_base is None:
            from transformers import AutoModelForCausalLM

            from clawbridge_local.trainer.step import resolve_device
            from clawbridge_local.training import trainer_config

            cfg = trainer_config(self.settings, str(resolve_model_folder(self.settings.model)))
            model: Any = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=torch.float32, local_files_only=True)
            model.requires_grad_(False)
            self._lane_base = model.to(resolve_device(cfg, 0))
        return self._lane_base

    @property
    def lane_trainers(self) -> LaneTrainers:
        """Which users' lane trainers are in memory (`max_lane_trainers`)."""
        return self._lane_trainers

    async def unload_versions(self, versions: list[int]) -> None:
        """Stop serving `versions` (a forgotten user's adapters) and delete every folder written
        for them: those kept are dropped from the cache as the LRU drops one (`_drop_version`);
        a folder an earlier process left (a kill) is unloaded from SGLang too, which may have
        outlived that process. A stream still running on one ends first."""
        await self._versions.discard(versions)
        engine = self._engine
        for version in versions:
            folder = self.version_dir(version)
            if not folder.exists():
                continue
            if isinstance(engine, SGLangEngine) and engine.lora:
                await engine.unload_unknown(version)
            await asyncio.to_thread(shutil.rmtree, folder, True)

    def version_dir(self, version: int) -> Path:
        """Where a LoRA version's adapter folder is written for SGLang to load."""
        return self.settings.state_path / "trainer" / "local" / "versions" / f"v{version}"

    # ---- training ----------------------------------------------------------------------
    def _training(self) -> LocalTrainer:
        if self._trainer is None:
            engine = self._engine
            shared = engine.lend_base if isinstance(engine, TorchEngine) and self.settings.lora_rank > 0 else None
            self._trainer = LocalTrainer(self.settings, launcher=trainer_launcher(self.options),
                                         cpu_threads=engine_threads(self.options.engine_threads), base_weights=shared)
        return self._trainer

    async def train_step(self, batch: Sequence[Datum], loss: LossConfig) -> StepResult:
        """One FSDP (or in-process) optimizer step; serving goes on meanwhile."""
        return await on_training_thread(self._training().train_step, batch, loss)

    async def publish(self, version: int | None = None) -> int:
        """Swap the trained weights into the engine as `version` (default: the served one + 1)."""
        engine = self._require()
        trainer = self._training()
        target = engine.policy_version + 1 if version is None else version
        served = await engine.publish(trainer, target)
        await fault_point("publish.mid")
        trainer.client.policy_version = served
        return served

    async def save_checkpoint(self, name: str) -> str:
        """Weights (or adapter) + optimizer state to `<state_dir>/checkpoints/local/<name>`."""
        trainer = self._training()
        path = await on_training_thread(trainer.save_checkpoint, name, self._require().policy_version)
        return str(path)

    async def delete_checkpoint(self, path: str) -> None:
        """Delete a checkpoint folder this backend wrote (`clawbridge.backend.CheckpointDeleter`);
        refuses anything outside `<state_dir>/checkpoints/local`."""
        root = (self.settings.state_path / "checkpoints" / "local").resolve()
        target = Path(path).resolve()
        if target.parent != root:
            raise ValueError(f"{path} is not a checkpoint of this state dir ({root})")
        await asyncio.to_thread(shutil.rmtree, target, True)

    async def restore_checkpoint(self, path: str, version: int | None = None) -> int:
        """Load a checkpoint into the trainer and serve its weights as `version` (default: its own);
        when `version` is the one served, only the trainer state is loaded."""
        trainer = self._training()
        recorded = await on_training_thread(trainer.restore_checkpoint, Path(path))
        engine = self._require()
        target = recorded if version is None else version
        if target != engine.policy_version:
            await engine.publish(trainer, target)
        trainer.client.policy_version = target
        return target

    async def close(self) -> None:
        """Stop the trainer and the engine's worker thread. Idempotent."""
        trainer, self._trainer = self._trainer, None
        if trainer is not None:
            await asyncio.to_thread(trainer.close)
        self._versions.clear()
        engine, self._engine = self._engine, None
        if engine is not None:
            await engine.aclose()
        server, self._server = self._server, None
        if server is not None:
            await asyncio.to_thread(server.stop)

    # ---- rewards: the base model as OPD teacher and judge (clawbridge_local.scoring) -----------
    def _base_model(self) -> BaseModelScorer:
        scorer: BaseModelScorer | None = getattr(self, "_scorer", None)
        if scorer is None:
            s, o = self.settings, self.options
            scorer = BaseModelScorer(str(resolve_model_folder(s.model)), o.device, o.dtype, s.judge_concurrency)
            self._scorer = scorer
        return scorer

    async def compute_logprobs(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]
    ) -> list[list[float]]:
        """`clawbridge.backend.LogprobScorer`: logprobs of the tokens after each prompt under the
        BASE model (a separate, never-trained copy; adapters and published weights never apply)."""
        return await asyncio.to_thread(self._base_model().score, sequences, prompt_lens)

    async def base_sampler(self) -> TorchEngine:
        """A Sampler over the base model for `judge=base` (its own slots: `judge_concurrency`)."""
        return await asyncio.to_thread(self._base_model().engine)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _gpu_count() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def create(settings: Settings) -> LocalBackend:
    """Entry-point factory: `clawbridge.plugins.load_backend("local", settings)` calls this."""
    return LocalBackend(settings)


create.settings_model = LocalSettings  # type: ignore[attr-defined]
