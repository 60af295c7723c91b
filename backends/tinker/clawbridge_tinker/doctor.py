"""`clawbridge doctor` checks for the Tinker backend: one line each, saying what to fix.

Invariants:
- Never prints or logs the key; only whether it is there and well formed.
- The reachability check runs only with a key: the start-up probe (service.py), each request
  bounded by `timeout_s`.
"""

from __future__ import annotations

import asyncio

from clawbridge.backend_settings import BackendSettingsError
from clawbridge.config import Settings
from clawbridge.probe import ServiceProbeFailed

from .sdk import PINNED_VERSION, tinker
from .service import probe, resolve_base_url
from .settings import tinker_settings


def doctor_checks(settings: Settings, timeout_s: float = 20.0) -> list[tuple[bool, str]]:
    """(ok, one-line message) for the key, the SDK version, the model settings and reachability."""
    checks: list[tuple[bool, str]] = []
    try:
        opts = tinker_settings(settings)
    except BackendSettingsError as e:
        return [(False, str(e))]
    key = opts.api_key_value() or ""
    if not key:
        checks.append(
            (False, "TINKER_API_KEY is not set: export TINKER_API_KEY=tml-... (from the Tinker console)")
        )
    elif not key.startswith(("tml-", "eyJ")):
        checks.append((False, "TINKER_API_KEY does not look like a Tinker key (it should start with tml-)"))
    else:
        checks.append((True, "TINKER_API_KEY is set"))

    version = getattr(tinker, "__version__", "unknown")
    if version == PINNED_VERSION:
        checks.append((True, f"tinker {version} installed"))
    else:
        checks.append(
            (
                False,
                f"tinker {version} installed, but this backend needs {PINNED_VERSION}: pip install tinker=={PINNED_VERSION}",
            )
        )

    base_model = opts.base_model or settings.model
    if not base_model:
        checks.append((False, "no base model: set [backends.tinker] base_model (or --model), e.g. Qwen/Qwen3-8B"))
    if not settings.tokenizer_source:
        checks.append(
            (False, "no tokenizer: set --tokenizer to a local folder or id with the base model's tokenizer")
        )

    url = resolve_base_url(opts.base_url or None)
    if not key:
        checks.append((False, f"did not try to reach {url}: no key"))
        return checks
    try:
        probed = asyncio.run(probe(opts.base_url or None, key, None, timeout_s))
    except ServiceProbeFailed as e:
        checks.append((False, str(e)))
        return checks
    checks.append((True, f"reached {url}: key accepted, {len(probed.offered)} models offered"))
    if base_model and probed.offered and base_model not in probed.offered:
        checks.append(
            (False, f"Tinker does not offer {base_model!r}; choose one of: {', '.join(probed.offered)}")
        )
    return checks
