"""clawbridge backend for Tinker: LoRA training and sampling through the hosted Tinker API.

The names below are imported on first use (PEP 562), so importing `clawbridge_tinker.settings`
(how `clawbridge config show` lists this backend's options) does not import the Tinker SDK.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real types for mypy; at run time `__getattr__` imports them
    from .backend import TinkerBackend, configure_telemetry, create
    from .doctor import doctor_checks
    from .errors import TinkerError, TinkerRequestFailed, TinkerTransientError
    from .sampler import FakeSamplingClient, SamplerLimits, TinkerSampler

_WHERE = {
    "FakeSamplingClient": "sampler",
    "SamplerLimits": "sampler",
    "TinkerBackend": "backend",
    "TinkerError": "errors",
    "TinkerRequestFailed": "errors",
    "TinkerSampler": "sampler",
    "TinkerTransientError": "errors",
    "configure_telemetry": "backend",
    "create": "backend",
    "doctor_checks": "doctor",
}

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
