"""Talking to the Tinker service outside the SDK: the start-up probe and releasing training clients.

Invariants:
- `probe` runs before the SDK's `ServiceClient` exists (whose connection retries took 6.5 minutes
  to give up on an unreachable server): the key is checked with the SDK's own first call
  (`client/config`), the model with `get_server_capabilities`; see `clawbridge.probe`.
- Every training client (a LoRA slot on the server) this state dir creates is recorded in
  `<state_dir>/tinker/training_clients.json` (replaced atomically) BEFORE it is used, and removed
  only after the server confirmed `unload_model`. So a run killed with clients loaded leaves their
  ids behind, and the next start-up releases them (`release_recorded`) before creating its own:
  restarts never accumulate slots.
- Releasing never raises: a server without `unload_model` (404) or one that is gone is logged and
  the id is dropped (404: the server cannot release it) or kept for the next start (anything else).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from clawbridge.probe import ServiceProbe, ServiceProbeFailed

from .sdk import tinker

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://tinker.thinkingmachines.dev/services/tinker-prod"
"""The SDK's production URL (`tinker.lib.base_url.DEFAULT_BASE_URL`), used when neither
`[backends.tinker] base_url` nor TINKER_BASE_URL is set."""


def resolve_base_url(base_url: str | None) -> str:
    """The URL the SDK will use: the setting, else $TINKER_BASE_URL, else production."""
    return (base_url or os.environ.get("TINKER_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"X-API-Key": api_key} if api_key else {}


@dataclass(frozen=True)
class Probed:
    """What the probe learned."""

    offered: tuple[str, ...]
    """Base models the server offers."""
    context_length: int | None
    """`base_model`'s context length (None: not checked, or not reported)."""


async def probe(base_url: str | None, api_key: str | None, base_model: str | None, timeout_s: float) -> Probed:
    """Check that Tinker answers, takes the key and (unless None) offers `base_model`. Raises
    `ServiceProbeFailed`."""
    url = resolve_base_url(base_url)
    p = ServiceProbe(
        "tinker", url, _headers(api_key), timeout_s,
        url_fix="check [backends.tinker] base_url (CLAWBRIDGE_TINKER_BASE_URL) or TINKER_BASE_URL, and the network",
        key_fix="set TINKER_API_KEY to a key from the Tinker console (it starts with tml-)",
    )
    if not api_key:
        raise ServiceProbeFailed("tinker", "bad key", "no API key is set", p.key_fix)
    resp = await p.call("POST", "/api/v1/client/config", {"sdk_version": getattr(tinker, "__version__", "")})
    if resp.status_code >= 400:
        raise p.unexpected(resp, "reading the client config")
    resp = await p.call("GET", "/api/v1/get_server_capabilities")
    if resp.status_code != 200:
        raise p.unexpected(resp, "reading the server's capabilities")
    models = resp.json().get("supported_models") or []
    names = tuple(str(m["model_name"]) for m in models if m.get("model_name"))
    if base_model is None:
        return Probed(names, None)
    for m in models:
        if m.get("model_name") == base_model:
            return Probed(names, int(m["max_context_length"]) if m.get("max_context_length") else None)
    raise ServiceProbeFailed(
        "tinker", "model unknown", f"{url} does not offer base model {base_model!r}",
        f"set [backends.tinker] base_model (or --model) to one of: {', '.join(names) or '(none offered)'}",
    )


class ClientLedger:
    """The training-client ids this state dir created and has not yet released (a JSON list)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "tinker" / "training_clients.json"

    def ids(self) -> list[str]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except ValueError:
            log.warning("tinker: %s is not valid JSON; starting a new list", self.path)
            return []
        return [str(x) for x in raw.get("training_clients", [])]

    def add(self, model_id: str) -> None:
        ids = self.ids()
        if model_id not in ids:
            self._write([*ids, model_id])

    def remove(self, model_id: str) -> None:
        self._write([i for i in self.ids() if i != model_id])

    def _write(self, ids: list[str]) -> None:
        if not ids:
            self.path.unlink(missing_ok=True)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".training_clients.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"training_clients": ids}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


async def unload_model(base_url: str | None, api_key: str | None, model_id: str, timeout_s: float) -> bool | None:
    """Ask Tinker to release the training client `model_id` (`POST /api/v1/unload_model`, a
    future polled through `retrieve_future`), all within `timeout_s`. True: released; None: the
    server has no such operation or no such model (404: nothing more can be done); False: it did
    not answer in time or failed (try again later). Never raises."""
    url = resolve_base_url(base_url)
    headers = _headers(api_key)
    deadline = time.monotonic() + timeout_s
    try:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s) as client:
            resp = await client.post("/api/v1/unload_model", json={"model_id": model_id, "type": "unload_model"})
            if resp.status_code == 404:
                log.info("tinker: %s has no unload_model for %s (HTTP 404); its slot is freed when the "
                         "server ends the session", url, model_id)
                return None
            resp.raise_for_status()
            body = resp.json()
            request_id = body.get("request_id")
            while request_id is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                resp = await client.post("/api/v1/retrieve_future", json={"request_id": request_id}, timeout=left)
                if resp.status_code == 408:  # the server's long poll ran out: ask again
                    continue
                resp.raise_for_status()
                body = resp.json()
                if body.get("type") != "try_again":
                    break
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            if body.get("error"):
                if "not found" in str(body["error"]).lower() or "unknown" in str(body["error"]).lower():
                    return None
                raise RuntimeError(str(body["error"]))
        return True
    except Exception as e:  # releasing is best effort; the id stays recorded for the next start
        why = f"no answer within {timeout_s:g} s" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
        log.warning("tinker: releasing training client %s failed (%s); will retry at the next start", model_id, why)
        return False


async def release(ledger: ClientLedger, base_url: str | None, api_key: str | None, model_id: str,
                  timeout_s: float) -> None:
    """Unload `model_id` and forget it unless the server may still hold it."""
    outcome = await unload_model(base_url, api_key, model_id, timeout_s)
    if outcome is not False:
        ledger.remove(model_id)
        if outcome:
            log.info("tinker: released training client %s", model_id)


async def release_recorded(ledger: ClientLedger, base_url: str | None, api_key: str | None, timeout_s: float) -> int:
    """Release the training clients an earlier run of this state dir left loaded; how many were."""
    ids = ledger.ids()
    if ids:
        log.warning("tinker: %d training client(s) left loaded by an earlier run (killed?): releasing %s",
                    len(ids), ", ".join(ids))
    for model_id in ids:
        await release(ledger, base_url, api_key, model_id, timeout_s)
    return len(ids)
