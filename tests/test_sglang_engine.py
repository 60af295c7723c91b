"""SGLangEngine, SGLangServer and `--engine sglang|auto` against a server that checks sglang 0.5.x shapes
(tests/sglang_server.py); the last test runs the same flow against real SGLang when a GPU and the
sglang package are present."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("clawbridge_local")

from clawbridge_local import backend as local_backend
from clawbridge_local.backend import EngineNotAvailable, LocalBackend
from clawbridge_local.sglang_engine import SGLangEngine
from clawbridge_local.sglang_launch import SGLangLaunchConfig, SGLangServer, serving_gpus

from clawbridge.chat.render import Renderer
from clawbridge.config import Settings
from clawbridge.serving.sampler import (
    PromptTooLong,
    SampledToken,
    SamplerOverloaded,
    SamplerTimeout,
    SamplerUnavailable,
    SamplingParams,
)
from tests.sglang_server import FakeSGLang
from tests.support import free_port, in_process_proxy

FAKE_CMD = [sys.executable, str(Path(__file__).with_name("sglang_server.py"))]
STOP = 7


@pytest.fixture
def fake(tiny_model_dir: Path) -> Iterator[FakeSGLang]:
    server = FakeSGLang(tiny_model_dir, port=free_port(), enable_lora=True, max_lora_rank=8,
                        lora_target_modules=("q_proj", "v_proj")).start()
    yield server
    server.stop()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def collect(stream: Any) -> list[SampledToken]:
    return [t async for t in stream]


async def engine_for(fake: FakeSGLang, **kw: Any) -> SGLangEngine:
    return await SGLangEngine.connect(fake.url, **kw)


def adapter(folder: Path, rank: int = 4) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 8,
                                                            "target_modules": ["q_proj", "v_proj"]}))
    (folder / "adapter_model.safetensors").write_bytes(folder.name.encode())  # the fake answers by content
    return folder


# ---------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("per_event", [1, 3])
def test_request_shape_and_exact_tokens(fake: FakeSGLang, per_event: int) -> None:
    fake.script, fake.tokens_per_event = [11, 12, 13, STOP, 99], per_event
    params = SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, top_k=0, seed=5, stop_token_ids=(STOP,),
                            top_logprobs=2)

    async def go() -> tuple[list[SampledToken], Any, SGLangEngine]:
        engine = await engine_for(fake)
        stream = await engine.sample([1, 2, 3], params)
        toks = await collect(stream)
        await engine.aclose()
        return toks, stream, engine

    toks, stream, engine = run(go())
    assert fake.requests == [{
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 10, "temperature": 0.7, "top_p": 0.9, "top_k": -1,
                            "stop_token_ids": [STOP], "sampling_seed": 5},
        "return_logprob": True, "top_logprobs_num": 2, "stream": True,
    }]  # fmt: skip
    assert [t.token_id for t in toks] == [11, 12, 13, STOP]  # stop token yielded last
    assert [t.logprob for t in toks] == [-0.25, -0.26, -0.27, -0.28]
    assert toks[1].top_logprobs == ((12, -0.26), (13, -1.26))
    assert (stream.finish_reason, stream.policy_version, engine.in_flight) == ("stop", 0, 0)
    assert engine.context_window == 32768


def test_length_and_max_tokens_clamped_to_context(fake: FakeSGLang) -> None:
    async def go() -> None:
        engine = await engine_for(fake)
        stream = await engine.sample([5] * 4, SamplingParams(max_tokens=3))
        assert len(await collect(stream)) == 3 and stream.finish_reason == "length"
        engine.context_window = 10  # the server then must see max_new_tokens = 10 - 8
        await collect(await engine.sample([5] * 8, SamplingParams(max_tokens=50)))
        assert fake.requests[-1]["sampling_params"]["max_new_tokens"] == 2
        with pytest.raises(PromptTooLong):
            await engine.sample([5] * 10, SamplingParams(max_tokens=1))
        await engine.aclose()

    run(go())


def test_tokens_stream_as_sampled(fake: FakeSGLang) -> None:
    fake.token_delay_s = 0.15

    async def go() -> None:
        engine = await engine_for(fake)
        stream = await engine.sample([1, 2], SamplingParams(max_tokens=6))
        running_at_each_token = [fake.running async for _ in stream]
        # The first token reached us while the server was still generating the other five.
        assert len(running_at_each_token) == 6 and running_at_each_token[0] == 1
        await engine.aclose()

    run(go())


def test_cancel_closes_the_http_stream(fake: FakeSGLang) -> None:
    fake.token_delay_s = 0.05

    async def consume(stream: Any, got: list[int]) -> None:
        async for tok in stream:
            got.append(tok.token_id)

    async def wait_aborted(n: int) -> None:
        for _ in range(200):
            if len(fake.aborted) >= n and fake.running == 0:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"server saw no abort: {fake.aborted}")

    async def go() -> None:
        engine = await engine_for(fake)
        stream = await engine.sample([1], SamplingParams(max_tokens=500))
        it = aiter(stream)
        await anext(it)
        await stream.aclose()
        await stream.aclose()  # idempotent
        assert stream.finish_reason == "cancelled" and engine.in_flight == 0
        await wait_aborted(1)
        # cancelling the consuming task cancels too
        stream2 = await engine.sample([2], SamplingParams(max_tokens=500))
        got: list[int] = []
        task = asyncio.ensure_future(consume(stream2, got))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert got and stream2.finish_reason == "cancelled" and engine.in_flight == 0
        await wait_aborted(2)
        await engine.aclose()

    run(go())


def test_overload_maps_to_sampler_overloaded(fake: FakeSGLang) -> None:
    async def go() -> None:
        engine = await engine_for(fake, max_in_flight=1)
        for mode in ("status", "event"):
            fake.overload = mode
            with pytest.raises(SamplerOverloaded):
                await engine.sample([1], SamplingParams(max_tokens=2))
            assert engine.in_flight == 0
        fake.overload, fake.token_delay_s = "", 0.05
        held = await engine.sample([1], SamplingParams(max_tokens=100))
        with pytest.raises(SamplerOverloaded):  # client-side bound: never an unbounded wait
            await engine.sample([1], SamplingParams(max_tokens=2))
        await held.aclose()
        await engine.aclose()

    run(go())


def test_unavailable_and_timeout(fake: FakeSGLang) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate" and json.loads(request.content)["input_ids"] == [1]:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        body = b'data: {"error": {"message": "The input (9 tokens) is longer than the model\'s context length"}}\n\n'
        return httpx.Response(200, content=body + b"data: [DONE]\n\n")

    async def go() -> None:
        dead = SGLangEngine(f"http://127.0.0.1:{free_port()}", context_window=100)
        with pytest.raises(SamplerUnavailable):
            await dead.sample([1], SamplingParams(max_tokens=2))
        assert dead.in_flight == 0
        mock = SGLangEngine("http://sglang", context_window=100, transport=httpx.MockTransport(answer))
        with pytest.raises(SamplerUnavailable, match="500"):
            await mock.sample([1], SamplingParams(max_tokens=2))
        with pytest.raises(PromptTooLong):
            await mock.sample([2], SamplingParams(max_tokens=2))
        fake.token_delay_s = 1.0
        slow = await engine_for(fake, read_timeout_s=0.3)
        with pytest.raises(SamplerTimeout):
            await slow.sample([1], SamplingParams(max_tokens=2))
        assert slow.in_flight == 0
        for e in (dead, mock, slow):
            await e.aclose()

    run(go())


def test_fake_server_rejects_wrong_shapes(fake: FakeSGLang) -> None:
    ok = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "stream": False, "return_logprob": True}
    with httpx.Client(base_url=fake.url) as c:
        assert c.post("/generate", json=ok).status_code == 200
        for bad in ({**ok, "seed": 3}, {**ok, "sampling_params": {"max_new_tokens": 2, "seed": 3}},
                    {**ok, "sampling_params": {"top_k": 0}}, {**ok, "return_logprob": "yes"},
                    {**ok, "lora_path": "v9"}, {**ok, "input_ids": [[1, 2]]}):
            assert c.post("/generate", json=bad).status_code == 400, bad
        assert c.post("/load_lora_adapter", json={"name": "v1", "path": "/x"}).status_code == 400
        assert c.post("/update_weights_from_disk", json={"path": "/x"}).status_code == 400


# ---------------------------------------------------------------------------------- publishing
def test_lora_publish_versions_and_unload(fake: FakeSGLang, tmp_path: Path) -> None:
    fake.token_delay_s = 0.02

    async def go() -> None:
        engine = await engine_for(fake, lora=True)
        base = await engine.sample([3, 4], SamplingParams(max_tokens=40))
        assert await engine.publish_lora(adapter(tmp_path / "a1"), 1) == 1
        assert fake.calls[-1] == ("/load_lora_adapter", {"lora_name": "v1", "lora_path": str(tmp_path / "a1")})
        s1 = await engine.sample([3, 4], SamplingParams(max_tokens=40))
        assert fake.requests[-1]["lora_path"] == "v1" and "lora_path" not in fake.requests[0]
        assert (base.policy_version, s1.policy_version, engine.policy_version) == (0, 1, 1)
        await engine.publish_lora(adapter(tmp_path / "a2"), 2)
        await engine.drain_unloads()
        assert engine.loaded_versions == {1, 2} and set(fake.adapters) == {"v1", "v2"}  # v1 still streaming
        s2 = await engine.sample([3, 4], SamplingParams(max_tokens=3))
        t1, t2, t0 = await collect(s1), await collect(s2), await collect(base)
        await engine.drain_unloads()
        assert ("/unload_lora_adapter", {"lora_name": "v1"}) in fake.calls
        assert engine.loaded_versions == {2} and set(fake.adapters) == {"v2"}
        assert fake.unload_waits == []  # never unloaded under a running request
        assert [t.token_id for t in t1][:3] != [t.token_id for t in t2] != [t.token_id for t in t0][:3]
        with pytest.raises(ValueError):
            await engine.publish_lora(adapter(tmp_path / "a3"), 2)  # versions only go up
        with pytest.raises(SamplerUnavailable):  # a rank over --max-lora-rank: the server says no
            await engine.publish_lora(adapter(tmp_path / "big", rank=64), 3)
        assert engine.policy_version == 2
        await engine.aclose()

    run(go())


def test_full_publish_drains_then_serves_new_weights(fake: FakeSGLang, tiny_model_dir: Path, tmp_path: Path) -> None:
    fake.token_delay_s = 0.05
    export = Path(shutil.copytree(tiny_model_dir, tmp_path / "step-1"))

    async def go() -> None:
        engine = await engine_for(fake)
        old = await engine.sample([3, 4], SamplingParams(max_tokens=12))
        publish = asyncio.ensure_future(engine.publish_full(export, 1))
        await asyncio.sleep(0.05)
        new = asyncio.ensure_future(engine.sample([3, 4], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.2)
        assert not publish.done() and not new.done()  # the old stream is still draining
        toks = await collect(old)
        await publish
        stream = await new
        await collect(stream)
        assert (len(toks), old.finish_reason, old.policy_version, stream.policy_version) == (12, "length", 0, 1)
        paths = [p for p, _ in fake.calls]
        assert paths == ["/update_weights_from_disk", "/flush_cache"]
        assert fake.calls[0][1] == {"model_path": str(export), "weight_version": "1"}
        assert fake.weights_tag == "1"
        with pytest.raises(ValueError):
            await engine.publish_lora(export, 2)
        await engine.aclose()

    run(go())


# ---------------------------------------------------------------------------------- backend + launcher
def test_engine_auto_selection(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    auto = Settings.model_validate({"model": str(tiny_model_dir)})
    if local_backend.cuda_available() and local_backend.sglang_installed():
        pytest.skip("this machine has a GPU and sglang: auto picks sglang here")
    assert LocalBackend(auto).engine_name == "torch"  # this CPU box
    monkeypatch.setattr(local_backend, "cuda_available", lambda: True)
    assert LocalBackend(auto).engine_name == ("sglang" if local_backend.sglang_installed() else "torch")
    monkeypatch.setattr(local_backend, "sglang_installed", lambda: True)
    assert LocalBackend(auto).engine_name == "sglang"
    monkeypatch.setattr(local_backend, "cuda_available", lambda: False)
    url = Settings.model_validate({"model": str(tiny_model_dir), "backends": {"local": {"sglang_url": "http://127.0.0.1:1"}}})
    assert LocalBackend(url).engine_name == "sglang"


def test_engine_sglang_without_package_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_backend, "sglang_installed", lambda: False)
    s = Settings.model_validate({"model": str(tiny_model_dir), "backends": {"local": {"engine": "sglang"}},
                                 "state_dir": str(tmp_path)})
    with pytest.raises(EngineNotAvailable, match="sglang package"):
        run(LocalBackend(s).start())


def test_launcher_starts_health_checks_and_stops(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = SGLangLaunchConfig(str(tiny_model_dir), free_port(), lora_rank=8, lora_target_modules=("q_proj", "v_proj"),
                             tp_size=2, dp_size=1, mem_fraction=0.5, max_running_requests=4, max_queued_requests=8,
                             extra_args=("--fake-startup-s", "0.5"))
    assert cfg.argv()[:6] == ["--model-path", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(cfg.port)]
    server = SGLangServer(cfg, tmp_path / "logs" / "sglang.log", command=FAKE_CMD, startup_timeout_s=60, poll_s=0.2)
    url = server.start()
    try:
        assert httpx.get(url + "/health_generate").status_code == 200
        log_text = (tmp_path / "logs" / "sglang.log").read_text()
        assert "--enable-lora --max-lora-rank 8 --lora-target-modules q_proj v_proj --tp-size 2" in log_text
        assert "'max_queued_requests': 8" in log_text
    finally:
        server.stop()
    assert server.proc is not None and server.proc.poll() is not None
    bad = SGLangServer(SGLangLaunchConfig(str(tiny_model_dir), free_port(), extra_args=("--no-such-flag",)),
                       tmp_path / "bad.log", command=FAKE_CMD, startup_timeout_s=60, poll_s=0.2)
    with pytest.raises(RuntimeError, match="no-such-flag"):
        bad.start()
    assert serving_gpus(["0", "1", "2"], 1, 1) == ["2"] and serving_gpus(["0"], 1, 1) is None


def test_local_backend_launches_sglang_and_proxies_chat(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`--engine sglang`: LocalBackend launches the server (here the fake), the real proxy serves chat
    through SGLangEngine, and the store records exactly the ids and logprobs the server sampled."""
    s = Settings.model_validate({"model": str(tiny_model_dir), "backends": {"local": {"engine": "sglang"}},
                                 "state_dir": str(tmp_path),
                                 "port": free_port(), "served_model_name": "tiny", "lora_rank": 0})
    backend = LocalBackend(s, sglang_command=FAKE_CMD)
    with in_process_proxy(s, backend) as proxy:
        _chat_round_trip(proxy, tiny_model_dir, "launched-1", script=None)
        assert backend._server is not None and (tmp_path / "logs" / "sglang.log").is_file()
        server = backend._server
    run(backend.close())  # what `clawbridge up` does at shutdown (clawbridge.server)
    assert server.proc is not None and server.proc.poll() is not None


