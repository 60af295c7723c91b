"""The Fireworks backend's options: TOML `[backends.fireworks]`, environment
`CLAWBRIDGE_FIREWORKS_<OPTION>`.

Invariants:
- Every option the Fireworks backend reads that the core does not is here, nowhere else; the
  backend, provisioning, its doctor checks and its probe read them with `fireworks_settings(settings)`.
- `api_key` and `account_id` also read `FIREWORKS_API_KEY` / `FIREWORKS_ACCOUNT_ID` (first), as the
  Fireworks SDK does; the key is a `SecretStr` and is masked wherever settings are shown.
- Nothing billable is created without `yes` (`clawbridge up --yes` sets it, over the environment).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from clawbridge.backend_settings import backend_section
from clawbridge.config import Settings

NAME = "fireworks"
"""The backend's name: its entry point, its TOML section and its environment prefix."""


class FireworksSettings(BaseModel):
    """Options of the Fireworks backend (`[backends.fireworks]`)."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field("https://api.fireworks.ai", description="Fireworks control-plane API URL.")
    inference_url: str = Field("", description="Fireworks inference gateway URL (default: base_url).")
    hotload_url: str = Field("", description="Fireworks hot-load gateway URL (default: base_url).")
    trainer_gateway_url: str = Field("", description="Fireworks trainer gateway URL (default: base_url).")
    training_shape: str = Field(
        "", description="Training shape, accounts/<a>/trainingShapes/<s>[/versions/<v>]; needed to create a trainer."
    )
    trainer_job: str = Field("", description="Existing trainer job id to reuse (never deleted by clawbridge).")
    deployment: str = Field("", description="Existing hot-load deployment id to reuse (never deleted).")
    region: str = Field("", description="Region for a created trainer and deployment (default: any).")
    yes: bool = Field(False, description="Consent to create billable Fireworks trainer jobs and deployments (`up --yes`).")
    delete_on_shutdown: bool = Field(
        False, description="At shutdown, delete the trainer job and deployment clawbridge created (never reused ones)."
    )
    grad_accumulation_normalization: Literal["num_loss_tokens", "num_sequences", "none"] = Field(
        "none",
        description="How optim_step normalizes the summed loss; 'none' because the trainer loop already folds "
        "its normalization (advantage_normalization) into the advantages, the same for every backend.",
    )
    grad_clip_norm: float = Field(1.0, description="Adam global gradient-norm clip (0: off).")
    weight_decay: float = Field(0.0, description="Adam decoupled weight decay.")
    poll_interval_s: float = Field(5.0, description="Polling interval while a trainer or deployment starts.")
    trainer_timeout_s: float = Field(3600.0, description="Wait for a trainer job to become ready.")
    deployment_timeout_s: float = Field(5400.0, description="Wait for a deployment to become ready.")
    step_timeout_s: float = Field(900.0, description="Wait for one forward_backward + optim_step.")
    hotload_timeout_s: int = Field(600, description="Wait for a hot load onto the deployment.")
    retry_budget_s: float = Field(60.0, description="Total backoff on 425/429 for one sampling call.")
    telemetry: bool = Field(False, description="Let the Fireworks training SDK send its telemetry.")
    api_key: SecretStr | None = Field(
        None, description="Fireworks API key.",
        json_schema_extra={"env": ["FIREWORKS_API_KEY", "CLAWBRIDGE_FIREWORKS_API_KEY"]},
    )
    account_id: str | None = Field(
        None, description="Fireworks account id.",
        json_schema_extra={"env": ["FIREWORKS_ACCOUNT_ID", "CLAWBRIDGE_FIREWORKS_ACCOUNT_ID"]},
    )

    def api_key_value(self) -> str:
        """The key itself ('' when unset), for the SDK only: never log it."""
        return self.api_key.get_secret_value() if self.api_key else ""


def fireworks_settings(settings: Settings) -> FireworksSettings:
    """The Fireworks backend's options under `settings` (`clawbridge.backend_settings` says where
    they come from); raises `BackendSettingsError` naming a bad one."""
    return backend_section(settings, NAME, FireworksSettings)
