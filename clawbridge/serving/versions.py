"""Which policy version answers a request: `NAME@N`, the serving version, or a canary's candidate.

`VersionRouter` is the one place that picks the `Sampler` for a model call; every API shape gets
it through the proxy's shared sample-and-record path (`clawbridge.proxy.call`). A backend that can
serve a committed version other than the one it publishes implements `VersionedServing`.

Invariants:
- `model: "NAME@N"` (NAME the served model id or `default`, N a committed policy version) is
  answered by version N, whatever serves plain requests. N is servable when it is the version the
  backend publishes now (no checkpoint read), or when it is committed in the store with a
  checkpoint that retention kept (`VersionRow.restorable`) and the backend is `VersionedServing`.
  Anything else is `VersionNotFound` (the proxy's 404 `model_not_found`), naming the versions kept.
- Plain requests get the serving version: the one set by `set_serving(N)` (promotion), or, while
  none is set, the version the backend publishes (`backend.sampler()`), so with promotion off
  every publish serves at once, as before.
- A candidate (`set_candidate(N, share)`) answers only sessions first seen while it is the
  candidate, about `share` of them (a hash of version and session id), and such a session stays
  on it (sticky) until the candidate changes; every other session gets the serving version. The
  router remembers the newest `MAX_REMEMBERED_SESSIONS` sessions; an older one seen again counts
  as new.
- A stream's version is fixed when the stream starts (`Sampler` invariant), so a turn is always
  recorded with the version that sampled it, whichever route chose it.
- Per-user adapters (`clawbridge.trainer.lanes`): a plain call of a user whose lane has a trained
  version gets that version (reason 'user'); every other plain call is routed as above.
- Lanes never cross: whoever asks for a version (`sampler_for`) says who it is (a `Principal`)
  and what for (`pin`, `serve`, `evaluate`), and `clawbridge.access`'s table decides. `NAME@N`
  naming a version of a user's lane answers only that user's calls: for any other key it is
  `VersionNotFound`, worded as for a version that does not exist (the admin is told why:
  `access.Denied`). The serving version and the canary's candidate are the shared policy's.
- The router reads the store only off the event loop (`asyncio.to_thread`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from clawbridge.access import OPERATOR, Hidden, Principal, Target, check
from clawbridge.backend import FakeServingBackend, ModelInfo
from clawbridge.serving.sampler import (
    FakeSampler,
    Sampler,
    SamplerUnavailable,
    SampleStream,
    SamplingParams,
    SequenceScorer,
)

if TYPE_CHECKING:
    from clawbridge.store.versions import VersionRow

log = logging.getLogger(__name__)

MAX_REMEMBERED_SESSIONS = 65536
"""Sessions whose canary assignment the router remembers (oldest forgotten first)."""

_VERSIONED = re.compile(r"^(?P<name>.+)@(?P<version>\d{1,12})$")


@runtime_checkable
class VersionedServing(Protocol):
    """A backend that can serve committed versions besides the one it publishes (optional
    capability; check with `isinstance(backend, VersionedServing)`)."""

    async def load_version(self, version: int, checkpoint: str) -> Sampler:
        """A sampler pinned to committed `version` (its streams report `version`), loaded on demand
        from `checkpoint` (what `save_checkpoint` returned for it, as the store recorded it) and
        kept in a bounded LRU; loading a version already kept returns it without reading the
        checkpoint again. Raises `VersionUnavailable` when this backend cannot serve it."""
        ...


VersionUse = Literal["pin", "serve", "evaluate"]
"""Why a version is asked for: a model call naming it, serving it to plain calls, evaluating it."""


class VersionLookup(Protocol):
    """What the router reads of the store's versions (`clawbridge.store.versions.VersionStore`)."""

    def find(self, version: int) -> VersionRow | None:
        """The version in whichever lane it is (`VersionRow.lane` says which)."""
        ...

    def listing(self, limit: int = 50, committed_only: bool = True) -> list[VersionRow]: ...


class LaneRoutes(Protocol):
    """Which version a user's plain calls get (`clawbridge.trainer.lanes.UserLanes`)."""

    def own_version(self, user: str | None) -> tuple[int, str] | None:
        """(version, checkpoint) of the caller's own committed adapter, or None."""
        ...


class VersionNotFound(LookupError):
    """A `NAME@N` the router cannot serve; `kept` lists the versions it can."""

    def __init__(self, message: str, kept: Sequence[int]) -> None:
        super().__init__(message)
        self.kept = list(kept)


