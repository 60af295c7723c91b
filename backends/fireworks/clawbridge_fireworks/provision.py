"""Start-up planning and provisioning of the trainer job and hot-load deployment.

Invariants:
- Nothing billable is created or resumed without consent (`[backends.fireworks] yes`): `make_plan` decides
  what would be created, `require_consent` refuses with the plan (what, and what it costs to keep
  running) when consent is missing. Reusing a running resource needs no consent.
- Resources the user names are reused, never created, never deleted. Resources clawbridge created
  are recorded in the manifest and reused on the next start while they still exist.
- The training shape decides LoRA vs full: a `LORA_TRAINER` shape needs `lora_rank > 0`, any other
  needs `lora_rank = 0`; a mismatch is refused before anything is created.
- Created deployments hot-load from the trainer job (`hot_load_trainer_job`) with the SYNC
  transition, so requests in flight during a hot load finish on the weights they started on.
All functions here block; the backend calls them off the event loop.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clawbridge.config import Settings
from clawbridge_fireworks.manifest import Manifest
from clawbridge_fireworks.sdk import (
    DeploymentConfig,
    DeploymentInfo,
    DeploymentManager,
    TrainerJobConfig,
    TrainerJobManager,
    TrainerServiceEndpoint,
    TrainingShapeProfile,
)
from clawbridge_fireworks.settings import fireworks_settings

APPROX_USD_PER_GPU_HOUR: dict[str, float] = {
    "NVIDIA_A100_80GB": 2.9,
    "NVIDIA_H100_80GB": 4.0,
    "NVIDIA_H200_141GB": 6.0,
    "NVIDIA_B200_180GB": 9.0,
}
"""Rough on-demand list prices, for the consent message only; fireworks.ai/pricing is authoritative."""

PRICING_URL = "https://fireworks.ai/pricing"
_GONE_STATES = frozenset({"JOB_STATE_DELETED", "JOB_STATE_ARCHIVED", "JOB_STATE_DELETING"})
_STOPPED_STATES = frozenset(
    {
        "JOB_STATE_FAILED",
        "JOB_STATE_CANCELLED",
        "JOB_STATE_PAUSED",
        "JOB_STATE_COMPLETED",
        "JOB_STATE_EARLY_STOPPED",
    }
)
_BAD_DEPLOYMENT_STATES = frozenset({"FAILED", "DELETED", "DELETING"})


class ConsentRequired(RuntimeError):
    """Creating billable resources needs `--yes` / `[backends.fireworks] yes = true`."""


class ProvisionError(RuntimeError):
    """The configuration cannot be provisioned as asked (a clear, actionable message)."""


@dataclass(frozen=True)
class Plan:
    """What start-up will do on Fireworks."""

    trainer_job_id: str
    trainer_action: str
    """"reuse", "resume" or "create"."""
    deployment_id: str
    deployment_action: str
    """"reuse" or "create"."""
    profile: TrainingShapeProfile | None
    user_named_trainer: bool
    user_named_deployment: bool

    @property
    def billable(self) -> bool:
        return self.trainer_action in ("create", "resume") or self.deployment_action == "create"


@dataclass(frozen=True)
class Provisioned:
    """The live resources after start-up."""

    endpoint: TrainerServiceEndpoint
    deployment: DeploymentInfo
    created_trainer_job: str
    created_deployment: str


def resolve_profile(settings: Settings, trainer_mgr: TrainerJobManager) -> TrainingShapeProfile | None:
    """Resolve `[backends.fireworks] training_shape` and check LoRA vs full against `lora_rank`."""
    shape = fireworks_settings(settings).training_shape
    if not shape:
        return None
    profile = trainer_mgr.resolve_training_profile(shape)
    if settings.lora_rank > 0 and not profile.supports_lora:
        raise ProvisionError(
            f"training shape {shape} is full-parameter "
            f"(trainer mode {profile.trainer_mode or 'unknown'}); set lora_rank = 0 or pick a LoRA shape"
        )
    if settings.lora_rank == 0 and profile.supports_lora:
        raise ProvisionError(
            f"training shape {shape} is a LoRA shape; set lora_rank > 0 "
            "or pick a full-parameter shape"
        )
    return profile


def make_plan(
    settings: Settings, manifest: Manifest, trainer_mgr: TrainerJobManager, deploy_mgr: DeploymentManager
) -> Plan:
    """Decide, without creating anything, what to reuse, resume or create."""
    if not settings.model:
        raise ProvisionError("set model to the Fireworks base model, e.g. accounts/fireworks/models/qwen3-8b")
    profile = resolve_profile(settings, trainer_mgr)
    opts = fireworks_settings(settings)

    trainer_id, trainer_action = "", "create"
    named_trainer = bool(opts.trainer_job)
    candidate = opts.trainer_job or manifest.created_trainer_job
    if candidate:
        job = trainer_mgr.try_get(candidate)
        state = str((job or {}).get("state", ""))
        if job is None or state in _GONE_STATES:
            if named_trainer:
                raise ProvisionError(f"trainer job {candidate} does not exist (state {state or 'missing'})")
        else:
            _check_job_matches(settings, candidate, job)
            trainer_id = candidate
            trainer_action = "resume" if state in _STOPPED_STATES else "reuse"
    if trainer_action == "create":
        if profile is None:
            raise ProvisionError(
                "set [backends.fireworks] training_shape (accounts/<a>/trainingShapes/<s>) to create a trainer "
                "job, or [backends.fireworks] trainer_job to reuse one"
            )
        trainer_id = f"clawbridge-{uuid.uuid4().hex[:10]}"

    deployment_id, deployment_action = "", "create"
    named_deployment = bool(opts.deployment)
    dcandidate = opts.deployment or manifest.created_deployment
    if dcandidate:
        info = deploy_mgr.get(dcandidate)
        if info is None or info.state in _BAD_DEPLOYMENT_STATES:
            if named_deployment:
                raise ProvisionError(
                    f"deployment {dcandidate} does not exist or is {info.state if info else 'gone'}"
                )
        else:
            deployment_id, deployment_action = dcandidate, "reuse"
    if deployment_action == "create":
        if profile is None or not profile.deployment_shape:
            raise ProvisionError(
                "set [backends.fireworks] training_shape (its deployment shape is used) to create a deployment, "
                "or [backends.fireworks] deployment to reuse one"
            )
        deployment_id = f"clawbridge-{uuid.uuid4().hex[:10]}"
    return Plan(
        trainer_id, trainer_action, deployment_id, deployment_action, profile, named_trainer, named_deployment
    )


def _check_job_matches(settings: Settings, job_id: str, job: dict[str, Any]) -> None:
    cfg = job.get("trainingConfig") or {}
    base = cfg.get("baseModel")
    if base and base != settings.model:
        raise ProvisionError(f"trainer job {job_id} trains {base}, but model is {settings.model}")
    rank = cfg.get("loraRank")
    if rank is not None and int(rank) != settings.lora_rank:
        raise ProvisionError(
            f"trainer job {job_id} has lora_rank {rank}, but lora_rank is {settings.lora_rank}"
        )


def describe(plan: Plan, settings: Settings) -> str:
    """The plan in words, with what it costs to keep running."""
    lines = ["clawbridge (fireworks backend) start-up plan:"]
    p = plan.profile
    if plan.trainer_action == "reuse":
        lines.append(f"  - reuse trainer job {plan.trainer_job_id}")
    else:
        verb = "create" if plan.trainer_action == "create" else "resume"
        if p is not None:
            gpus = max(1, p.accelerator_count) * max(1, p.node_count)
            rate = APPROX_USD_PER_GPU_HOUR.get(p.accelerator_type)
            cost = f"about ${rate * gpus:.2f}/hour" if rate else "billed per GPU-hour"
            hw = f"{gpus} x {p.accelerator_type or 'accelerator'}"
        else:
            cost, hw = "billed per GPU-hour", "its existing accelerators"
        mode = f"LoRA rank {settings.lora_rank}" if settings.lora_rank else "full-parameter"
        lines.append(
            f"  - {verb} trainer job {plan.trainer_job_id} ({settings.model}, {mode}, {hw}): {cost} while it runs; "
            "Fireworks stops it after 60 minutes without training activity"
        )
    if plan.deployment_action == "reuse":
        lines.append(f"  - reuse deployment {plan.deployment_id}")
    else:
        shape = p.deployment_shape if p is not None else "?"
        lines.append(
            f"  - create deployment {plan.deployment_id} (deployment shape {shape}, 1 replica, hot load from the "
            "trainer): billed per GPU-hour while its replica is up, even when idle"
        )
    if fireworks_settings(settings).delete_on_shutdown:
        lines.append(
            "  At shutdown clawbridge deletes what it created ([backends.fireworks] delete_on_shutdown = true)."
        )
    else:
        lines.append(
            "  Nothing is deleted at shutdown; set [backends.fireworks] delete_on_shutdown = true to delete what "
            "clawbridge created."
        )
    lines.append(f"  Prices are estimates; see {PRICING_URL}.")
    return "\n".join(lines)


def require_consent(plan: Plan, settings: Settings) -> None:
    """Refuse a billable plan without `[backends.fireworks] yes`."""
    if plan.billable and not fireworks_settings(settings).yes:
        raise ConsentRequired(
            describe(plan, settings)
            + "\nRefusing to create or resume billable Fireworks resources without consent: "
            "run with --yes, or set [backends.fireworks] yes = true (CLAWBRIDGE_FIREWORKS_YES=1)."
        )


def provision(
    plan: Plan,
    settings: Settings,
    trainer_mgr: TrainerJobManager,
    deploy_mgr: DeploymentManager,
    notify: Callable[[str], None],
) -> Provisioned:
    """Carry out the plan; block until the trainer and the deployment are ready."""
    require_consent(plan, settings)
    opts = fireworks_settings(settings)
    poll = opts.poll_interval_s
    created_trainer = ""
    if plan.trainer_action == "create":
        assert plan.profile is not None
        notify(f"creating trainer job {plan.trainer_job_id} (this can take many minutes)")
        endpoint = trainer_mgr.create_and_wait(
            TrainerJobConfig(
                base_model=settings.model,
                lora_rank=settings.lora_rank,
                learning_rate=settings.effective_learning_rate,
                training_shape_ref=plan.profile.training_shape,
                display_name=f"clawbridge {plan.trainer_job_id}"[:63],
                region=opts.region or None,
                requested_job_id=plan.trainer_job_id,
            ),
            poll_interval_s=poll,
            timeout_s=opts.trainer_timeout_s,
        )
        created_trainer = endpoint.job_id
    elif plan.trainer_action == "resume":
        notify(f"resuming trainer job {plan.trainer_job_id}")
        endpoint = trainer_mgr.resume_and_wait(
            plan.trainer_job_id, poll_interval_s=poll, timeout_s=opts.trainer_timeout_s
        )
    else:
        notify(f"connecting to trainer job {plan.trainer_job_id}")
        endpoint = trainer_mgr.wait_for_existing(
            plan.trainer_job_id, poll_interval_s=poll, timeout_s=opts.trainer_timeout_s
        )

    created_deployment = ""
    if plan.deployment_action == "create":
        assert plan.profile is not None
        notify(f"creating deployment {plan.deployment_id}")
        info = deploy_mgr.create_or_get(
            DeploymentConfig.from_training_profile(
                deployment_id=plan.deployment_id,
                base_model=settings.model,
                profile=plan.profile,
                region=opts.region or None,
                min_replica_count=1,
                max_replica_count=1,
                hot_load_trainer_job=endpoint.job_name,
                enable_hot_load=True,
                hot_load_transition_type="SYNC",
                description="clawbridge policy deployment",
            )
        )
        created_deployment = info.deployment_id
    info = deploy_mgr.wait_for_ready(
        plan.deployment_id, timeout_s=opts.deployment_timeout_s, poll_interval_s=poll
    )
    if info.hot_load_trainer_job and info.hot_load_trainer_job != endpoint.job_name:
        raise ProvisionError(
            f"deployment {plan.deployment_id} hot-loads from {info.hot_load_trainer_job}, not from trainer "
            f"{endpoint.job_name}; reattach it in the Fireworks console or name a matching trainer job"
        )
    return Provisioned(endpoint, info, created_trainer, created_deployment)


def cleanup(
    manifest: Manifest,
    trainer_mgr: TrainerJobManager,
    deploy_mgr: DeploymentManager,
    notify: Callable[[str], None],
) -> None:
    """Delete only what clawbridge created (callers decide whether to call this at all)."""
    if manifest.created_deployment:
        notify(f"deleting deployment {manifest.created_deployment}")
        deploy_mgr.delete(manifest.created_deployment)
        manifest.created_deployment = ""
    if manifest.created_trainer_job:
        notify(f"deleting trainer job {manifest.created_trainer_job}")
        trainer_mgr.delete(manifest.created_trainer_job)
        manifest.created_trainer_job = ""
