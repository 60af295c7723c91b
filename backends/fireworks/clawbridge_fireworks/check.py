"""The Fireworks start-up probe: reachable, key accepted, base model offered, named resources exist.

Invariants:
- Runs before any SDK manager exists and before anything is planned or created (the SDK's own
  retries took 2-3 minutes to report an unreachable control plane); read-only GETs on the
  control plane, each bounded by `probe_timeout_s`, none retried (see `clawbridge.probe`).
- A deployment or trainer job the user NAMED must exist; ones clawbridge created (manifest) may be
  gone, and `provision.make_plan` decides what to do about them.
"""

from __future__ import annotations

from clawbridge.config import Settings
from clawbridge.probe import ServiceProbe, ServiceProbeFailed

from .settings import NAME, fireworks_settings


def _short(resource: str) -> str:
    return resource.rsplit("/", 1)[-1]


async def probe(settings: Settings, api_key: str) -> list[str]:
    """Check the control plane with `api_key`; return the accounts the key belongs to. Raises
    `ServiceProbeFailed` saying what is wrong."""
    s, o = settings, fireworks_settings(settings)
    p = ServiceProbe(
        "fireworks", o.base_url, {"Authorization": f"Bearer {api_key}", "X-Api-Key": api_key},
        s.probe_timeout_s,
        url_fix=f"check [backends.{NAME}] base_url (CLAWBRIDGE_FIREWORKS_BASE_URL) and the network",
        key_fix="set FIREWORKS_API_KEY to a key from https://fireworks.ai/account/api-keys",
    )
    resp = await p.call("GET", "/v1/accounts?pageSize=2")
    if resp.status_code != 200:
        raise p.unexpected(resp, "listing the key's accounts")
    accounts = [str(a.get("name", "")).removeprefix("accounts/") for a in resp.json().get("accounts") or []]
    account = o.account_id or (accounts[0] if accounts else "")

    model = s.model
    if model.startswith("accounts/") and "/models/" in model:
        resp = await p.call("GET", f"/v1/{model}", auth_checked=False)
        if resp.status_code in (403, 404):
            raise ServiceProbeFailed(
                "fireworks", "model unknown", f"{o.base_url} does not offer base model {model!r} "
                f"(HTTP {resp.status_code})", "set --model to a Fireworks base model, e.g. "
                "accounts/fireworks/models/qwen3-8b",
            )
        if resp.status_code != 200:
            raise p.unexpected(resp, f"looking up model {model}")

    named = (("deployment", "deployments", o.deployment, "deployment"),
             ("trainer job", "rlorTrainerJobs", o.trainer_job, "trainer_job"))
    for what, collection, name, setting in named:
        if not name or not account:
            continue
        resp = await p.call("GET", f"/v1/accounts/{account}/{collection}/{_short(name)}", auth_checked=False)
        if resp.status_code == 404:
            raise ServiceProbeFailed(
                "fireworks", "model unknown", f"{what} {name} does not exist in account {account}",
                f"fix [backends.{NAME}] {setting} (CLAWBRIDGE_FIREWORKS_{setting.upper()}) or unset it to let clawbridge create one",
            )
        if resp.status_code != 200:
            raise p.unexpected(resp, f"looking up {what} {name}")
    return accounts
