"""The Tinker TrainingBackend: a LoRA trained by Tinker, sampled through Tinker.

Invariants:
- One `ServiceClient` per backend, created in a worker thread (its constructor blocks on HTTP),
  never on the event loop. Telemetry is decided before it exists (`[backends.tinker] telemetry`).
- `train_step` submits `forward_backward` and `optim_step` back to back (so Tinker can run them
  in one clock cycle), then awaits both under one explicit deadline and returns the metrics the
  server reported. It is not re-submitted on failure: `TinkerRequestFailed` (permanent) or
  `TinkerTransientError` (timeout/429/connection) propagate, and the caller keeps its samples.
- `publish` saves the weights for sampling and swaps the sampler's client in one assignment,
  tagged with `policy_version + 1`; streams in flight finish on the old client.
- `save_checkpoint` records the `tinker://` path, step and version in the manifest
  (`<state_dir>/tinker/manifest.json`, replaced atomically); `restore_checkpoint` (called by the
  trainer loop, never by `start`) loads one with `create_training_client_from_state_with_optimizer`,
  serves it from a sampling client of the new training client (swapped in, or rebound when it
  restores the served version's own weights), and only then releases the old training client:
  no call is ever sent to a sampler of a released client.
- Each checkpoint also saves the same weights for sampling under the same name
  (`save_weights_for_sampler`), recorded beside it; `load_version` (`NAME@N`) serves committed
  versions besides the published one (`clawbridge_tinker.served`: a lane's live client, else the
  saved sampler weights once a probe shows they answer, else the checkpoint's training state).
- What a checkpoint leaves on the service is its training state and its sampler weights
  (`checkpoint_objects`), each deleted on its own (`delete_remote`, `clawbridge_tinker.remote`):
  the trainer owes them in the store first (`clawbridge.trainer.deletions`), so a deletion the
  service refuses is retried until done. `delete_checkpoint` deletes both at once.
- The tokenizer is the user's (`settings.tokenizer_source`); `TrainingClient.get_tokenizer()`
  is never called (it downloads from a hub).
- `start` probes the service first (`service.probe`, bounded by `probe_timeout_s`) and fails
  with `ServiceProbeFailed` before any SDK client exists; then it releases the training clients an
  earlier, killed run left loaded. Every training client is recorded in the state dir while it
  is loaded and released when replaced (restore) and at `close` (see service.py).
- `compute_logprobs` asks for the last n prompt logprobs only; a server that refuses that option
  gets full prompt logprobs instead from then on (logged once).
- Per-user adapters (`clawbridge.trainer.lanes`): `user_lane(user)` is a `TinkerBackend` of its own
  (its own training client, sampling client, manifest and client ledger under
  `<state_dir>/users/<user>/tinker/`) over the parent's `ServiceClient`; it never closes the
  parent's session. Each publish and restore hands the lane's live sampling client to the parent,
  which serves the lane's version through it; any other lane version is found by name in every
  lane's manifest. `remote_objects()` lists what the lane keeps on the service (what forgetting
  its user owes, `clawbridge.trainer.lanes`); `forget()` deletes its folder here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

from clawbridge.backend import Capabilities, Datum, LossConfig, ModelInfo, RemoteObject, StepResult
from clawbridge.config import Settings
from clawbridge.runtime.faults import fault_point
from clawbridge.serving.sampler import Sampler

from .convert import loss_fn_and_config, loss_tokens, to_tinker_datum
from .errors import TinkerRequestFailed, TinkerTransientError, is_transient, retry_transient
from .manifest import CheckpointEntry, Manifest, load_manifest, manifest_path, write_manifest
from .remote import RemoteDeleter
from .sampler import SamplerLimits, TinkerSampler
from .scoring import BaseScorer, PromptLogprobs
from .sdk import (
    TELEMETRY_ENV,
    AdamParams,
    RequestFailedError,
    RetryConfig,
    ServiceClient,
    TrainingClient,
)
from .served import ServedVersions
from .service import ClientLedger, probe, release, release_recorded
from .settings import TinkerSettings, tinker_settings

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_WINDOW = 32768
"""Used when the server does not report the base model's context length."""


def configure_telemetry(enabled: bool) -> None:
    """Turn the SDK's telemetry on or off for clients created after this call."""
    os.environ[TELEMETRY_ENV] = "1" if enabled else "0"


