"""The one place this package imports the Tinker SDK.

Invariants:
- Every other module takes SDK names from here, so `SDK_NAMES` lists exactly what we depend on;
  `tests/test_tinker_backend.py` checks each exists in the installed SDK, so a rename in a new
  `tinker` release fails CI instead of failing at a user's first training step.
- `PINNED_VERSION` is the version `pyproject.toml` pins and `doctor_checks` compares against.
"""

from __future__ import annotations

import tinker
from tinker import (
    AdamParams,
    APIConnectionError,
    APIStatusError,
    ModelInput,
    ParsedCheckpointTinkerPath,
    RateLimitError,
    RequestFailedError,
    RestClient,
    SampleResponse,
    SamplingClient,
    SamplingParams,
    ServiceClient,
    TensorData,
    TrainingClient,
)
from tinker import Datum as TinkerDatum
from tinker.lib.retry_handler import RetryConfig

PINNED_VERSION = "0.38.0"

SDK_NAMES: tuple[str, ...] = (
    "tinker.ServiceClient",
    "tinker.TrainingClient",
    "tinker.SamplingClient",
    "tinker.RestClient",
    "tinker.ModelInput",
    "tinker.SamplingParams",
    "tinker.SampleResponse",
    "tinker.Datum",
    "tinker.TensorData",
    "tinker.AdamParams",
    "tinker.RequestFailedError",
    "tinker.RateLimitError",
    "tinker.APIStatusError",
    "tinker.APIConnectionError",
    "tinker.lib.retry_handler.RetryConfig",
    "tinker.ServiceClient.create_lora_training_client",
    "tinker.ServiceClient.create_sampling_client",
    "tinker.ServiceClient.create_training_client_from_state",
    "tinker.ServiceClient.create_training_client_from_state_with_optimizer",
    "tinker.TrainingClient.forward_backward",
    "tinker.TrainingClient.optim_step",
    "tinker.TrainingClient.save_state",
    "tinker.TrainingClient.save_weights_and_get_sampling_client",
    "tinker.SamplingClient.sample",
    "tinker.RestClient.delete_checkpoint_from_tinker_path",
    "tinker.RestClient.delete_checkpoint",
    "tinker.ParsedCheckpointTinkerPath.from_tinker_path",
)
"""Dotted names (module attribute paths) this package uses from the SDK."""

TELEMETRY_ENV = "TINKER_TELEMETRY"
"""The SDK reads this at client creation (`tinker.lib.telemetry._is_telemetry_enabled`);
anything but 1/true/yes/on turns its telemetry off. Unset means on, so we always set it."""

__all__ = [
    "PINNED_VERSION",
    "SDK_NAMES",
    "TELEMETRY_ENV",
    "APIConnectionError",
    "APIStatusError",
    "AdamParams",
    "ModelInput",
    "ParsedCheckpointTinkerPath",
    "RateLimitError",
    "RequestFailedError",
    "RestClient",
    "RetryConfig",
    "SampleResponse",
    "SamplingClient",
    "SamplingParams",
    "ServiceClient",
    "TensorData",
    "TinkerDatum",
    "TrainingClient",
    "tinker",
]
