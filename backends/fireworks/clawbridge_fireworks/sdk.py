"""The one place that imports the Fireworks training SDK.

Invariants:
- Every SDK name this package uses is listed in `SDK_NAMES` and imported here, so a rename in
  `fireworks-ai` fails `tests/test_fireworks_backend.py::test_sdk_names_exist` (and this import)
  instead of failing at run time on a user's machine.
- Importing this module is cheap: the SDK's package root is lazy.
"""

from __future__ import annotations

from fireworks.training.sdk import (
    AdamParams,
    DeploymentConfig,
    DeploymentInfo,
    DeploymentManager,
    FiretitanServiceClient,
    FiretitanTrainingClient,
    GradAccNormalization,
    ModelInput,
    RequestFailedError,
    TensorData,
    TrainerJobConfig,
    TrainerJobManager,
    TrainerServiceEndpoint,
    TrainingShapeProfile,
    WeightSyncer,
)
from fireworks.training.sdk import Datum as FwDatum

SDK_NAMES: dict[str, tuple[str, ...]] = {
    "fireworks.training.sdk": (
        "AdamParams",
        "Datum",
        "DeploymentConfig",
        "DeploymentInfo",
        "DeploymentManager",
        "FiretitanServiceClient",
        "FiretitanTrainingClient",
        "GradAccNormalization",
        "ModelInput",
        "RequestFailedError",
        "TensorData",
        "TrainerJobConfig",
        "TrainerJobManager",
        "TrainerServiceEndpoint",
        "TrainingShapeProfile",
        "WeightSyncer",
    ),
}
"""Module -> the names this package imports from it (checked by a test)."""

SDK_METHODS: dict[str, tuple[str, ...]] = {
    "TrainerJobManager": (
        "create_and_wait",
        "wait_for_existing",
        "resolve_training_profile",
        "delete",
        "try_get",
    ),
    "DeploymentManager": ("create_or_get", "wait_for_ready", "get", "delete", "hotload_check_status"),
    "FiretitanServiceClient": ("create_training_client", "create_base_training_client"),
    "FiretitanTrainingClient": (
        "forward",
        "unload_model",
        "forward_backward",
        "optim_step",
        "save_state",
        "load_state_with_optimizer",
        "save_weights_for_sampler_ext",
    ),
    "WeightSyncer": ("save_and_hotload",),
    "ModelInput": ("from_ints",),
}
"""Class -> the methods this package calls on it (checked by a test)."""

__all__ = [
    "SDK_METHODS",
    "SDK_NAMES",
    "AdamParams",
    "DeploymentConfig",
    "DeploymentInfo",
    "DeploymentManager",
    "FiretitanServiceClient",
    "FiretitanTrainingClient",
    "FwDatum",
    "GradAccNormalization",
    "ModelInput",
    "RequestFailedError",
    "TensorData",
    "TrainerJobConfig",
    "TrainerJobManager",
    "TrainerServiceEndpoint",
    "TrainingShapeProfile",
    "WeightSyncer",
]