def test_proxy_round_trip_over_sglang_url(fake: FakeSGLang, tiny_model_dir: Path, tmp_path: Path) -> None:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    script = [*renderer.tokenizer.encode("Hello there", add_special_tokens=False), renderer.stop_token_ids[0]]
    fake.script = script
    s = Settings.model_validate({"model": str(tiny_model_dir), "backends": {"local": {"sglang_url": fake.url}},
                                 "state_dir": str(tmp_path), "promotion_mode": "off",  # no probe calls beside the turn
                                 "port": free_port(), "served_model_name": "tiny"})
    backend = LocalBackend(s)
    assert backend.engine_name == "sglang"  # auto + sglang_url
    with in_process_proxy(s, backend) as proxy:
        _chat_round_trip(proxy, tiny_model_dir, "url-1", script=script)
        turn = proxy.state.store.session_view("url-1")["turns"][0]
    assert fake.requests[-1]["input_ids"] == turn["prompt_token_ids"]
    assert fake.requests[-1]["sampling_params"]["stop_token_ids"] == list(renderer.stop_token_ids)


def _chat_round_trip(proxy: Any, model_dir: Path, session: str, script: list[int] | None) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    r = httpx.post(proxy.base + "/v1/chat/completions", headers={"Authorization": f"Bearer {proxy.state.keys.client}",
                                                                 "X-Session-Id": session},
                   json={"model": "tiny", "messages": messages, "max_tokens": 8}, timeout=60)
    assert r.status_code == 200, r.text
    turn = proxy.state.store.session_view(session)["turns"][0]
    assert turn["prompt_token_ids"] == Renderer.from_pretrained(str(model_dir)).render(messages)
    assert len(turn["completion_logprobs"]) == len(turn["completion_token_ids"]) >= 1
    if script is not None:
        assert turn["completion_token_ids"] == script
        assert turn["completion_logprobs"] == pytest.approx([-0.25 - 0.01 * k for k in range(len(script))])
        assert r.json()["choices"][0]["message"]["content"] == "Hello there"
        assert r.json()["choices"][0]["finish_reason"] == "stop"


