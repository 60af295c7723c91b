"""A finished model call frees what it held by reference counting alone, through the real proxy.

A call's sampler stream holds its version's weights (with per-user adapters, the user's adapter:
43 MiB on SmolLM2). `clawbridge up` freezes start-up out of the cyclic collector and collects its
young generation rarely (`clawbridge.server.tune_gc`), so a call left in a reference cycle kept its
adapter alive long after the version was evicted: with 64 users, 58-107 evicted adapters at once
(issue 32, docs/users.md). The cycle was the call's `on_cut` callback on its in-flight ticket
(`clawbridge.proxy.inflight`), which the ticket kept after the call ended.

The test runs calls with the cyclic collector off, so only reference counting frees anything: the
streams the sampler handed out must die once their calls ended.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from clawbridge.serving.sampler import SampleStream, SamplingParams
from tests.fake_proxy import SwitchableSampler, script_for, start_fake_proxy
from tests.kill_support import wait_until
from tests.support import InProcessProxy


@dataclass
class TrackingSampler(SwitchableSampler):
    """A fake sampler that keeps a weak reference to every stream it hands out."""

    streams: list[weakref.ref[SampleStream]] = field(default_factory=list)

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> SampleStream:
        stream = await super().sample(prompt_ids, params)
        self.streams.append(weakref.ref(stream))
        return stream

    def alive(self) -> int:
        return sum(1 for ref in self.streams if ref() is not None)


@pytest.fixture
def no_cycle_collector() -> Iterator[None]:
    gc.collect()  # nothing earlier tests left behind is counted
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def proxy(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[InProcessProxy, TrackingSampler]]:
    from clawbridge.chat.render import Renderer

    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    sampler = TrackingSampler(script=script_for(renderer, "hello there"), keep_prompts=False)
    p = start_fake_proxy(tiny_model_dir, tmp_path / "state", sampler)
    try:
        yield p, sampler
    finally:
        p.stop()


def test_a_finished_call_frees_its_stream_without_the_cycle_collector(
        proxy: tuple[InProcessProxy, TrackingSampler], no_cycle_collector: None) -> None:
    server, sampler = proxy
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=server.state.keys.client,
                           max_retries=0, timeout=60)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    for i in range(3):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                       extra_headers={"X-Session-Id": f"plain-{i}"})
        with client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                            stream=True, extra_headers={"X-Session-Id": f"streamed-{i}"}) as stream:
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert len(sampler.streams) == 6
    # The response's last byte reaches the client just before the server ends the request.
    wait_until(lambda: sampler.alive() == 0, "the 6 calls' streams to be freed",
               timeout_s=20)
    client.close()