class VersionUnavailable(RuntimeError):
    """Raised by a `VersionedServing` backend for a version it cannot serve; the router answers
    `VersionNotFound`. `only_published`: this backend (or engine) serves no version but the published
    one (e.g. one set of full weights per server); False: only this version's checkpoint cannot be
    loaded (missing, damaged), and the other kept versions still can."""

    def __init__(self, message: str, only_published: bool = True) -> None:
        super().__init__(message)
        self.only_published = only_published


def parse_versioned(model: str, names: Sequence[str]) -> int | None:
    """N when `model` is `NAME@N` with NAME one of `names`; None when it is not of that form."""
    m = _VERSIONED.match(model)
    if m is None or m.group("name") not in names:
        return None
    return int(m.group("version"))


@dataclass(frozen=True)
class Route:
    """Where one request goes."""

    sampler: Sampler
    version: int | None
    """The version asked for (`NAME@N`, the serving version once set, or the candidate); None: the
    backend's published one, whichever it is when the stream starts."""
    reason: str
    """'pinned' (NAME@N), 'serving', 'canary' or 'user' (the caller's own adapter)."""


@dataclass
class _Assignment:
    candidate: int | None
    canary: bool


class PublishingBackend(Protocol):
    """What the router needs of any backend: its name and the sampler of the version it publishes."""

    name: str

    def sampler(self) -> Sampler: ...


