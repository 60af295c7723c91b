"""Committed versions the Tinker backend serves besides the one it publishes: `NAME@N`, promotion's
candidates, and every user lane's own version (`clawbridge.serving.versions.VersionedServing`).

Invariants:
- A user lane's published version is served through the lane's own live sampling client, handed
  over at each publish and restore (`serve_live`): while the lane runs, its version is never
  loaded again from saved weights, which may belong to a training client released since (SkyRL's
  server ends sampler weights with the training client that saved them).
- Any other version is loaded from the sampler weights saved with its checkpoint, once a one-token
  probe sample (`PROBE_PROMPT`) shows that they answer. Sampler weights that do not (refused, or
  failing the probe with anything but a transient error) are remembered as dead, and the version
  is loaded from its checkpoint's training state instead: a training client of its own
  (`create_training_client_from_state`, recorded in the client ledger), kept while the version
  stays loaded and released when it leaves the cache, when its user is forgotten, or at close.
- Versions are kept in a `LoadedVersions` cache of `max_loaded`; one whose sampler fails a call is
  dropped from it (its training client released), so the next call loads it again.
- A version neither way can load is `VersionUnavailable`, naming both reasons; a service that does
  not answer (timeouts, 5xx) is `SamplerUnavailable` (502), never a dead path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from clawbridge.serving.sampler import Sampler, SamplerUnavailable, SamplingParams
from clawbridge.serving.versions import LoadedVersions, VersionUnavailable

from .errors import TinkerRequestFailed, TinkerTransientError
from .manifest import CheckpointEntry
from .sampler import TinkerSampler
from .sdk import APIStatusError, RetryConfig, ServiceClient, TrainingClient

log = logging.getLogger(__name__)

PROBE_PROMPT = (0,)
"""What the probe of saved sampler weights samples one token after (id 0 exists in every vocabulary)."""
PROBE_PARAMS = SamplingParams(max_tokens=1)


class VersionHost(Protocol):
    """What serving versions needs of the (parent) `TinkerBackend`."""

    manifest_file: Path

    def require_service(self) -> ServiceClient: ...

    def find_checkpoint(self, checkpoint: str) -> CheckpointEntry | None:
        """`checkpoint`'s manifest entry, in this backend's manifest or a user lane's."""
        ...

    def new_sampler(self, client: Any, version: int) -> TinkerSampler:
        """A sampler serving `version` from sampling `client`."""
        ...

    def retry_config(self) -> RetryConfig: ...

    async def retry(self, what: str, call: Any, timeout_s: float) -> Any: ...

    def record_client(self, tc: TrainingClient) -> TrainingClient: ...

    async def release_client(self, tc: TrainingClient) -> None: ...

    @property
    def load_timeout_s(self) -> float: ...