class TinkerBackend:
    """TrainingBackend over Tinker's hosted LoRA training and sampling."""

    name = "tinker"
    capabilities = Capabilities(kl=False, full_finetune=False, hosted=True)
    """Tinker trains LoRA adapters with built-in losses that take no KL term."""

    def __init__(self, settings: Settings, lane: str = "", parent: TinkerBackend | None = None) -> None:
        """`lane`/`parent`: a user's own adapter over `parent`'s session (`user_lane`)."""
        self.settings = settings
        self.lane = lane
        self.parent = parent
        self.root = settings.state_path / "users" / lane if lane else settings.state_path
        """This backend's own files: the state dir, or a user lane's folder in it."""
        self.opts: TinkerSettings = tinker_settings(settings)
        """This backend's own options (`[backends.tinker]`, `CLAWBRIDGE_TINKER_*`)."""
        self.base_model = self.opts.base_model or settings.model
        self.step = 0
        """Training steps completed (restored from the manifest on resume)."""
        self.policy_version = 0
        self.last_metrics: dict[str, float] = {}
        self.manifest_file = manifest_path(self.root)
        self._service: ServiceClient | None = None
        self._training: TrainingClient | None = None
        self._sampler: TinkerSampler | None = None
        self._context_window = DEFAULT_CONTEXT_WINDOW
        self._lock = asyncio.Lock()
        """Serialises train_step / publish / checkpoint calls on the one training client."""
        self.clients = ClientLedger(self.root)
        self._logprobs = PromptLogprobs(self.retry, self.opts.sample_timeout_s)
        """`compute_logprobs` for the teacher and every version's sampler: a server that refuses
        `prompt_logprobs_last_n` is learned once (a lane uses its parent's, `new_sampler`)."""
        self._scorer = BaseScorer(self._logprobs)
        """The base model as OPD teacher (`compute_logprobs`)."""
        loaded = self.opts.max_loaded_versions + (settings.max_user_adapters if settings.per_user_adapters else 0)
        self._served = ServedVersions(self, loaded)
        """Committed versions besides the published one (`load_version`; a parent's, never a lane's)."""
        self._remote = RemoteDeleter(self.opts, self.retry, settings.probe_timeout_s)
        """Deletes what this backend keeps on the service (`delete_remote`)."""

    # ---- lifecycle

    async def start(self) -> None:
        if self.parent is not None:
            await self._start_lane(self.parent)
            return
        s = self.settings
        if not self.base_model:
            raise ValueError("set [backends.tinker] base_model (or model) to the Tinker base model to train")
        if not s.tokenizer_source:
            raise ValueError("set tokenizer (or model) to a local folder or id the tokenizer loads from")
        api_key = self.opts.api_key_value()
        configure_telemetry(self.opts.telemetry)
        base_url = self.opts.base_url or None
        probed = await probe(base_url, api_key, self.base_model, s.probe_timeout_s)
        self._context_window = probed.context_length or DEFAULT_CONTEXT_WINDOW
        await release_recorded(self.clients, base_url, api_key, s.probe_timeout_s)
        self._service = await asyncio.to_thread(ServiceClient, base_url=base_url, api_key=api_key)
        service = self._service
        client = await self.retry(
            "create sampling client",
            lambda: service.create_sampling_client(
                base_model=self.base_model, retry_config=self.retry_config()
            ).result_async(),
            self.opts.publish_timeout_s,
        )
        self._sampler = self.new_sampler(client, self.policy_version)

    async def _start_lane(self, parent: TinkerBackend) -> None:
        """A user lane: the parent's session, training clients an earlier run of this lane left
        loaded released, and a sampling client of the base until the lane publishes."""
        if parent._service is None:
            raise RuntimeError("TinkerBackend.start() has not run")
        self._service, self._context_window = parent._service, parent._context_window
        await release_recorded(self.clients, self.opts.base_url or None, self.opts.api_key_value(),
                               self.settings.probe_timeout_s)
        service = self._service
        client = await self.retry(
            "create sampling client",
            lambda: service.create_sampling_client(base_model=self.base_model,
                                                   retry_config=self.retry_config()).result_async(),
            self.opts.publish_timeout_s,
        )
        self._sampler = self.new_sampler(client, self.policy_version)

    # ---- per-user adapters (clawbridge.trainer.lanes.PerUserTraining)

    def user_lanes_unsupported(self) -> str | None:
        """Tinker trains LoRA only: every user can have their own training client."""
        return None

    def user_lane(self, user: str) -> TinkerBackend:
        """`user`'s own adapter: a training and sampling client of its own over this session."""
        return TinkerBackend(self.settings, lane=user, parent=self)

    async def unload_versions(self, versions: list[int]) -> None:
        await self._served.discard(versions)

    async def forget(self) -> int:
        """A user lane: release its training client and delete its folder here; how many
        checkpoints it had. What it keeps on the service (`remote_objects`) is the caller's to
        owe and delete (`clawbridge.trainer.lanes`), read before this."""
        if self.parent is None:
            raise RuntimeError("only a user lane can be forgotten")
        await self.close()
        manifest = load_manifest(self.manifest_file)
        await asyncio.to_thread(shutil.rmtree, self.root, True)
        return len(manifest.checkpoints) if manifest is not None else 0

    async def close(self) -> None:
        """Finish the session; never raises (a server that is gone or does not know the session
        is logged: nothing recorded depends on it). Training clients are released first (those
        loaded to serve old versions, then the trainer's). A user lane releases its training
        client only (its version is no longer served live): the session is its parent's."""
        if self.parent is not None:
            self.parent._served.drop_live(self.lane)
        else:
            await self._served.close()
        service, self._service = self._service, None
        training, self._training = self._training, None
        if training is not None:
            await self.release_client(training)
        if service is not None and self.parent is None:
            try:
                await asyncio.wait_for(service.close("success"), 10.0)
            except Exception as e:  # closing is best effort
                log.warning("tinker: closing the session failed (%s: %s); nothing recorded is lost",
                            type(e).__name__, e)

    def model_info(self) -> ModelInfo:
        s = self.settings
        return ModelInfo(
            name=s.model_name,
            tokenizer_path=s.tokenizer_source,
            context_window=self._context_window,
            max_output_tokens=s.default_max_tokens,
        )

    def sampler(self) -> Sampler:
        if self._sampler is None:
            raise RuntimeError("TinkerBackend.start() has not run")
        return self._sampler

    # ---- training

    async def train_step(self, batch: Sequence[Datum], loss: LossConfig) -> StepResult:
        if not batch:
            raise ValueError("train_step needs at least one datum")
        tc = await self._ensure_training()
        loss_fn, loss_cfg = loss_fn_and_config(loss)
        data = [to_tinker_datum(d) for d in batch]
        adam = AdamParams(learning_rate=self.settings.effective_learning_rate * loss.lr_scale)
        timeout = self.opts.step_timeout_s
        async with self._lock:
            fb_future = tc.forward_backward(data, loss_fn, loss_cfg)  # type: ignore[arg-type]
            optim_future = tc.optim_step(adam)
            try:
                async with asyncio.timeout(timeout):
                    fb = await fb_future.result_async()
                    optim = await optim_future.result_async()
            except RequestFailedError as e:
                log.error("tinker: training step %d failed: %s", self.step + 1, e)
                raise TinkerRequestFailed(f"training step {self.step + 1} failed on Tinker: {e}") from e
            except Exception as e:
                if not is_transient(e):
                    raise
                why = f"no answer within {timeout:g}s" if isinstance(e, TimeoutError) else str(e)
                log.warning("tinker: training step %d: %s", self.step + 1, why)
                raise TinkerTransientError(
                    f"training step {self.step + 1}: {why}; Tinker may still apply it"
                ) from e
            self.step += 1
        metrics: dict[str, float] = {f"tinker/{k}": float(v) for k, v in fb.metrics.items()}
        metrics.update({f"tinker/optim/{k}": float(v) for k, v in (optim.metrics or {}).items()})
        if "loss:sum" in fb.metrics:
            metrics["loss"] = float(fb.metrics["loss:sum"])
        metrics["tokens"] = float(loss_tokens(batch))
        metrics["step"] = float(self.step)
        self.last_metrics = metrics
        return StepResult(metrics=metrics)

    async def publish(self, version: int | None = None) -> int:
        tc = await self._ensure_training()
        sampler = self._sampler
        if sampler is None:
            raise RuntimeError("TinkerBackend.start() has not run")
        async with self._lock:
            client = await self.retry(
                "save weights for sampler",
                lambda: tc.save_weights_and_get_sampling_client(
                    retry_config=self.retry_config()
                ).result_async(),
                self.opts.publish_timeout_s,
            )
            target = self.policy_version + 1 if version is None else version
            sampler.swap(client, target)
            await fault_point("publish.mid")
            self.policy_version = target
            await self._serve_live(client, target)
        return target

    # ---- checkpoints

    async def save_checkpoint(self, name: str) -> str:
        tc = await self._ensure_training()
        async with self._lock:
            saved = await self.retry(
                f"save_state {name!r}",
                lambda: tc.save_state(name).result_async(),
                self.opts.publish_timeout_s,
            )
            await fault_point("checkpoint.mid")
            for_sampler = await self.retry(
                f"save_weights_for_sampler {name!r}",
                lambda: tc.save_weights_for_sampler(name).result_async(),
                self.opts.publish_timeout_s,
            )
            manifest = load_manifest(self.manifest_file) or Manifest(self.base_model, self.settings.lora_rank)
            manifest.checkpoints.append(
                CheckpointEntry(name, saved.path, self.step, self.policy_version, time.time(), for_sampler.path)
            )
            write_manifest(self.manifest_file, manifest)
        return saved.path

    async def delete_checkpoint(self, path: str) -> None:
        """Delete a checkpoint's training state and sampler weights on the service and drop it
        from the manifest (`clawbridge.backend.CheckpointDeleter`; the trainer's retention goes
        through `checkpoint_objects` and `delete_remote` instead, owing each)."""
        for obj in self.checkpoint_objects(path):
            await self.delete_remote(obj)

    # ---- what this backend keeps on the service (clawbridge.backend.RemoteCheckpoints)

    def checkpoint_objects(self, path: str) -> list[RemoteObject]:
        """Checkpoint `path`'s training state and (when saved) its sampler weights."""
        manifest = load_manifest(self.manifest_file)
        entry = manifest.find(path) if manifest is not None else None
        sampler = [RemoteObject(entry.sampler_path, "sampler")] if entry is not None and entry.sampler_path else []
        return [RemoteObject(path, "state"), *sampler]

    def remote_objects(self) -> list[RemoteObject]:
        """Every checkpoint's objects in the manifest, and the training clients the ledger still
        lists (a release that failed): what forgetting a user lane owes."""
        manifest = load_manifest(self.manifest_file)
        objects = [o for c in (manifest.checkpoints if manifest is not None else []) for o in self.checkpoint_objects(c.path)]
        return objects + [RemoteObject(model_id, "training_client") for model_id in self.clients.ids()]

    async def delete_remote(self, obj: RemoteObject) -> None:
        """Delete `obj` on the service (`clawbridge_tinker.remote`: gone counts as deleted); a
        deleted training state leaves this backend's manifest."""
        await self._remote.delete(obj)
        if obj.kind == "state":
            async with self._lock:
                manifest = load_manifest(self.manifest_file)
                if manifest is not None and manifest.find(obj.path) is not None:
                    manifest.checkpoints = [c for c in manifest.checkpoints if c.path != obj.path]
                    write_manifest(self.manifest_file, manifest)
        elif obj.kind == "training_client":
            self.clients.remove(obj.path)

    async def restore_checkpoint(self, path: str, version: int | None = None) -> int:
        """Load weights + optimizer state into a new training client, serve them as `version`
        (default: the version recorded with the checkpoint) from a sampling client of that new
        client, then release the old one (module invariants); the served version: trainer only."""
        service = self.require_service()
        manifest = load_manifest(self.manifest_file)
        entry = manifest.find(path) if manifest else None
        if entry is None:
            raise ValueError(
                f"{path} is not in {self.manifest_file}; only checkpoints saved here can be resumed"
            )
        target = entry.policy_version if version is None else version
        timeout = self.opts.publish_timeout_s
        async with self._lock:
            tc = self.record_client(await self.retry(
                "restore training state",
                lambda: service.create_training_client_from_state_with_optimizer(path).result_async(),
                timeout,
            ))
            try:
                client = await self.retry(
                    "sampling client for restored weights",
                    lambda: tc.save_weights_and_get_sampling_client(retry_config=self.retry_config()).result_async(),
                    timeout,
                )
                if self._sampler is None:
                    self._sampler = self.new_sampler(client, target)
                elif target == self._sampler.policy_version:
                    self._sampler.rebind(client)  # the same weights (the served version's own checkpoint)
                else:
                    self._sampler.swap(client, target)  # refuses a version older than the one served
            except BaseException:
                await self.release_client(tc)  # the old trainer stays: the caller tries again
                raise
            old, self._training = self._training, tc
            self.step = entry.step
            self.policy_version = target
            await self._serve_live(client, target)
            if old is not None:  # only now: nothing is sampled from it any more
                await self.release_client(old)
        return self.policy_version

    async def _serve_live(self, client: Any, version: int) -> None:
        """A user lane: the parent serves `version` through this live sampling client."""
        if self.parent is not None:
            await self.parent._served.serve_live(self.lane, self.new_sampler(client, version))

    # ---- committed versions besides the published one (clawbridge.serving.versions.VersionedServing)

    async def load_version(self, version: int, checkpoint: str) -> Sampler:
        """A sampler of committed `version` (`clawbridge_tinker.served`), kept among the
        `max_loaded_versions` (+ `max_user_adapters`) most recently used."""
        return await self._served.get(version, checkpoint)

    def find_checkpoint(self, checkpoint: str) -> CheckpointEntry | None:
        """`checkpoint`'s manifest entry: this backend's, or a user lane's (`user_lane`)."""
        for path in (self.manifest_file, *sorted((self.root / "users").glob("*/tinker/manifest.json"))):
            manifest = load_manifest(path)
            entry = manifest.find(checkpoint) if manifest is not None else None
            if entry is not None:
                return entry
        return None

    # ---- helpers (also what `clawbridge_tinker.served.VersionHost` needs)

    def require_service(self) -> ServiceClient:
        if self._service is None:
            raise RuntimeError("TinkerBackend.start() has not run")
        return self._service

    @property
    def load_timeout_s(self) -> float:
        """The bound on loading a version's sampling or training client."""
        return self.opts.publish_timeout_s

    async def _ensure_training(self) -> TrainingClient:
        """The training client: restored by `restore_checkpoint`, else a fresh LoRA created on
        first use (a serving-only or resumed start never creates one it does not need)."""
        if self._training is not None:
            return self._training
        service = self.require_service()
        s = self.settings
        tc: TrainingClient = await self.retry(
            "create LoRA training client",
            lambda: service.create_lora_training_client(self.base_model, rank=s.lora_rank).result_async(),
            self.opts.publish_timeout_s,
        )
        self._training = self.record_client(tc)
        return tc

    def record_client(self, tc: TrainingClient) -> TrainingClient:
        """Record a new training client in the state dir (released at close or next start)."""
        if tc.model_id:
            self.clients.add(str(tc.model_id))
        return tc

    async def release_client(self, tc: TrainingClient) -> None:
        """Release a training client this run no longer uses (never raises)."""
        if not tc.model_id:
            return
        s = self.settings
        await release(self.clients, self.opts.base_url or None, self.opts.api_key_value(), str(tc.model_id),
                      s.probe_timeout_s)

    def new_sampler(self, client: Any, version: int) -> TinkerSampler:
        """A sampler serving `version` from sampling `client`, scoring through the shared
        `compute_logprobs` state (a lane's goes through its parent's)."""
        return TinkerSampler(client, version, self.sampler_limits(), (self.parent or self)._logprobs)

    def sampler_limits(self) -> SamplerLimits:
        return SamplerLimits(
            context_window=self._context_window,
            timeout_s=self.opts.sample_timeout_s,
            max_retries=self.opts.max_retries,
            backoff_s=self.opts.retry_backoff_s,
        )

    def retry_config(self) -> RetryConfig:
        # The SDK's stuck detection is only a backstop: our own wall-clock bound (retry_transient)
        # must fire first so a hang is reported as a timeout, not as a connection error. At equal
        # bounds the two raced and the SDK's "No progress made" APIConnectionError sometimes won.
        timeout = self.opts.sample_timeout_s
        return RetryConfig(progress_timeout=timeout + max(2.0, 0.5 * timeout))

    async def retry(self, what: str, call: Any, timeout_s: float) -> Any:
        return await retry_transient(
            what,
            call,
            timeout_s=timeout_s,
            max_retries=self.opts.max_retries,
            backoff_s=self.opts.retry_backoff_s,
        )

    # ---- rewards: the base model as OPD teacher (clawbridge.backend.LogprobScorer)

    async def compute_logprobs(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]
    ) -> list[list[float]]:
        """Logprobs of the tokens after each prompt under the BASE model (`clawbridge_tinker.scoring`)."""
        service = self._service
        if service is None:
            raise RuntimeError("TinkerBackend.start() has not run")

        async def base_client() -> Any:
            return await self.retry(
                "create base sampling client",
                lambda: service.create_sampling_client(
                    base_model=self.base_model, retry_config=self.retry_config()
                ).result_async(),
                self.opts.publish_timeout_s,
            )

        return await self._scorer.score(base_client, sequences, prompt_lens)


def create(settings: Settings) -> TinkerBackend:
    """Entry point (`clawbridge.backends`: tinker); its options are `TinkerSettings`."""
    return TinkerBackend(settings)


create.settings_model = TinkerSettings  # type: ignore[attr-defined]
