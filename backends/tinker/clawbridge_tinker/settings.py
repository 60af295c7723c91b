"""The Tinker backend's options: TOML `[backends.tinker]`, environment `CLAWBRIDGE_TINKER_<OPTION>`.

Invariants:
- Every option the Tinker backend reads that the core does not is here, nowhere else; the
  backend, its doctor checks and its probe read them with `tinker_settings(settings)`.
- `api_key` also reads `TINKER_API_KEY` (first), as the Tinker SDK does; it is a `SecretStr` and is
  masked wherever settings are shown.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from clawbridge.backend_settings import backend_section
from clawbridge.config import Settings

NAME = "tinker"
"""The backend's name: its entry point, its TOML section and its environment prefix."""


class TinkerSettings(BaseModel):
    """Options of the Tinker backend (`[backends.tinker]`)."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field("", description="Tinker API URL (default: TINKER_BASE_URL, else Tinker's production API).")
    base_model: str = Field("", description="Tinker base model to train, e.g. Qwen/Qwen3-8B (default: the model).")
    step_timeout_s: float = Field(900.0, description="forward_backward + optim_step longer than this fail (transient).")
    sample_timeout_s: float = Field(300.0, description="A Tinker sample call longer than this gets 504.")
    publish_timeout_s: float = Field(600.0, description="Saving weights for the sampler longer than this fails.")
    max_retries: int = Field(3, description="Retries of a transient Tinker failure (429, timeout, connection) before giving up.")
    retry_backoff_s: float = Field(1.0, description="First wait between Tinker retries; doubles each retry.")
    max_loaded_versions: int = Field(
        8, ge=1, description="Sampling clients kept for committed versions other than the published one "
        "(`model: NAME@N`, promotion); least recently used dropped.")
    telemetry: bool = Field(False, description="Send the Tinker SDK's telemetry to Tinker (off by default).")
    api_key: SecretStr | None = Field(
        None, description="Tinker API key.", json_schema_extra={"env": ["TINKER_API_KEY", "CLAWBRIDGE_TINKER_API_KEY"]}
    )

    def api_key_value(self) -> str | None:
        """The key itself (None when unset), for the SDK only: never log it."""
        return self.api_key.get_secret_value() if self.api_key else None


def tinker_settings(settings: Settings) -> TinkerSettings:
    """The Tinker backend's options under `settings` (`clawbridge.backend_settings` says where
    they come from); raises `BackendSettingsError` naming a bad one."""
    return backend_section(settings, NAME, TinkerSettings)