class ServedVersions:
    """The sampling clients of committed versions besides the published one (module invariants)."""

    def __init__(self, host: VersionHost, max_loaded: int) -> None:
        self.host = host
        self.cache = LoadedVersions(max_loaded, self._load, self._evicted)
        self.live: dict[str, TinkerSampler] = {}
        """Each running user lane's published version, on the lane's own sampling client."""
        self.dead_paths: set[str] = set()
        """Sampler weights that did not answer: their versions load from their training state."""
        self._clients: dict[int, TrainingClient] = {}
        """Versions loaded from their training state: the training client each holds."""
        self._releasing: set[asyncio.Task[None]] = set()

    async def get(self, version: int, checkpoint: str) -> Sampler:
        return await self.cache.get(version, checkpoint)

    async def serve_live(self, lane: str, sampler: TinkerSampler) -> None:
        """`lane` published (or restored) `sampler.policy_version` on its own sampling client."""
        self.live[lane] = sampler
        await self.cache.put(sampler.policy_version, sampler)
        await self._evicted(sampler.policy_version)  # a training client loaded for it is not needed now

    def drop_live(self, lane: str) -> None:
        """`lane` stopped (its training client is released): its version loads like any other."""
        self.live.pop(lane, None)

    async def discard(self, versions: Sequence[int]) -> None:
        """Stop serving `versions` (a forgotten user's) and release training clients loaded for them."""
        await self.cache.discard(versions)
        for version in versions:
            tc = self._clients.pop(version, None)
            if tc is not None:
                task = asyncio.get_running_loop().create_task(self.host.release_client(tc))
                self._releasing.add(task)
                task.add_done_callback(self._releasing.discard)

    async def close(self) -> None:
        """Release every training client loaded for a version (never raises)."""
        self.cache.clear()
        clients, self._clients = list(self._clients.values()), {}
        for tc in clients:
            await self.host.release_client(tc)
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)

    # ---- loading

    async def _load(self, version: int, checkpoint: str) -> Sampler:
        for live in self.live.values():
            if live.policy_version == version:
                return live
        entry = self.host.find_checkpoint(checkpoint)
        if entry is None:
            raise VersionUnavailable(f"policy version {version}'s checkpoint {checkpoint} is in no Tinker manifest "
                                     f"under {self.host.manifest_file.parent.parent}", only_published=False)
        why = "no sampler weights were saved with it"
        path = entry.sampler_path
        if path is not None and path not in self.dead_paths:
            sampler, why = await self._from_sampler_weights(version, path)
            if sampler is not None:
                log.info("tinker: serving policy version %d from %s beside the published one", version, path)
                return sampler
            self.dead_paths.add(path)
            log.warning("tinker: policy version %d: %s; loading it from its training state", version, why)
        return await self._from_state(version, entry, why)

    async def _from_sampler_weights(self, version: int, path: str) -> tuple[TinkerSampler | None, str]:
        service, host = self.host.require_service(), self.host
        try:
            client = await host.retry(
                f"sampling client for version {version}",
                lambda: service.create_sampling_client(model_path=path, retry_config=host.retry_config()).result_async(),
                host.load_timeout_s,
            )
        except (TinkerRequestFailed, APIStatusError) as e:
            if isinstance(e, APIStatusError) and not 400 <= e.status_code < 500:
                raise SamplerUnavailable(f"Tinker could not load policy version {version}: {e}") from e
            return None, f"the service refused its sampler weights {path} ({e})"
        except TinkerTransientError as e:
            raise SamplerUnavailable(f"Tinker could not load policy version {version}: {e}") from e
        sampler = host.new_sampler(client, version)
        try:
            stream = await sampler.sample(PROBE_PROMPT, PROBE_PARAMS)
            [_ async for _ in stream]
        except SamplerUnavailable as e:
            if isinstance(e.__cause__, TinkerTransientError):
                raise
            return None, f"its sampler weights {path} do not answer ({e})"
        return sampler, ""

    async def _from_state(self, version: int, entry: CheckpointEntry, why: str) -> TinkerSampler:
        service, host = self.host.require_service(), self.host

        def unavailable(e: Exception) -> Exception:
            if isinstance(e, TinkerTransientError) or (isinstance(e, APIStatusError) and not 400 <= e.status_code < 500):
                return SamplerUnavailable(f"Tinker could not load policy version {version}: {e}")
            return VersionUnavailable(f"Tinker cannot serve policy version {version}: {why}, and loading its "
                                      f"training state {entry.path} failed ({e})", only_published=False)

        try:
            tc = host.record_client(await host.retry(
                f"training client for version {version}",
                lambda: service.create_training_client_from_state(entry.path).result_async(),
                host.load_timeout_s,
            ))
        except (TinkerRequestFailed, TinkerTransientError, APIStatusError) as e:
            raise unavailable(e) from e
        try:
            client = await host.retry(
                f"sampling client for version {version}",
                lambda: tc.save_weights_and_get_sampling_client(retry_config=host.retry_config()).result_async(),
                host.load_timeout_s,
            )
        except BaseException as e:
            await host.release_client(tc)
            if isinstance(e, TinkerRequestFailed | TinkerTransientError | APIStatusError):
                raise unavailable(e) from e
            raise
        self._clients[version] = tc
        log.info("tinker: serving policy version %d from its training state %s", version, entry.path)
        return host.new_sampler(client, version)

    async def _evicted(self, version: int) -> None:
        tc = self._clients.pop(version, None)
        if tc is not None:
            await self.host.release_client(tc)