@dataclass
class VersionRouter:
    """Picks the sampler of each request (module invariants)."""

    backend: PublishingBackend
    versions: VersionLookup
    model_names: tuple[str, ...] = ("default",)
    """Names `NAME@N` accepts: the served model id and `default`."""
    lanes: LaneRoutes | None = None
    """Per-user adapters (None: off): the version each user's plain calls get."""
    _serving: int | None = None
    _candidate: int | None = None
    _share: float = 0.0
    _sessions: OrderedDict[str, _Assignment] = field(default_factory=OrderedDict)

    # ------------------------------------------------------------------ state set by promotion
    @property
    def published_version(self) -> int:
        """The version the backend publishes now (its `sampler()`)."""
        return self.backend.sampler().policy_version

    @property
    def serving_version(self) -> int:
        """The version plain requests get."""
        return self.published_version if self._serving is None else self._serving

    @property
    def candidate_version(self) -> int | None:
        return self._candidate

    @property
    def canary_share(self) -> float:
        return self._share

    def set_serving(self, version: int | None) -> None:
        """Serve `version` to plain requests (None: whatever the backend publishes)."""
        self._serving = version

    def set_candidate(self, version: int | None, share: float = 0.0) -> None:
        """Let `version` answer about `share` of the sessions first seen from now on (None: no
        candidate; every session gets the serving version)."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"canary share must be in [0, 1], got {share}")
        self._candidate = version
        self._share = share if version is not None else 0.0

    # ------------------------------------------------------------------ routing
    def is_canary(self, session_id: str) -> bool:
        """Whether `session_id` is answered by the candidate (and remember it: sticky)."""
        seen = self._sessions.get(session_id)
        if seen is not None:
            self._sessions.move_to_end(session_id)
            return seen.canary and seen.candidate == self._candidate and self._candidate is not None
        canary = self._candidate is not None and _bucket(self._candidate, session_id) < self._share
        self._sessions[session_id] = _Assignment(self._candidate, canary)
        while len(self._sessions) > MAX_REMEMBERED_SESSIONS:
            self._sessions.popitem(last=False)
        return canary

    async def route(self, model: str, session_id: str | None, by: Principal) -> Route:
        """The sampler for a request of `by` naming `model` in `session_id`; raises `VersionNotFound`
        (or `access.Denied`: the admin naming a user's version)."""
        pinned = parse_versioned(model, self.model_names)
        if pinned is not None:
            return Route(await self.sampler_for(pinned, by, "pin"), pinned, "pinned")
        own = self.lanes.own_version(by.owner) if self.lanes is not None else None
        if own is not None:
            return Route(await self._own_sampler(*own), own[0], "user")
        if session_id is not None and self.is_canary(session_id):
            assert self._candidate is not None
            return Route(await self.sampler_for(self._candidate, OPERATOR, "serve"), self._candidate, "canary")
        if self._serving is None:
            return Route(self.backend.sampler(), None, "serving")
        return Route(await self.sampler_for(self._serving, OPERATOR, "serve"), self._serving, "serving")

    async def sampler_for(self, version: int, by: Principal, use: VersionUse) -> Sampler:
        """A sampler of committed `version`, for `by` to `use` (module invariants); raises
        `VersionNotFound`, or `access.Denied` (the admin told why it may not)."""
        current = self.backend.sampler()
        if version == current.policy_version:
            return current  # the shared policy's: what the backend publishes (a lane publishes its own)
        row = await asyncio.to_thread(self.versions.find, version)
        if row is not None:
            try:
                check(by, "versions", use, Target(row.lane or None, version=version))
            except Hidden:
                row = None
        if row is None or row.status != "committed":
            raise VersionNotFound(f"policy version {version} does not exist", await self.kept_versions())
        if not row.restorable:
            raise VersionNotFound(f"the checkpoint of policy version {version} was pruned by retention",
                                  await self.kept_versions())
        if not isinstance(self.backend, VersionedServing):
            raise VersionNotFound(f"backend {self.backend.name} serves only the version it published last "
                                  f"({current.policy_version})", [current.policy_version])
        assert row.checkpoint is not None
        try:
            return await self.backend.load_version(version, row.checkpoint)
        except VersionUnavailable as exc:
            kept = [current.policy_version] if exc.only_published else await self.kept_versions()
            raise VersionNotFound(str(exc), [v for v in kept if v != version]) from None

    async def _own_sampler(self, version: int, checkpoint: str) -> Sampler:
        """The caller's own committed version, known with its checkpoint: loaded (or taken from
        the backend's cache) without reading the store on the call's path."""
        if not isinstance(self.backend, VersionedServing):
            if version == self.published_version:
                return self.backend.sampler()
            raise VersionNotFound(f"backend {self.backend.name} serves only the version it published last "
                                  f"({self.published_version})", [self.published_version])
        try:
            return await self.backend.load_version(version, checkpoint)
        except VersionUnavailable as exc:
            raise VersionNotFound(str(exc), [self.published_version]) from None

    async def kept_versions(self) -> list[int]:
        """The versions `NAME@N` can name now, oldest first."""
        rows = await asyncio.to_thread(self.versions.listing, 10_000)
        kept = {r.version for r in rows if r.restorable} if isinstance(self.backend, VersionedServing) else set()
        kept.add(self.published_version)
        return sorted(kept)


def _bucket(candidate: int, session_id: str) -> float:
    """A stable number in [0, 1) for this candidate and session (the same in every process)."""
    digest = hashlib.blake2b(f"{candidate}:{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


# --------------------------------------------------------------------------------------------
# A bounded cache of loaded versions that backends share.


class LoadedVersions:
    """The samplers of the newest-used `max_loaded` versions, each loaded once by `loader`
    (concurrent asks for one version share one load). Dropping a sampler from the cache only stops
    new requests from getting it; streams already running keep what they hold. A kept sampler that
    cannot serve a call (`SamplerUnavailable`) is dropped at once (like an eviction), so the next
    call loads its version again instead of failing on it for good.

    The one record of which versions are kept loaded beside the published one: a version leaves it
    only through `on_evict` (the LRU, `discard`), and an engine that holds adapters on a server asks
    it (`holds`) before unloading one (`clawbridge_local.sglang_engine.SGLangEngine`)."""

    def __init__(self, max_loaded: int, loader: Callable[[int, str], Awaitable[Sampler]],
                 on_evict: Callable[[int], Awaitable[None]] | None = None) -> None:
        if max_loaded < 1:
            raise ValueError("max_loaded must be >= 1")
        self.max_loaded = max_loaded
        self._loader = loader
        self._on_evict = on_evict
        """Called with each version dropped from the cache (e.g. to unload a server-side adapter)."""
        self._loaded: OrderedDict[int, Sampler] = OrderedDict()
        self._loading: dict[int, asyncio.Task[Sampler]] = {}
        self.loads = 0
        """Versions loaded so far (a reload after eviction counts again)."""

    @property
    def versions(self) -> list[int]:
        """Versions kept now, least recently used first."""
        return list(self._loaded)

    def holds(self, version: int) -> bool:
        """Whether `version` is kept, or being loaded to be kept."""
        return version in self._loaded or version in self._loading

    async def get(self, version: int, checkpoint: str) -> Sampler:
        """The sampler of `version`, loading it from `checkpoint` unless it is kept."""
        return await self._get(version, lambda: self._loader(version, checkpoint))

    async def adopt(self, version: int, load: Callable[[], Awaitable[Sampler]]) -> Sampler:
        """Keep `version`, loaded by `load` (a user lane's fresh publish, whose weights are in
        memory, not in a checkpoint) unless it is kept already; evicts past `max_loaded` as `get`."""
        return await self._get(version, load)

    async def _get(self, version: int, load: Callable[[], Awaitable[Sampler]]) -> Sampler:
        if version in self._loaded:
            self._loaded.move_to_end(version)
            return self._loaded[version]
        task = self._loading.get(version)
        if task is None:
            task = asyncio.ensure_future(self._load(version, load))
            self._loading[version] = task
            task.add_done_callback(lambda _: self._loading.pop(version, None))
        return await asyncio.shield(task)  # a caller that goes away does not cancel the others' load

    async def _load(self, version: int, load: Callable[[], Awaitable[Sampler]]) -> Sampler:
        sampler = await load()
        self.loads += 1
        return await self._keep(version, sampler)

    async def put(self, version: int, sampler: Sampler) -> None:
        """Keep `sampler` as `version`'s, replacing one kept (a hosted lane's fresh publish on its own
        live client), evicting the least recently used past `max_loaded`."""
        await self._keep(version, sampler)

    async def _keep(self, version: int, sampler: Sampler) -> Sampler:
        kept = (_KeptScorer(self, version, sampler) if isinstance(sampler, SequenceScorer)
                else _Kept(self, version, sampler))
        self._loaded[version] = kept
        self._loaded.move_to_end(version)
        await self._evict(lambda: len(self._loaded) > self.max_loaded)
        return kept

    async def _failed(self, version: int, kept: _Kept) -> None:
        """`kept` could not serve a call: drop it unless another sampler replaced it meanwhile."""
        if self._loaded.get(version) is not kept:
            return
        del self._loaded[version]
        log.warning("policy version %d failed a call: dropped from the loaded versions, loaded again at the next "
                    "call", version)
        if self._on_evict is not None:
            await self._on_evict(version)

    async def _evict(self, more: Callable[[], bool]) -> None:
        while more():
            dropped, _ = self._loaded.popitem(last=False)
            if self._on_evict is not None:
                await self._on_evict(dropped)

    def peek(self, version: int) -> Sampler | None:
        """`version`'s sampler if it is kept now (not counted as a use); None otherwise."""
        return self._loaded.get(version)

    async def discard(self, versions: Sequence[int]) -> None:
        """Stop keeping `versions` (a forgotten user's): each one kept, or being loaded now, is
        dropped through `on_evict` as the LRU drops one; running streams finish."""
        wanted = set(versions)
        pending = [t for v, t in self._loading.items() if v in wanted]
        if pending:  # a load finishing now would keep the version: wait for it, then drop it
            await asyncio.gather(*pending, return_exceptions=True)
        for version in [v for v in self._loaded if v in wanted]:
            del self._loaded[version]
            if self._on_evict is not None:
                await self._on_evict(version)

    def clear(self) -> None:
        """Forget every sampler without evicting (the backend is closing with its engine)."""
        self._loaded.clear()


class _Kept:
    """A sampler as `LoadedVersions` keeps it: a call it fails with `SamplerUnavailable` drops it."""

    def __init__(self, cache: LoadedVersions, version: int, sampler: Sampler) -> None:
        self.cache = cache
        self.version = version
        self.sampler = sampler

    @property
    def policy_version(self) -> int:
        return self.sampler.policy_version

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> SampleStream:
        try:
            return await self.sampler.sample(prompt_ids, params)
        except SamplerUnavailable:
            await self.cache._failed(self.version, self)
            raise


class _KeptScorer(_Kept):
    """A kept sampler that can also score given tokens (`SequenceScorer`, the local torch engine's
    versions): the cache must not hide it, or promotion scores held-out turns and the likelihood
    guard's references by a greedy replay, or not at all."""

    async def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        scorer = self.sampler
        assert isinstance(scorer, SequenceScorer)
        try:
            return await scorer.score(prompt_ids, completion_ids)
        except SamplerUnavailable:
            await self.cache._failed(self.version, self)
            raise


# --------------------------------------------------------------------------------------------
# Fake, for tests.


class FakeVersionedBackend(FakeServingBackend):
    """A serving backend whose version N replays `script(N)` (a `FakeSampler` per version); it
    publishes `published` and serves any other version from a `LoadedVersions` cache, recording
    each (version, checkpoint) it loaded in `loaded`."""

    name = "fake-versioned"

    def __init__(self, script: Callable[[int], list[int]], info: ModelInfo, published: int = 0,
                 max_loaded: int = 2) -> None:
        super().__init__(FakeSampler(script(published), version=published), info)
        self.script = script
        self.loaded: list[tuple[int, str]] = []
        self.cache = LoadedVersions(max_loaded, self._load)

    async def _load(self, version: int, checkpoint: str) -> Sampler:
        self.loaded.append((version, checkpoint))
        return FakeSampler(self.script(version), version=version)

    def publish_version(self, version: int) -> None:
        """Serve `version` as the published one (what `TrainingBackend.publish` does)."""
        self._sampler = FakeSampler(self.script(version), version=version)

    async def load_version(self, version: int, checkpoint: str) -> Sampler:
        return await self.cache.get(version, checkpoint)
