"""`doctor_checks(settings)`: one line per check of what the Fireworks backend needs.

Each check is `(ok, message)`; a failed message says what is wrong and how to fix it. The network
check is the start-up probe (check.py): short timeouts, read-only, never creates anything.
"""

from __future__ import annotations

import asyncio
from importlib import metadata

from clawbridge.backend_settings import BackendSettingsError
from clawbridge.config import Settings
from clawbridge.probe import ServiceProbeFailed
from clawbridge_fireworks import PINNED_SDK_VERSION
from clawbridge_fireworks.check import probe
from clawbridge_fireworks.settings import NAME, fireworks_settings


def doctor_checks(settings: Settings, timeout_s: float = 10.0) -> list[tuple[bool, str]]:
    """Key, account, SDK version, training shape and reachability, one line each."""
    checks: list[tuple[bool, str]] = []
    try:
        opts = fireworks_settings(settings)
    except BackendSettingsError as e:
        return [(False, str(e))]
    key = opts.api_key_value()
    checks.append(
        (True, "FIREWORKS_API_KEY is set")
        if key
        else (
            False,
            "FIREWORKS_API_KEY is not set: export your key from https://fireworks.ai/account/api-keys",
        )
    )
    checks.append(
        (True, f"FIREWORKS_ACCOUNT_ID is {opts.account_id}")
        if opts.account_id
        else (
            False,
            "FIREWORKS_ACCOUNT_ID is not set: export your account id (used to check the key's account)",
        )
    )
    try:
        version = metadata.version("fireworks-ai")
    except metadata.PackageNotFoundError:
        checks.append(
            (False, f"fireworks-ai is not installed: pip install 'fireworks-ai[training-sdk]=={PINNED_SDK_VERSION}'")
        )
    else:
        checks.append(
            (True, f"fireworks-ai {version}")
            if version == PINNED_SDK_VERSION
            else (
                False,
                f"fireworks-ai is {version}, tested with {PINNED_SDK_VERSION}: pip install 'fireworks-ai[training-sdk]=={PINNED_SDK_VERSION}'",
            )
        )
    if not (opts.training_shape or opts.trainer_job):
        checks.append((False, f"neither [backends.{NAME}] training_shape nor trainer_job is set: set one"))
    if not key:
        return checks
    try:
        accounts = asyncio.run(probe(settings.model_copy(update={"probe_timeout_s": timeout_s}), key))
    except ServiceProbeFailed as e:
        checks.append((False, str(e)))
        return checks
    checks.append(
        (True, f"{opts.base_url} reachable; key belongs to {', '.join(accounts) or '?'}")
    )
    if opts.account_id and accounts and opts.account_id not in accounts:
        checks.append(
            (
                False,
                f"FIREWORKS_ACCOUNT_ID {opts.account_id} is not the key's account {accounts}",
            )
        )
    return checks
