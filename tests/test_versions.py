"""`clawbridge.serving.versions`: the router that picks the version of each model call, through the real proxy.

A `FakeVersionedBackend` (version N answers "vN") behind the real app, a real SQLite store whose
`policy_versions` rows say which versions are committed and kept, and the real openai and
anthropic SDKs as clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from clawbridge.access import Principal
from clawbridge.backend import ModelInfo
from clawbridge.chat.render import Renderer
from clawbridge.config import Settings
from clawbridge.serving.versions import (
    FakeVersionedBackend,
    LoadedVersions,
    VersionNotFound,
    VersionRouter,
    parse_versioned,
)
from clawbridge.store import Store
from clawbridge.store.versions import VersionStore
from tests.fake_proxy import script_for
from tests.support import InProcessProxy, free_port

ASK = [{"role": "user", "content": "which version are you?"}]

CLIENT = Principal("client")
"""The shared client key (a caller without a user)."""


def commit_versions(store: Store, upto: int) -> dict[int, str]:
    """Commit versions 0..upto with a checkpoint name each (as the trainer loop records them)."""
    vs = VersionStore(store)
    vs.commit_base("ckpt-0", None)
    out = {0: "ckpt-0"}
    for _ in range(upto):
        v = vs.reserve("step")
        vs.commit(v, f"ckpt-{v}", None)
        out[v] = f"ckpt-{v}"
    return out


@pytest.fixture
def proxy(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[InProcessProxy, FakeVersionedBackend]]:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    info = ModelInfo(name="tiny", tokenizer_path=str(tiny_model_dir), context_window=4096, max_output_tokens=64)
    backend = FakeVersionedBackend(lambda v: script_for(renderer, f"v{v}"), info, published=3, max_loaded=2)
    settings = Settings(port=free_port(), state_dir=tmp_path / "state", model=str(tiny_model_dir),
                        served_model_name="tiny")
    p = InProcessProxy(settings, backend).start()
    try:
        commit_versions(p.state.store, 3)
        VersionStore(p.state.store).mark_pruned("ckpt-1")
        yield p, backend
    finally:
        p.stop()


def client(p: InProcessProxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{p.base}/v1", api_key=p.state.keys.client, max_retries=0)


def turns_by_version(p: InProcessProxy) -> list[tuple[int, str]]:
    with p.state.store.read() as c:
        rows = c.execute("SELECT policy_version, request_json FROM turns ORDER BY created_at").fetchall()
    return [(int(r[0]), str(r[1])) for r in rows]


def test_parse_versioned() -> None:
    names = ("tiny", "default")
    assert parse_versioned("tiny@2", names) == 2
    assert parse_versioned("default@0", names) == 0
    assert parse_versioned("tiny", names) is None
    assert parse_versioned("other@2", names) is None
    assert parse_versioned("tiny@latest", names) is None
    assert parse_versioned("tiny@-1", names) is None


def test_named_version_on_every_api(proxy: tuple[InProcessProxy, FakeVersionedBackend]) -> None:
    p, backend = proxy
    oa = client(p)
    plain = oa.chat.completions.create(model="tiny", messages=ASK)  # type: ignore[arg-type]
    assert plain.choices[0].message.content == "v3" and plain.model == "tiny"

    pinned = oa.chat.completions.create(model="tiny@2", messages=ASK)  # type: ignore[arg-type]
    assert pinned.choices[0].message.content == "v2" and pinned.model == "tiny@2"

    chunks = list(oa.chat.completions.create(model="default@0", messages=ASK, stream=True))  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "v0"
    assert {c.model for c in chunks} == {"default@0"}

    resp = oa.responses.create(model="tiny@2", input="which version are you?")
    assert resp.output_text == "v2" and resp.model == "tiny@2"
    with oa.responses.stream(model="tiny@0", input="which version are you?") as stream:
        done = stream.get_final_response()
    assert done.output_text == "v0"

    an = anthropic.Anthropic(base_url=p.base, api_key=p.state.keys.client, max_retries=0)
    msg = an.messages.create(model="tiny@2", max_tokens=16, messages=ASK)  # type: ignore[arg-type]
    assert msg.content[0].text == "v2" and msg.model == "tiny@2"  # type: ignore[union-attr]
    with an.messages.stream(model="tiny@0", max_tokens=16, messages=ASK) as s:  # type: ignore[arg-type]
        assert s.get_final_text() == "v0"

    # Every turn is recorded with the version that answered it.
    assert [v for v, _ in turns_by_version(p)] == [3, 2, 0, 2, 0, 2, 0]
    # Versions 0 and 2 were each loaded once from their checkpoint (then kept), 3 never (published).
    assert backend.loaded == [(2, "ckpt-2"), (0, "ckpt-0")]


def test_missing_or_pruned_version_is_404(proxy: tuple[InProcessProxy, FakeVersionedBackend]) -> None:
    p, _ = proxy
    oa = client(p)
    for model, why in (("tiny@9", "does not exist"), ("tiny@1", "was pruned")):
        with pytest.raises(openai.NotFoundError) as err:
            oa.chat.completions.create(model=model, messages=ASK)  # type: ignore[arg-type]
        body = err.value.body
        assert isinstance(body, dict) and body["code"] == "model_not_found", body
        assert why in body["message"] and "tiny@0, tiny@2, tiny@3" in body["message"], body["message"]
    with pytest.raises(openai.NotFoundError):  # streaming too: the 404 comes before any event
        oa.chat.completions.create(model="tiny@9", messages=ASK, stream=True)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="other@2", messages=ASK)  # type: ignore[arg-type]
    for bad in ("tiny@", "tiny@abc", "tiny@-1", "tiny@1.5", "tiny@" + "9" * 20, "@2", "tiny@999999999999"):
        with pytest.raises(openai.NotFoundError) as err:
            oa.chat.completions.create(model=bad, messages=ASK)  # type: ignore[arg-type]
        assert isinstance(err.value.body, dict) and err.value.body["code"] == "model_not_found", (bad, err.value.body)
    assert turns_by_version(p) == []  # nothing sampled, nothing recorded
    listed = [m.id for m in oa.models.list().data]
    assert listed == ["tiny", "default", "tiny@0", "tiny@2", "tiny@3"]


def test_serving_and_sticky_canary(proxy: tuple[InProcessProxy, FakeVersionedBackend]) -> None:
    p, _ = proxy
    oa = client(p)
    router: VersionRouter = p.state.router

    def answer(session: str) -> str:
        r = oa.chat.completions.create(model="tiny", messages=ASK,  # type: ignore[arg-type]
                                       extra_headers={"X-Session-Id": session})
        return str(r.choices[0].message.content)

    assert answer("old") == "v3"
    router.set_serving(2)  # promotion pinned plain traffic to version 2
    assert router.serving_version == 2 and answer("old") == "v2"
    router.set_candidate(3, share=1.0)  # every NEW session goes to the candidate
    assert answer("new") == "v3" and answer("old") == "v2"  # "old" was seen before the candidate
    router.set_candidate(3, share=0.0)  # the share only decides for sessions not seen yet
    assert answer("new") == "v3" and answer("newer") == "v2"
    router.set_candidate(None)
    assert answer("new") == "v2"
    # About `share` of new sessions go to the candidate, the same ones every time.
    router.set_candidate(3, share=0.25)
    picks = [router.is_canary(f"s{i}") for i in range(2000)]
    assert 400 < sum(picks) < 600, sum(picks)
    assert picks == [router.is_canary(f"s{i}") for i in range(2000)]


def test_unservable_backend_names_the_published_version(tmp_path: Path) -> None:
    """A backend without `load_version` serves only its published version by name."""
    from clawbridge.backend import FakeServingBackend
    from clawbridge.serving.sampler import FakeSampler

    store = Store.open(tmp_path)
    commit_versions(store, 2)
    info = ModelInfo(name="tiny", tokenizer_path="", context_window=64, max_output_tokens=8)
    router = VersionRouter(FakeServingBackend(FakeSampler([1], version=2), info), VersionStore(store), ("tiny",))

    async def run() -> None:
        assert (await router.route("tiny@2", None, CLIENT)).sampler.policy_version == 2
        with pytest.raises(VersionNotFound) as err:
            await router.route("tiny@1", None, CLIENT)
        assert err.value.kept == [2] and "serves only" in str(err.value)

    asyncio.run(run())
    store.close()


def test_loaded_versions_lru_and_shared_load() -> None:
    from clawbridge.serving.sampler import FakeSampler, Sampler

    loads: list[int] = []

    async def load(version: int, checkpoint: str) -> Sampler:
        loads.append(version)
        await asyncio.sleep(0)
        return FakeSampler([version], version=version)

    async def run() -> None:
        cache = LoadedVersions(2, load)
        a, b = await asyncio.gather(cache.get(1, "c1"), cache.get(1, "c1"))  # one load for both
        assert a is b and loads == [1]
        await cache.get(2, "c2")
        await cache.get(1, "c1")  # 1 is now the most recent
        await cache.get(3, "c3")  # evicts 2
        assert cache.versions == [1, 3] and loads == [1, 2, 3]
        await cache.get(2, "c2")
        assert loads == [1, 2, 3, 2]

    asyncio.run(run())


def test_loaded_versions_drop_a_sampler_that_fails_a_call() -> None:
    """A kept version whose sampler can no longer serve (its weights gone on a hosted service) is
    dropped at its first failed call, so the next call loads it again instead of failing for good."""
    from clawbridge.serving.sampler import (
        FakeSampler,
        Sampler,
        SamplerUnavailable,
        SampleStream,
        SamplingParams,
    )

    class Dead(FakeSampler):
        async def sample(self, prompt_ids: object, params: SamplingParams) -> SampleStream:  # type: ignore[override]
            raise SamplerUnavailable("Model m-1 not loaded")

    loads: list[int] = []
    evicted: list[int] = []

    async def load(version: int, checkpoint: str) -> Sampler:
        loads.append(version)
        return Dead([1], version=version) if len(loads) == 1 else FakeSampler([version], version=version)

    async def evict(version: int) -> None:
        evicted.append(version)

    async def run() -> list[int]:
        cache = LoadedVersions(2, load, evict)
        first = await cache.get(5, "c5")
        with pytest.raises(SamplerUnavailable):
            await first.sample([1], SamplingParams(max_tokens=1))
        assert cache.versions == [] and evicted == [5]  # dropped, and its resources freed
        again = await cache.get(5, "c5")
        stream = await again.sample([1], SamplingParams(max_tokens=1))
        assert cache.versions == [5] and stream.policy_version == 5
        with pytest.raises(SamplerUnavailable):  # a stale handle failing again drops nothing new
            await first.sample([1], SamplingParams(max_tokens=1))
        assert cache.versions == [5] and evicted == [5]
        return [t.token_id async for t in stream]

    assert asyncio.run(run()) == [5]
    assert loads == [5, 5]


def test_discarding_versions_evicts_them_like_the_lru_does() -> None:
    """Forgetting a user discards their versions: each one kept, or still loading, goes through the
    eviction callback (which unloads a server-side adapter and deletes its folder), exactly as when
    the LRU drops it; `holds` says what the cache keeps, loads in flight included."""
    from clawbridge.serving.sampler import FakeSampler, Sampler

    evicted: list[int] = []
    gate = asyncio.Event()

    async def load(version: int, checkpoint: str) -> Sampler:
        if version == 3:
            await gate.wait()
        return FakeSampler([version], version=version)

    async def evict(version: int) -> None:
        evicted.append(version)

    async def run() -> None:
        cache = LoadedVersions(4, load, evict)
        await cache.get(1, "c1")
        await cache.get(2, "c2")
        loading = asyncio.ensure_future(cache.get(3, "c3"))
        await asyncio.sleep(0)
        assert cache.holds(1) and cache.holds(3) and not cache.holds(4)
        discarding = asyncio.ensure_future(cache.discard([1, 3, 4]))
        await asyncio.sleep(0)
        gate.set()  # the load of 3 finishes while it is being discarded: it is dropped all the same
        await discarding
        await loading
        assert sorted(evicted) == [1, 3] and cache.versions == [2]
        assert not cache.holds(1) and not cache.holds(3) and cache.holds(2)

    asyncio.run(run())
