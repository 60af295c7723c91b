"""Deleting one thing the Tinker backend keeps on the service (`clawbridge.backend.RemoteObject`).

Kinds: `state` (a `save_state` path, `tinker://RUN/weights/NAME`), `sampler` (sampler weights,
`tinker://RUN/sampler_weights/NAME`) and `training_client` (a training client's model id).

Invariants:
- An object the service no longer has counts as deleted: HTTP 404 on a checkpoint, "not found" or
  404 on `unload_model`. Anything else raises, and the caller keeps the deletion owed
  (`clawbridge.trainer.deletions`).
- Sampler weights named the way SkyRL's server names them (`tinker://RUN/NAME`, which the SDK's
  `delete_checkpoint_from_tinker_path` refuses as "Invalid tinker path" before sending anything)
  are deleted by their training run and name (`RestClient.delete_checkpoint(RUN,
  "sampler_weights/NAME")`): we know they are sampler weights because `save_weights_for_sampler`
  returned them. A path the SDK refuses and that is not of that form is not guessed at: it raises.
- One try is bounded by `DELETE_TIMEOUT_S` (and `publish_timeout_s`, when lower): the SDK retries
  an unreachable service for minutes, and a deletion that times out stays owed anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from clawbridge.backend import RemoteObject

from .errors import TinkerRequestFailed
from .sdk import APIStatusError, ParsedCheckpointTinkerPath, RestClient
from .service import unload_model
from .settings import TinkerSettings

DELETE_TIMEOUT_S = 60.0
"""The longest one try at deleting one object takes before it is left owed."""

Retry = Callable[[str, Callable[[], Awaitable[Any]], float], Awaitable[Any]]
"""`TinkerBackend._retry`: (what, call, timeout_s) with the backend's retry policy."""


def short_sampler_path(path: str) -> tuple[str, str] | None:
    """(run, name) of sampler weights named `tinker://RUN/NAME`; None for any other form."""
    if not path.startswith("tinker://"):
        return None
    parts = path.removeprefix("tinker://").split("/")
    return (parts[0], parts[1]) if len(parts) == 2 and all(parts) else None


class RemoteDeleter:
    """Deletes `RemoteObject`s of one Tinker account (module invariants)."""

    def __init__(self, opts: TinkerSettings, retry: Retry, probe_timeout_s: float) -> None:
        self.opts = opts
        self._retry = retry
        self._probe_timeout_s = probe_timeout_s
        self._rest: RestClient | None = None

    @property
    def timeout_s(self) -> float:
        return min(DELETE_TIMEOUT_S, self.opts.publish_timeout_s)

    async def delete(self, obj: RemoteObject) -> None:
        """Delete `obj` on the service (gone counts as deleted); raises when it is not deleted."""
        if obj.kind == "training_client":
            outcome = await unload_model(self.opts.base_url or None, self.opts.api_key_value(), obj.path,
                                         min(self._probe_timeout_s, self.timeout_s))
            if outcome is False:
                raise RuntimeError(f"the service did not release training client {obj.path} (see the log)")
            return
        call = self._delete_call(await self.rest(), obj)
        try:
            await self._retry(f"delete {obj.kind} {obj.path}", call, self.timeout_s)
        except APIStatusError as e:
            if e.status_code != 404:
                raise
        except TinkerRequestFailed as e:
            if "not found" not in str(e).lower():
                raise

    @staticmethod
    def _delete_call(rest: RestClient, obj: RemoteObject) -> Callable[[], Awaitable[Any]]:
        try:
            ParsedCheckpointTinkerPath.from_tinker_path(obj.path)
        except ValueError:  # the SDK refuses it (SkyRL's sampler path); see the module invariants
            short = short_sampler_path(obj.path) if obj.kind == "sampler" else None
            if short is None:
                raise
            run, name = short
            return lambda: rest.delete_checkpoint(run, f"sampler_weights/{name}").result_async()
        return lambda: rest.delete_checkpoint_from_tinker_path(obj.path).result_async()

    async def rest(self) -> RestClient:
        """The REST client (created on first use, in a worker thread: its constructor does I/O)."""
        if self._rest is None:
            self._rest = await asyncio.to_thread(
                RestClient, base_url=self.opts.base_url or None, api_key=self.opts.api_key_value()
            )
        return self._rest
