"""`clawbridge up` as a subprocess with the real local torch engine, driven by the real `openai` SDK.

Every test runs once per chat format: the tiny model with its Qwen3 template (native tools), and
with a plain ChatML template (tools in the system message); and once against the real
SmolLM2-135M-Instruct (a plain ChatML template of its own; slow, skipped when it cannot be fetched)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clawbridge.chat.render import Renderer
from tests.support import ProxyProcess, wait_for

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module", params=["tiny_model_dir", "tiny_chatml_dir",
                                        pytest.param("smollm2_dir", marks=pytest.mark.slow)],
                ids=["qwen3", "plain", "smollm2"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(request.param))


@pytest.fixture(scope="module")
def proxy(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    p = ProxyProcess(model_dir, tmp_path_factory.mktemp("engine-proxy")).start()
    try:
        # The capability probe of the serving version runs in the background from start-up: the tests
        # here compare calls bit for bit, which holds only when no probe request shares their batches
        # (SmolLM2's seeded calls differed in CI while the probe ran beside them).
        wait_for(lambda: not _probe_measuring(p), 600, "the probe's baseline")
        yield p
    finally:
        p.stop()


def _probe_measuring(p: ProxyProcess) -> bool:
    status = httpx.get(p.base + "/rl/status", headers={"Authorization": f"Bearer {p.admin_key}"}, timeout=30).json()
    return bool(((status.get("promotion") or {}).get("capability_probe") or {}).get("measuring"))


@pytest.fixture(scope="module")
def renderer(model_dir: Path) -> Renderer:
    return Renderer.from_pretrained(str(model_dir))


def sdk(proxy: ProxyProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base + "/v1", api_key=proxy.key(), max_retries=0, timeout=120)


def show(proxy: ProxyProcess, session_id: str) -> dict:  # type: ignore[type-arg]
    out = subprocess.run([sys.executable, "-m", "clawbridge.cli.main", "sessions", "show", session_id, "--json",
                          "--state-dir", str(proxy.state_dir)], capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout))


def strip_stop(ids: list[int], renderer: Renderer) -> list[int]:
    return ids[:-1] if ids and ids[-1] in renderer.stop_token_ids else ids


def message_text(msg: dict) -> str:  # type: ignore[type-arg]
    return (msg.get("content") or "") + (msg.get("reasoning_content") or "")


def test_models_and_health(proxy: ProxyProcess, model_dir: Path) -> None:
    ids = [m.id for m in sdk(proxy).models.list().data]
    assert ids == [model_dir.name, "default", f"{model_dir.name}@0"]  # and the versions kept (clawbridge.serving.versions)


def test_recorded_ids_decode_to_what_the_client_received(proxy: ProxyProcess, renderer: Renderer) -> None:
    messages = [{"role": "system", "content": "You are a helpful agent."},
                {"role": "user", "content": "What is the weather in Paris?"}]
    resp = sdk(proxy).chat.completions.create(model="default", messages=messages, tools=TOOLS, max_tokens=24,  # type: ignore[arg-type]
                                              seed=3, extra_headers={"X-Session-Id": "engine-1"})
    turn = show(proxy, "engine-1")["turns"][0]
    assert turn["prompt_token_ids"] == renderer.render(messages, TOOLS)
    assert 1 <= len(turn["completion_token_ids"]) <= 24
    assert len(turn["completion_logprobs"]) == len(turn["completion_token_ids"])
    assert all(lp <= 0.0 for lp in turn["completion_logprobs"])
    assert turn["policy_version"] == 0
    parsed = renderer.parse(renderer.decode(strip_stop(turn["completion_token_ids"], renderer)))
    got = resp.choices[0].message
    assert (got.content or "") == (parsed.content or "")
    assert [c.function.name for c in got.tool_calls or []] == [c.name for c in parsed.tool_calls]  # type: ignore[union-attr]
    assert turn["response"]["choices"][0]["message"]["content"] == got.content


def test_streaming_is_real_and_recorded(proxy: ProxyProcess, renderer: Renderer) -> None:
    stream = sdk(proxy).chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=40,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True}, seed=5, temperature=0.8,
        extra_headers={"X-Session-Id": "engine-2"})
    text, finish, usage, n = "", None, None, 0
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            n += 1
            text += (ch.delta.content or "") + (getattr(ch.delta, "reasoning_content", None) or "")
            finish = ch.finish_reason or finish
    assert finish in ("stop", "length", "tool_calls") and usage is not None
    turn = show(proxy, "engine-2")["turns"][0]
    assert usage.completion_tokens == len(turn["completion_token_ids"])
    assert n >= 2
    assert message_text(turn["response"]["choices"][0]["message"]) == text


def test_seed_makes_sampling_repeatable(proxy: ProxyProcess) -> None:
    c = sdk(proxy)
    args = dict(model="default", messages=[{"role": "user", "content": "pick a number"}], max_tokens=12, seed=11)
    c.chat.completions.create(**args, extra_headers={"X-Session-Id": "seed-a"})  # type: ignore[call-overload]
    c.chat.completions.create(**args, extra_headers={"X-Session-Id": "seed-b"})  # type: ignore[call-overload]
    a = show(proxy, "seed-a")["turns"][0]
    b = show(proxy, "seed-b")["turns"][0]
    assert a["completion_token_ids"] == b["completion_token_ids"]
    # The second call reuses the first one's cached prompt (the engine's prefix cache), computed as
    # a cold prefill computes it: the logprobs are the same bit for bit.
    assert a["completion_logprobs"] == b["completion_logprobs"]


def test_logprobs_returned_match_recorded(proxy: ProxyProcess) -> None:
    resp = sdk(proxy).chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],  # type: ignore[arg-type]
                                              max_tokens=8, logprobs=True, top_logprobs=3, temperature=0.0,
                                              extra_headers={"X-Session-Id": "lp-1"})
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.content is not None
    turn = show(proxy, "lp-1")["turns"][0]
    assert [e.logprob for e in lp.content] == pytest.approx(turn["completion_logprobs"], abs=1e-6)
    for e in lp.content:
        assert len(e.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-6)


def test_concurrent_calls_all_complete(proxy: ProxyProcess) -> None:
    import concurrent.futures as cf

    def one(i: int) -> int:
        r = sdk(proxy).chat.completions.create(model="default", messages=[{"role": "user", "content": f"n{i}"}],  # type: ignore[arg-type]
                                               max_tokens=16, extra_headers={"X-Session-Id": "conc"})
        return r.usage.completion_tokens if r.usage else 0

    with cf.ThreadPoolExecutor(6) as ex:
        counts = list(ex.map(one, range(6)))
    assert all(c >= 1 for c in counts)
    assert len(show(proxy, "conc")["turns"]) == 6


def test_forced_tool_choice_makes_the_real_model_call_it(proxy: ProxyProcess, renderer: Renderer) -> None:
    messages = [{"role": "user", "content": "Find the weather in Paris."}]
    choice = {"type": "function", "function": {"name": "search"}}
    resp = sdk(proxy).chat.completions.create(model="default", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                              tool_choice=choice, max_tokens=12, seed=2,  # type: ignore[arg-type]
                                              extra_headers={"X-Session-Id": "forced-engine"})
    got = resp.choices[0]
    assert got.finish_reason in ("tool_calls", "length")
    assert [c.function.name for c in got.message.tool_calls or []][:1] == ["search"]  # type: ignore[union-attr]
    turn = show(proxy, "forced-engine")["turns"][0]
    prompt = renderer.render_prompt(messages, TOOLS, choice)
    assert turn["prompt_token_ids"] == prompt.ids
    # What the client got is the parse of the recorded ids as a continuation of the forced opening.
    parsed = renderer.parse(renderer.decode(strip_stop(turn["completion_token_ids"], renderer)), prompt)
    assert parsed.tool_calls[0].arguments == got.message.tool_calls[0].function.arguments  # type: ignore[index, union-attr]


def test_status_reports_the_kv_budget(proxy: ProxyProcess) -> None:
    """/rl/status and `clawbridge status` say how full the torch engine's KV budget is and how many
    requests wait; with no request running nothing is reserved (finished prompts stay as prefixes)."""
    sdk(proxy).chat.completions.create(model="default", messages=[{"role": "user", "content": "count to three"}],
                                       max_tokens=6, extra_headers={"X-Session-Id": "kv-status"})

    def status() -> dict[str, Any]:
        return httpx.get(proxy.base + "/rl/status", headers={"Authorization": f"Bearer {proxy.admin_key}"},
                         timeout=30).json()

    # The probe's baseline ran before the first test (the fixture): no request runs now.
    engine = status()["engine"]
    assert engine["kv_budget_tokens"] > 0
    assert (engine["kv_used_tokens"], engine["running"], engine["waiting"]) == (0, 0, 0)
    assert engine["kv_cached_tokens"] > 0 and engine["prefix_entries"] >= 1
    assert 0 < engine["kv_high_water_tokens"] <= engine["kv_budget_tokens"]
    # The budget was chosen from the free memory (the default) and in bfloat16 (a float32 model on the CPU).
    assert engine["kv_dtype"] == "bf16" and "free after weights and trainer" in engine["kv_budget_reason"]
    out = subprocess.run([sys.executable, "-m", "clawbridge.cli.main", "status", "--state-dir", str(proxy.state_dir)],
                         capture_output=True, text=True, check=True)
    assert f"engine: KV budget {engine['kv_budget_tokens']:,} positions (" in out.stdout
    assert engine["kv_budget_reason"] in out.stdout
    assert f"KV budget 0% reserved (0 of {engine['kv_budget_tokens']} tokens" in out.stdout
    assert "0 running, 0 waiting" in out.stdout
