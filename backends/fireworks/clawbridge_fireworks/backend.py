"""FireworksBackend: trains on a Fireworks trainer job, serves from a hot-load deployment.

Invariants:
- `start()` probes the control plane first (check.py: reachable, key, base model, named
  resources; seconds, not the SDK's minutes of retries), then plans, and creates nothing billable
  without consent (see provision.py).
- `train_step` submits `forward_backward` and `optim_step` back to back (the SDK orders them by
  sequence id) and waits for both with `[backends.fireworks] step_timeout_s`; it returns metrics or raises,
  and the step counter and manifest move only after both succeeded.
- `publish` = `WeightSyncer.save_and_hotload(name)`; the returned snapshot identity is recorded
  under the next int version in the manifest (atomically) before the sampler serves it. The
  sampler's gate is closed just before the hot-load request and reopened with the new version
  after the deployment reports it loaded (see sampler.py), so every sample is labeled with the
  version that produced it.
- `train_step`, `publish` and checkpoint calls are serialized by one lock; sampling never waits on
  training, only (briefly) on the hot-load swap itself.
- Blocking SDK calls run in worker threads, never on the event loop.
- `compute_logprobs` (the OPD teacher, `clawbridge.backend.LogprobScorer`) runs a forward-only
  pass on a base-only training client created once on the policy's trainer session; published
  weights never reach it (see scoring.py). It takes the same lock as training, so the trainer
  does one thing at a time.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from clawbridge.backend import Capabilities, Datum, LossConfig, ModelInfo, StepResult
from clawbridge.config import Settings
from clawbridge.runtime.faults import fault_point
from clawbridge.serving.sampler import Sampler
from clawbridge_fireworks import provision as prov
from clawbridge_fireworks.check import probe
from clawbridge_fireworks.conversion import loss_options, metrics_of, step_metrics, to_fireworks_datum
from clawbridge_fireworks.manifest import CheckpointRecord, Manifest
from clawbridge_fireworks.sampler import FireworksSampler
from clawbridge_fireworks.scoring import (
    SCORING_LOSS_FN,
    ScoringFailed,
    ScoringUnavailable,
    check_prompt_lens,
    completion_logprobs,
    scoring_datum,
)
from clawbridge_fireworks.sdk import (
    AdamParams,
    DeploymentManager,
    FiretitanServiceClient,
    FiretitanTrainingClient,
    GradAccNormalization,
    TrainerJobManager,
    WeightSyncer,
)
from clawbridge_fireworks.settings import FireworksSettings, fireworks_settings

DEFAULT_CONTEXT_WINDOW = 32768


class StepFailed(RuntimeError):
    """A training step did not happen (its samples stay unconsumed)."""


class PublishFailed(RuntimeError):
    """A publish did not happen; the previous version is still served."""


class _GatedDeploymentManager(DeploymentManager):
    """DeploymentManager that calls `before_hotload` right before each hot-load request."""

    before_hotload: Callable[[], None] | None = None

    def hotload_and_wait(self, *args: Any, **kwargs: Any) -> bool:
        if self.before_hotload is not None:
            self.before_hotload()
        return bool(super().hotload_and_wait(*args, **kwargs))


def _stderr(msg: str) -> None:
    print(f"[fireworks] {msg}", file=sys.stderr, flush=True)


class FireworksBackend:
    """TrainingBackend over the Fireworks training SDK (see module invariants)."""

    name = "fireworks"
    capabilities = Capabilities(kl=False, hosted=True)
    """Fireworks' built-in losses take no KL term."""

    def __init__(self, settings: Settings, notify: Callable[[str], None] = _stderr) -> None:
        self.settings = settings
        self.opts: FireworksSettings = fireworks_settings(settings)
        """This backend's own options (`[backends.fireworks]`, `CLAWBRIDGE_FIREWORKS_*`)."""
        self.notify = notify
        self.manifest_path = Manifest.path_in(settings.state_path)
        self.manifest = Manifest()
        self._lock = asyncio.Lock()
        self._trainer_mgr: TrainerJobManager | None = None
        self._deploy_mgr: _GatedDeploymentManager | None = None
        self._service: FiretitanServiceClient | None = None
        self._training: FiretitanTrainingClient | None = None
        self._base_scorer: FiretitanTrainingClient | None = None
        self._syncer: WeightSyncer | None = None
        self._sampler: FireworksSampler | None = None
        self._model_info: ModelInfo | None = None
        self.provisioned: prov.Provisioned | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def _api_key(self) -> str:
        key = self.opts.api_key_value()
        if not key:
            raise prov.ProvisionError("FIREWORKS_API_KEY is not set; export your Fireworks API key")
        return key

    async def start(self) -> None:
        s = self.settings
        api_key = self._api_key()
        tokenizer = s.tokenizer_source
        if not tokenizer or tokenizer.startswith("accounts/"):
            raise prov.ProvisionError(
                "set tokenizer to a local folder or Hugging Face id matching the Fireworks base model"
            )
        if not self.opts.telemetry:
            os.environ.setdefault("TINKER_TELEMETRY", "0")
        await probe(s, api_key)
        self.manifest = Manifest.load(self.manifest_path)
        await asyncio.to_thread(self._start_blocking, api_key)
        assert self.provisioned is not None and self._deploy_mgr is not None
        info = self.provisioned.deployment
        self._sampler = FireworksSampler(
            inference_url=self._deploy_mgr.inference_url,
            model=info.inference_model
            or f"accounts/{self._deploy_mgr.account_id}/deployments/{info.deployment_id}",
            api_key=api_key,
            context_window=self._model_info.context_window if self._model_info else DEFAULT_CONTEXT_WINDOW,
            timeout_s=s.request_timeout_s,
            retry_budget_s=self.opts.retry_budget_s,
            version=self.manifest.version,
        )
        self.notify(f"ready: policy version {self.manifest.version}, step {self.manifest.step}")

    def _start_blocking(self, api_key: str) -> None:
        s, o = self.settings, self.opts
        base = o.base_url
        self._trainer_mgr = TrainerJobManager(
            api_key=api_key, base_url=base, trainer_gateway_url=o.trainer_gateway_url or None
        )
        self._deploy_mgr = _GatedDeploymentManager(
            api_key=api_key,
            base_url=base,
            inference_url=o.inference_url or None,
            hotload_api_url=o.hotload_url or None,
        )
        account = self._deploy_mgr.account_id
        if o.account_id and o.account_id != account:
            raise prov.ProvisionError(
                f"FIREWORKS_API_KEY belongs to account {account}, but FIREWORKS_ACCOUNT_ID is {o.account_id}"
            )
        plan = prov.make_plan(s, self.manifest, self._trainer_mgr, self._deploy_mgr)
        self.notify(prov.describe(plan, s))
        prov.require_consent(plan, s)
        done = prov.provision(plan, s, self._trainer_mgr, self._deploy_mgr, self.notify)
        self.provisioned = done
        m = self.manifest
        if m.base_model and m.base_model != s.model:
            m.versions, m.version, m.step, m.checkpoints = {}, 0, 0, []
        m.base_model = s.model
        m.trainer_job_id, m.deployment_id = done.endpoint.job_id, done.deployment.deployment_id
        if done.created_trainer_job:
            m.created_trainer_job = done.created_trainer_job
            m.checkpoints, m.step = [], 0  # a new trainer starts from the base weights
        elif plan.user_named_trainer or m.created_trainer_job != done.endpoint.job_id:
            m.created_trainer_job = ""
        if done.created_deployment:
            m.created_deployment = done.created_deployment
        elif plan.user_named_deployment or m.created_deployment != done.deployment.deployment_id:
            m.created_deployment = ""  # named by the user (or not ours): never deleted
        m.save(self.manifest_path)

        context = done.endpoint.max_context_length or (
            plan.profile.max_supported_context_length if plan.profile else 0
        )
        self._model_info = ModelInfo(
            name=s.model_name,
            tokenizer_path=s.tokenizer_source,
            context_window=int(context or DEFAULT_CONTEXT_WINDOW),
            max_output_tokens=s.default_max_tokens,
        )
        self._service = FiretitanServiceClient(base_url=done.endpoint.base_url, api_key=api_key)
        kwargs: dict[str, Any] = {"base_model": s.model, "lora_rank": s.lora_rank}
        if s.lora_rank > 0:
            kwargs["lora_alpha"] = int(s.lora_alpha)
        self._training = self._service.create_training_client(**kwargs)
        self._syncer = WeightSyncer(
            policy_client=self._training,
            deploy_mgr=self._deploy_mgr,
            deployment_id=done.deployment.deployment_id,
            base_model=s.model,
            hotload_timeout=o.hotload_timeout_s,
            lora_rank=s.lora_rank,
        )

    def _served_identity(self) -> str | None:
        assert self._deploy_mgr is not None and self.provisioned is not None
        try:
            status = self._deploy_mgr.hotload_check_status(
                self.provisioned.deployment.deployment_id, self.settings.model
            )
        except Exception:
            return None
        replicas = status.get("replicas") or []
        return replicas[0].get("current_snapshot_identity") if replicas else None

    def model_info(self) -> ModelInfo:
        if self._model_info is None:
            raise RuntimeError("start() has not finished")
        return self._model_info

    def sampler(self) -> Sampler:
        if self._sampler is None:
            raise RuntimeError("start() has not finished")
        return self._sampler

    async def close(self) -> None:
        """Best effort; never raises (failures are reported through `notify`)."""
        try:
            if self._sampler is not None:
                await self._sampler.aclose()
            await asyncio.to_thread(self._close_blocking)
        except Exception as e:  # nothing recorded depends on closing
            self.notify(f"close: {type(e).__name__}: {e}")

    def _close_blocking(self) -> None:
        if self.opts.delete_on_shutdown and self._trainer_mgr and self._deploy_mgr:
            prov.cleanup(self.manifest, self._trainer_mgr, self._deploy_mgr, self.notify)
            self.manifest.save(self.manifest_path)
        for closeable in (self._service, self._trainer_mgr, self._deploy_mgr):
            if closeable is not None:
                try:
                    closeable.close()
                except Exception as e:  # closing is best effort; nothing here is lost
                    self.notify(f"close: {type(e).__name__}: {e}")

    # -- training ------------------------------------------------------------------------------

    def _adam(self, lr_scale: float = 1.0) -> AdamParams:
        s = self.settings
        return AdamParams(
            learning_rate=s.effective_learning_rate * lr_scale,
            weight_decay=self.opts.weight_decay,
            grad_clip_norm=self.opts.grad_clip_norm,
        )

    async def train_step(self, batch: Sequence[Datum], loss: LossConfig) -> StepResult:
        if not batch:
            raise StepFailed("empty batch")
        loss_fn, loss_cfg = loss_options(loss)
        data = [to_fireworks_datum(d) for d in batch]
        async with self._lock:
            try:
                fwd, opt = await asyncio.to_thread(self._step_blocking, data, loss_fn, loss_cfg, loss.lr_scale)
            except Exception as e:
                raise StepFailed(f"fireworks training step failed: {type(e).__name__}: {e}") from e
            self.manifest.step += 1
            self.manifest.save(self.manifest_path)
        metrics = step_metrics(batch, fwd, opt)
        metrics["step"] = float(self.manifest.step)
        return StepResult(metrics=metrics)

    def _step_blocking(
        self, data: list[Any], loss_fn: str, loss_cfg: dict[str, float] | None, lr_scale: float = 1.0
    ) -> tuple[dict[str, float], dict[str, float]]:
        assert self._training is not None
        timeout = self.opts.step_timeout_s
        deadline = time.monotonic() + timeout
        fb = self._training.forward_backward(data, loss_fn, loss_cfg)  # type: ignore[arg-type]
        opt = self._training.optim_step(
            self._adam(lr_scale),
            grad_accumulation_normalization=GradAccNormalization(
                self.opts.grad_accumulation_normalization
            ),
        )
        fb_out = fb.result(timeout=timeout)
        opt_out = opt.result(timeout=max(0.001, deadline - time.monotonic()))
        return metrics_of(fb_out), metrics_of(opt_out)

    async def publish(self, version: int | None = None) -> int:
        assert self._syncer is not None and self._deploy_mgr is not None and self._sampler is not None
        sampler = self._sampler
        loop = asyncio.get_running_loop()

        def close_gate() -> None:
            asyncio.run_coroutine_threadsafe(sampler.close_gate(), loop).result(timeout=30)

        async with self._lock:
            target = self.manifest.version + 1 if version is None else version
            self._deploy_mgr.before_hotload = close_gate
            try:
                identity = await asyncio.to_thread(self._syncer.save_and_hotload, f"clawbridge-v{target}")
            except Exception as e:
                await sampler.open_gate(self.manifest.version)
                raise PublishFailed(f"fireworks publish failed: {type(e).__name__}: {e}") from e
            finally:
                self._deploy_mgr.before_hotload = None
            if not identity:
                await sampler.open_gate(self.manifest.version)
                raise PublishFailed("save_and_hotload returned no snapshot identity")
            await fault_point("publish.mid")
            self.manifest.versions[target] = identity
            self.manifest.version = target
            self.manifest.save(self.manifest_path)
            await sampler.open_gate(target)
            self.notify(f"published version {target} (snapshot {identity})")
            return target

    async def save_checkpoint(self, name: str) -> str:
        async with self._lock:
            return await self._save_checkpoint_locked(name)

    async def _save_checkpoint_locked(self, name: str) -> str:
        assert self._training is not None
        timeout = self.opts.step_timeout_s
        training = self._training
        result = await asyncio.to_thread(lambda: training.save_state(name).result(timeout=timeout))
        path = str(result.path)
        await fault_point("checkpoint.mid")
        self.manifest.checkpoints.append(
            CheckpointRecord(name, path, self.manifest.step, self.manifest.version)
        )
        self.manifest.save(self.manifest_path)
        return path

    async def restore_checkpoint(self, path: str, version: int | None = None) -> int:
        """Load weights + optimizer state and serve them as `version` (default: the version recorded
        with the checkpoint): hot-loaded again unless the deployment already serves that version's
        snapshot."""
        assert self._training is not None and self._sampler is not None
        timeout = self.opts.step_timeout_s
        training = self._training
        async with self._lock:
            await asyncio.to_thread(lambda: training.load_state_with_optimizer(path).result(timeout=timeout))
            target = self.manifest.version if version is None else version
            for rec in reversed(self.manifest.checkpoints):
                if rec.path == path:
                    self.manifest.step = rec.step
                    target = rec.version if version is None else version
                    break
            self.manifest.save(self.manifest_path)
        served = await asyncio.to_thread(self._served_identity)
        if target == self.manifest.version and served is not None and served == self.manifest.versions.get(target):
            return target
        self.notify(f"serving checkpoint {path} as version {target}")
        return await self.publish(target)

    # -- rewards: the base model as OPD teacher (clawbridge.backend.LogprobScorer) -------------

    async def compute_logprobs(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]
    ) -> list[list[float]]:
        """Logprobs of the tokens after each prompt under the BASE model: one forward-only
        `cross_entropy` pass on a base-only training client (LoRA adapters disabled), never the
        trained or published weights. Per sequence: exactly `len(tokens) - prompt_len` floats,
        logprob(tokens[i] | tokens[:i]) for i in [prompt_len, len(tokens)), in order.

        Raises ValueError for a prompt length outside [1, len(tokens)], `ScoringUnavailable` on a
        full-parameter trainer (no frozen base copy), `ScoringFailed` when the trainer fails."""
        check_prompt_lens(sequences, prompt_lens)
        todo = [i for i, (seq, p) in enumerate(zip(sequences, prompt_lens, strict=True)) if p < len(seq)]
        out: list[list[float]] = [[] for _ in sequences]
        if not todo:
            return out
        if self._service is None:
            raise RuntimeError("FireworksBackend.start() has not run")
        if self.settings.lora_rank <= 0:
            raise ScoringUnavailable(
                "a full-parameter Fireworks trainer (lora_rank 0) keeps no frozen base model to score "
                "the OPD teacher with; use lora_rank > 0 or method=rl"
            )
        seqs = [[int(t) for t in sequences[i]] for i in todo]
        lens = [int(prompt_lens[i]) for i in todo]
        data = [scoring_datum(seq, p) for seq, p in zip(seqs, lens, strict=True)]
        async with self._lock:
            try:
                result = await asyncio.to_thread(self._forward_base_blocking, data)
            except Exception as e:
                raise ScoringFailed(f"fireworks base-model forward failed: {type(e).__name__}: {e}") from e
        for i, lps in zip(todo, completion_logprobs(result, seqs, lens), strict=True):
            out[i] = lps
        return out

    def _forward_base_blocking(self, data: list[Any]) -> Any:
        """Create the base-only client once, then run one forward-only pass over `data`.

        A failed request poisons the SDK client's request sequence ("unload this model and
        reconnect"), so after a failure the client is unloaded (best effort) and dropped; the
        next call creates a fresh one."""
        assert self._service is not None
        if self._base_scorer is None:
            self._base_scorer = self._service.create_base_training_client(self.settings.model)
        client = self._base_scorer
        timeout = self.opts.step_timeout_s
        try:
            return client.forward(data, SCORING_LOSS_FN).result(timeout=timeout)
        except Exception:
            self._base_scorer = None
            try:
                client.unload_model().result(timeout=min(timeout, 60.0))
            except Exception as e:  # cleanup only; the scoring error is what the caller sees
                self.notify(f"unload of the base scoring model failed: {type(e).__name__}: {e}")
            raise


def create(settings: Settings) -> FireworksBackend:
    """Entry point `clawbridge.backends:fireworks`; its options are `FireworksSettings`."""
    return FireworksBackend(settings)


create.settings_model = FireworksSettings  # type: ignore[attr-defined]
