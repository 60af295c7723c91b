"""`clawbridge doctor` checks for the Tinker backend: one line each, saying what to fix.

Invariants:
- Never prints or logs the key; only whether it is there and well formed.
- The reachability check runs only with a key and is bounded by `timeout_s`.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from clawbridge.config import Settings

from .sdk import PINNED_VERSION, tinker


def fetch_capabilities(base_url: str | None, api_key: str | None, timeout_s: float = 20.0) -> Any:
    """Blocking: the server's `GetServerCapabilitiesResponse` (run it off the event loop)."""
    rest = tinker.RestClient(base_url=base_url, api_key=api_key)
    return rest.get_server_capabilities().result(timeout=timeout_s)


def doctor_checks(settings: Settings, timeout_s: float = 20.0) -> list[tuple[bool, str]]:
    """(ok, one-line message) for the key, the SDK version, the model settings and reachability."""
    checks: list[tuple[bool, str]] = []
    key = settings.tinker_api_key.get_secret_value() if settings.tinker_api_key else ""
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

    base_model = settings.tinker_base_model or settings.model
    if not base_model:
        checks.append((False, "no base model: set --tinker-base-model (or --model), e.g. Qwen/Qwen3-8B"))
    if not settings.tokenizer_source:
        checks.append(
            (False, "no tokenizer: set --tokenizer to a local folder or id with the base model's tokenizer")
        )

    url = settings.tinker_base_url or "Tinker's default API URL"
    if not key:
        checks.append((False, f"did not try to reach {url}: no key"))
        return checks
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        caps = pool.submit(fetch_capabilities, settings.tinker_base_url or None, key, timeout_s).result(
            timeout_s + 5
        )
    except Exception as e:
        checks.append((False, f"cannot reach {url}: {type(e).__name__}: {e}"))
        return checks
    finally:
        pool.shutdown(wait=False)
    names = [m.model_name for m in caps.supported_models if m.model_name]
    checks.append((True, f"reached {url} ({len(names)} models offered)"))
    if base_model and names and base_model not in names:
        checks.append((False, f"Tinker does not offer {base_model!r}; choose one of: {', '.join(names)}"))
    return checks
