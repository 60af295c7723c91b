"""clawbridge backend for Tinker: LoRA training and sampling through the hosted Tinker API."""

from .backend import TinkerBackend, configure_telemetry, create
from .doctor import doctor_checks
from .errors import TinkerError, TinkerRequestFailed, TinkerTransientError
from .sampler import FakeSamplingClient, SamplerLimits, TinkerSampler

__all__ = [
    "FakeSamplingClient",
    "SamplerLimits",
    "TinkerBackend",
    "TinkerError",
    "TinkerRequestFailed",
    "TinkerSampler",
    "TinkerTransientError",
    "configure_telemetry",
    "create",
    "doctor_checks",
]