# ---------------------------------------------------------------------------------- real SGLang
def _real_sglang_missing() -> str:
    missing = []
    if importlib.util.find_spec("sglang") is None:
        missing.append("the sglang package")
    if not local_backend.cuda_available():
        missing.append("a CUDA GPU")
    return " and ".join(missing)


@pytest.mark.slow
@pytest.mark.skipif(bool(_real_sglang_missing()), reason=f"real SGLang needs {_real_sglang_missing()}")
def test_real_sglang_sample_and_lora_publish(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The same flow against `python -m sglang.launch_server` on this machine's GPU."""
    from clawbridge_local.trainer.client import FsdpTrainerClient
    from clawbridge_local.trainer.config import LoraSettings, TrainerConfig

    cfg = SGLangLaunchConfig(str(tiny_model_dir), free_port(), lora_rank=8, lora_target_modules=("q_proj", "v_proj"),
                             mem_fraction=0.3, max_running_requests=8, max_queued_requests=8)
    server = SGLangServer(cfg, tmp_path / "sglang.log", startup_timeout_s=900)
    server.start()
    try:
        async def go() -> None:
            engine = await SGLangEngine.connect(server.url, lora=True)
            stream = await engine.sample([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(STOP,)))
            toks = await collect(stream)
            assert 1 <= len(toks) <= 8 and all(t.logprob <= 0 for t in toks)
            trainer = FsdpTrainerClient(TrainerConfig(model_path=str(tiny_model_dir),
                                                      lora=LoraSettings(rank=8, alpha=16, target_modules=("q_proj", "v_proj"))),
                                        tmp_path / "trainer")
            trainer.start(1)
            folder = trainer.export_weights(tmp_path / "exports")
            trainer.close()
            await engine.publish_lora(folder, 1)
            s1 = await engine.sample([1, 2, 3], SamplingParams(max_tokens=4))
            assert s1.policy_version == 1 and len(await collect(s1)) >= 1
            await engine.aclose()

        run(go())
    finally:
        server.stop()


# ---------------------------------------------------------------------------------- replicas
@pytest.fixture
def replicas(tiny_model_dir: Path) -> Iterator[list[FakeSGLang]]:
    servers = [FakeSGLang(tiny_model_dir, port=free_port(), enable_lora=True, max_lora_rank=8,
                          lora_target_modules=("q_proj", "v_proj")).start() for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


def test_lora_publish_reaches_every_replica_before_it_serves(replicas: list[FakeSGLang], tmp_path: Path) -> None:
    a, b = replicas

    async def go() -> None:
        engine = await SGLangEngine.connect([a.url, b.url], lora=True)
        # Paced (3 s a stream), so all four are still open when the next one picks its replica:
        # unpaced, a stream could end before the next request and free its replica (CI: 3 and 1).
        a.token_delay_s = b.token_delay_s = 0.1
        streams = [await engine.sample([3, 4], SamplingParams(max_tokens=30)) for _ in range(4)]
        assert len(a.requests) == len(b.requests) == 2  # spread over both
        a.token_delay_s = b.token_delay_s = 0.0
        for s in streams:
            await collect(s)
        assert await engine.publish_lora(adapter(tmp_path / "a1"), 1) == 1
        assert set(a.adapters) == set(b.adapters) == {"v1"}  # loaded on both before v1 serves
        s1 = [await engine.sample([3, 4], SamplingParams(max_tokens=2)) for _ in range(2)]
        assert a.requests[-1]["lora_path"] == b.requests[-1]["lora_path"] == "v1"
        for s in s1:
            await collect(s)
        # A load refused by one replica: not announced, the other unloads it again, v1 serves on both.
        b.max_lora_rank = 4
        with pytest.raises(SamplerUnavailable, match=f"failed on 1 of 2 .*{b.url}.*still serves version 1"):
            await engine.publish_lora(adapter(tmp_path / "a2", rank=8), 2)
        assert engine.policy_version == 1 and set(a.adapters) == set(b.adapters) == {"v1"}
        assert ("/unload_lora_adapter", {"lora_name": "v2"}) in a.calls
        s2 = [await engine.sample([3, 4], SamplingParams(max_tokens=2)) for _ in range(2)]
        assert {a.requests[-1]["lora_path"], b.requests[-1]["lora_path"]} == {"v1"}
        assert [s.policy_version for s in s2] == [1, 1]
        for s in s2:
            await collect(s)
        b.max_lora_rank = 8
        assert await engine.publish_lora(adapter(tmp_path / "a3"), 3) == 3  # the next publish works
        await engine.drain_unloads()
        assert set(a.adapters) == set(b.adapters) == {"v3"}
        await engine.aclose()

    run(go())


def test_full_publish_on_replicas_loads_back_or_leaves_rotation(replicas: list[FakeSGLang], tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    a, b = replicas
    step1 = Path(shutil.copytree(tiny_model_dir, tmp_path / "step-1"))
    step2 = Path(shutil.copytree(tiny_model_dir, tmp_path / "step-2"))

    async def go() -> None:
        engine = await SGLangEngine.connect([a.url, b.url])
        assert await engine.publish_full(step1, 1) == 1
        assert a.weights_tag == b.weights_tag == "1"
        # One replica refuses the load (SGLang keeps its old weights): the other loads step-1 back.
        b.refuse_updates = "out of memory"
        with pytest.raises(SamplerUnavailable, match="serve version 1"):
            await engine.publish_full(step2, 2)
        assert engine.policy_version == 1 and a.weights_tag == b.weights_tag == "1" and engine.down == set()
        assert a.calls[-2:] == [("/update_weights_from_disk", {"model_path": str(step2), "weight_version": "2"}),
                                ("/update_weights_from_disk", {"model_path": str(step1), "weight_version": "1"})]
        # A replica that does not answer: its weights are unknown, so it leaves rotation.
        b.refuse_updates = ""
        b.stop()
        with pytest.raises(SamplerUnavailable, match=f"{b.url} out of rotation"):
            await engine.publish_full(step2, 2)
        assert engine.down == {1} and a.weights_tag == "1"
        before = len(a.requests)
        streams = [await engine.sample([3, 4], SamplingParams(max_tokens=2)) for _ in range(3)]
        assert len(a.requests) == before + 3 and [s.policy_version for s in streams] == [1, 1, 1]
        for s in streams:
            await collect(s)
        await engine.aclose()

    run(go())
