"""`doctor_checks(settings)`: one line per check of what the Fireworks backend needs.

Each check is `(ok, message)`; a failed message says what is wrong and how to fix it. The network
check is the start-up probe (check.py): short timeouts, read-only, never creates anything.
"""

from __future__ import annotations

import asyncio
from importlib import metadata

from clawbridge.config import Settings
from clawbridge.probe import ServiceProbeFailed
from clawbridge_fireworks import PINNED_SDK_VERSION
from clawbridge_fireworks.check import probe


def doctor_checks(settings: Settings, timeout_s: float = 10.0) -> list[tuple[bool, str]]:
    """Key, account, SDK version, training shape and reachability, one line each."""
    checks: list[tuple[bool, str]] = []
    key = settings.fireworks_api_key.get_secret_value() if settings.fireworks_api_key else ""
    checks.append(
        (True, "FIREWORKS_API_KEY is set")
        if key
        else (
            False,
            "FIREWORKS_API_KEY is not set: export your key from https://fireworks.ai/account/api-keys",
        )
    )
    checks.append(
        (True, f"FIREWORKS_ACCOUNT_ID is {settings.fireworks_account_id}")
        if settings.fireworks_account_id
        else (
            False,
            "FIREWORKS_ACCOUNT_ID is not set: export your account id (used to check the key's account)",
        )
    )
    try:
        version = metadata.version("fireworks-ai")
    except metadata.PackageNotFoundError:
        checks.append(
            (False, f"fireworks-ai is not installed: pip install fireworks-ai=={PINNED_SDK_VERSION}")
        )
    else:
        checks.append(
            (True, f"fireworks-ai {version}")
            if version == PINNED_SDK_VERSION
            else (
                False,
                f"fireworks-ai is {version}, tested with {PINNED_SDK_VERSION}: pip install fireworks-ai=={PINNED_SDK_VERSION}",
            )
        )
    if not (settings.fireworks_training_shape or settings.fireworks_trainer_job):
        checks.append((False, "neither fireworks_training_shape nor fireworks_trainer_job is set: set one"))
    if not key:
        return checks
    try:
        accounts = asyncio.run(probe(settings.model_copy(update={"probe_timeout_s": timeout_s}), key))
    except ServiceProbeFailed as e:
        checks.append((False, str(e)))
        return checks
    checks.append(
        (True, f"{settings.fireworks_base_url} reachable; key belongs to {', '.join(accounts) or '?'}")
    )
    if settings.fireworks_account_id and accounts and settings.fireworks_account_id not in accounts:
        checks.append(
            (
                False,
                f"FIREWORKS_ACCOUNT_ID {settings.fireworks_account_id} is not the key's account {accounts}",
            )
        )
    return checks
