"""clawbridge backend for the Fireworks training SDK (trainer job + hot-load deployment).

The entry point `fireworks = "clawbridge_fireworks.backend:create"` (group `clawbridge.backends`)
is what clawbridge loads; nothing here is imported by the core.
"""

from __future__ import annotations

PINNED_SDK_VERSION = "1.2.30"
"""The `fireworks-ai` release this backend is written and tested against."""

__all__ = ["PINNED_SDK_VERSION"]
