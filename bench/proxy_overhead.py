"""What the proxy adds per call, with the model's own time excluded (an instant scripted sampler).

Measures, for a 40 KB OpenClaw-sized request (12 tools, a growing session) and a small request:
1. in-process: render (prompt ids) + record (SQLite commit) + serialize (response JSON), p50/p99;
   baseline in the same run: the same render with the segment cache disabled (full re-tokenization).
2. over HTTP at 1 and 16 concurrent clients: the proxy's latency minus a bare uvicorn endpoint's
   latency for the same body (the HTTP floor), p50/p99. The proxy runs as `clawbridge serve` runs
   it (`uvicorn_config`, `ProxyServer`'s collector tuning) over a scripted sampler that keeps no
   copy of the prompts it is given.

Run: python bench/proxy_overhead.py [--calls 200] [--rounds 5] [--baseline-src DIR]
(--baseline-src: another checkout's proxy, served by this script with the same settings, measured
in the same rounds, alternating, for before/after.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CODE_ROOT = Path(sys.argv[sys.argv.index("--code-root") + 1]) if "--code-root" in sys.argv else ROOT
"""Whose clawbridge a `--serve` child runs: this tree's, or `--baseline-src`'s under this harness."""
sys.path.insert(0, str(CODE_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import exit_on_sigterm  # noqa: E402

WORDS = ["agent", "tool", "memory", "file", "session", "workspace", "user", "assistant", "call", "result", "error", "retry", "heartbeat", "cron", "channel", "message", "reply", "model", "token", "context", "policy", "skill", "browser", "shell", "search", "read", "write", "edit", "command", "output", "status", "config", "plugin", "provider", "gateway", "node", "process", "permission", "sandbox"]


def openclaw_like_system_prompt(target_bytes: int = 40_000, seed: int = 0) -> str:
    rng = random.Random(seed)
    parts: list[str] = ["You are OpenClaw, a personal agent running on the user's machine.\n"]
    size = len(parts[0])
    section = 0
    while size < target_bytes:
        section += 1
        head = f"\n## Section {section}: {rng.choice(WORDS).title()} {rng.choice(WORDS)}\n"
        body = []
        for _ in range(rng.randint(4, 9)):
            sent = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20)))
            body.append(f"- {sent.capitalize()}.")
        chunk = head + "\n".join(body) + "\n"
        parts.append(chunk)
        size += len(chunk)
    return "".join(parts)[:target_bytes]


def tools(n: int = 12) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        out.append({"type": "function", "function": {
            "name": f"{WORDS[i]}_{WORDS[i + 7]}",
            "description": f"{WORDS[i].title()} the {WORDS[i + 3]} of the current {WORDS[i + 5]} and return it.",
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string", "description": "Where to act."},
                "limit": {"type": "integer", "description": "At most this many items."},
                "mode": {"type": "string", "enum": ["fast", "full", "dry-run"]}}, "required": ["path"]}}})
    return out


def session_requests(n: int, big: bool) -> list[dict[str, Any]]:
    """n requests of one session, each the previous history plus one exchange."""
    system = openclaw_like_system_prompt() if big else "You are a helpful assistant."
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}]
    reqs = []
    for i in range(n):
        msgs = [*msgs, {"role": "user", "content": f"Runtime: note {i}. Please check item {i} in the workspace."}]
        body: dict[str, Any] = {"model": "tiny", "messages": msgs, "stream": False, "max_tokens": 16}
        if big:
            body["tools"] = tools()
        reqs.append(body)
        msgs = [*msgs, {"role": "assistant", "content": f"Checked item {i}: all good."}]
    return reqs


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def fmt(xs: list[float]) -> str:
    return f"p50 {pct(xs, 50) * 1000:7.2f} ms  p99 {pct(xs, 99) * 1000:7.2f} ms"


# ---------------------------------------------------------------------------- in-process


def in_process(model_dir: Path, calls: int) -> dict[str, Any]:
    import orjson

    from clawbridge.chat.render import Renderer, SegmentCache
    from clawbridge.store import Store, TurnRecord

    results: dict[str, Any] = {}
    renderer = Renderer.from_pretrained(str(model_dir))
    cold = Renderer(renderer.tokenizer, cache=SegmentCache(max_entries=1))
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(Path(tmp))
        for big in (True, False):
            reqs = session_requests(calls, big)
            raw = [orjson.dumps(r) for r in reqs]
            label = "40KB+12 tools" if big else "small"
            t_render, t_cold, t_record, t_ser, total = [], [], [], [], []
            n_prompt = 0
            for i, body in enumerate(raw):
                t0 = time.perf_counter()
                data = orjson.loads(body)
                ids = renderer.render(data["messages"], data.get("tools"), None)
                t1 = time.perf_counter()
                resp = {"id": f"chatcmpl-{i}", "object": "chat.completion", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok " * 8}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": 9, "total_tokens": len(ids) + 9}}
                out = orjson.dumps(resp)
                t2 = time.perf_counter()
                now = time.time()
                store.record_turn(TurnRecord(
                    session_id=f"bench-{label}", turn_type="main", status="ok", model="tiny", prompt_token_ids=ids,
                    completion_token_ids=list(range(9)), completion_logprobs=[-0.5] * 9, policy_version=0,
                    finish_reason="stop", request_json=body.decode(), response_json=out.decode(), created_at=now,
                    completed_at=now), "header")
                t3 = time.perf_counter()
                if i >= 3:  # the first calls of a session warm the caches
                    t_render.append(t1 - t0)
                    t_ser.append(t2 - t1)
                    t_record.append(t3 - t2)
                    total.append(t3 - t0)
                    c0 = time.perf_counter()
                    cold_ids = cold.render(data["messages"], data.get("tools"), None)
                    t_cold.append(time.perf_counter() - c0)
                    assert cold_ids == ids, "segment-cached render must equal full tokenization"
                n_prompt = len(ids)
            results[label] = {"prompt_tokens_last": n_prompt, "bytes_last": len(raw[-1]),
                              "render": t_render, "render_full_retokenize": t_cold,
                              "record": t_record, "serialize": t_ser, "total": total}
        store.close()
    return results


# ---------------------------------------------------------------------------- over HTTP


class _Discard(list[list[int]]):
    def append(self, item: list[int]) -> None:
        pass


def serve(mode: str, port: int, model_dir: str, state_dir: str) -> None:
    """Subprocess entry: the real proxy over an instant sampler, or a bare uvicorn floor."""
    import uvicorn

    if mode == "floor":
        # Plain Starlette: FastAPI would resolve these (postponed) annotations against the module's
        # globals, miss the local imports and read `request` as a query parameter (422).
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        answer = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * 8}}]})

        async def echo(request: Request) -> Response:
            json.loads(await request.body())
            return Response(answer, media_type="application/json")

        async def health(request: Request) -> Response:
            return JSONResponse({"status": "ok"})

        app = Starlette(routes=[Route("/v1/chat/completions", echo, methods=["POST"]),
                                Route("/health", health, methods=["GET"])])
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
        return

    from clawbridge.backend import FakeServingBackend, ModelInfo
    from clawbridge.chat.render import Renderer
    from clawbridge.config import Settings
    from clawbridge.proxy.app import build_app
    from clawbridge.server import ProxyServer, build_state, uvicorn_config
    from clawbridge.serving.sampler import FakeSampler

    async def main() -> None:
        r = Renderer.from_pretrained(model_dir)
        script = [*list(r.tokenizer.encode("ok " * 8, add_special_tokens=False)), r.stop_token_ids[0]]
        sampler = FakeSampler(script=script)
        if hasattr(sampler, "keep_prompts"):  # the model's stand-in keeps no copy of every prompt
            sampler.keep_prompts = False
        else:  # an older checkout's fake: same, by discarding what it appends
            sampler.prompts = _Discard()
        backend = FakeServingBackend(sampler, ModelInfo("tiny", model_dir, context_window=32768, max_output_tokens=256))
        settings = Settings(port=port, state_dir=Path(state_dir), model=model_dir, served_model_name="tiny",
                            log_level="warning")
        state = await build_state(settings, backend)
        # As `clawbridge serve` runs it: its uvicorn settings (protocol, limits), its collector tuning.
        config = uvicorn_config(build_app(state), settings)
        try:
            server = ProxyServer(config, Path(state_dir), tune_gc=True)
        except TypeError:  # a checkout from before the collector tuning
            server = ProxyServer(config, Path(state_dir))
        await server.serve()

    asyncio.run(main())


async def drive(base: str, key: str, bodies_per_client: list[list[bytes]]) -> list[float]:
    import httpx

    lat: list[float] = []

    async def client(i: int, bodies: list[bytes]) -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            for j, body in enumerate(bodies):
                t0 = time.perf_counter()
                r = await c.post(f"{base}/v1/chat/completions", content=body,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                                          "X-Session-Id": f"bench-{i}"})
                dt = time.perf_counter() - t0
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
                if j >= 3:
                    lat.append(dt)

    await asyncio.gather(*(client(i, b) for i, b in enumerate(bodies_per_client)))
    return lat


def start_servers(model_dir: Path, tmp: str, baseline_src: Path | None) -> dict[str, tuple[subprocess.Popen[bytes], int, Path]]:
    """The bare floor, this tree's proxy, and (with `baseline_src`) the same proxy from another checkout."""
    from tests.support import free_port, wait_healthy

    roots = {"floor": ROOT, "proxy": ROOT}
    if baseline_src is not None:
        roots["before"] = baseline_src
    procs: dict[str, tuple[subprocess.Popen[bytes], int, Path]] = {}
    for label, code_root in roots.items():
        port = free_port()
        state = Path(tmp) / label
        state.mkdir()
        env = dict(os.environ)
        if label == "before":  # the other checkout's code, served by this harness (same settings)
            env["PYTHONPATH"] = os.pathsep.join(str(code_root / d) for d in ("", "backends/local"))
        procs[label] = (subprocess.Popen([sys.executable, __file__, "--serve", "floor" if label == "floor" else "proxy",
                                          "--code-root", str(code_root), "--port", str(port),
                                          "--model-dir", str(model_dir), "--state-dir", str(state)], env=env),
                        port, state)
    for proc, port, _ in procs.values():
        wait_healthy(f"http://127.0.0.1:{port}", 120, proc)
    return procs


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) of process `pid` so far; 0 where /proc is missing."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def over_http(model_dir: Path, calls: int, rounds: int, baseline_src: Path | None) -> dict[str, Any]:
    """Latencies per case ("40KB+12 tools x16") per server per round, and the server's CPU seconds
    per call ("<server> cpu": less noisy than latency on a shared box); servers alternate within a
    round (and reverse order every other round), so load from the rest of the box hits all alike."""
    import orjson

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        procs = start_servers(model_dir, tmp, baseline_src)
        try:
            for r in range(rounds):
                for big in (True, False):
                    label = "40KB+12 tools" if big else "small"
                    for conc in (1, 16):
                        n = max(8, calls // conc) if conc > 1 else calls
                        bodies = [[orjson.dumps(b) for b in session_requests(n, big)] for _ in range(conc)]
                        order = list(procs) if r % 2 == 0 else list(reversed(procs))
                        for mode in order:
                            proc, port, state = procs[mode]
                            key = (state / "client_key").read_text().strip() if mode != "floor" else "none"
                            cpu0 = cpu_seconds(proc.pid)
                            lat = asyncio.run(drive(f"http://127.0.0.1:{port}", key, bodies))
                            cpu = (cpu_seconds(proc.pid) - cpu0) / sum(map(len, bodies))
                            out.setdefault(f"{label} x{conc}", {}).setdefault(mode, []).append(lat)
                            out[f"{label} x{conc}"].setdefault(mode + " cpu", []).append(cpu)
        finally:
            for proc, _, _ in procs.values():
                proc.terminate()
                proc.wait(15)
    return out


def spread(xs: list[float]) -> str:
    """Median [min-max] of per-round figures, in ms."""
    return f"{statistics.median(xs) * 1000:6.2f} [{min(xs) * 1000:.2f}-{max(xs) * 1000:.2f}]"


def report_http(http: dict[str, Any]) -> None:
    for label, per_mode in http.items():
        floor = per_mode["floor"]
        rounds = len(floor)
        print(f"[http] {label} ({rounds} round(s); median [min-max] over rounds of the per-round figure)")
        print(f"  bare uvicorn floor     p50 {spread([pct(x, 50) for x in floor])}  p99 {spread([pct(x, 99) for x in floor])}"
              f"  server CPU/call {spread(per_mode['floor cpu'])}")
        for mode in ("before", "proxy"):
            if mode not in per_mode:
                continue
            lat = per_mode[mode]
            a50 = [pct(p, 50) - pct(f, 50) for p, f in zip(lat, floor, strict=True)]
            a99 = [pct(p, 99) - pct(f, 99) for p, f in zip(lat, floor, strict=True)]
            name = "proxy (this tree)" if mode == "proxy" else "proxy (--baseline-src)"
            print(f"  {name:22s} added p50 {spread(a50)}  added p99 {spread(a99)}  server CPU/call {spread(per_mode[mode + ' cpu'])}")



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=120, help="calls per session (per client at concurrency 1)")
    ap.add_argument("--serve", choices=["floor", "proxy"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--state-dir", help=argparse.SUPPRESS)
    ap.add_argument("--code-root", help=argparse.SUPPRESS)
    ap.add_argument("--skip-http", action="store_true", help="only the in-process breakdown")
    ap.add_argument("--skip-in-process", action="store_true", help="only the HTTP measurement")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the HTTP measurement; each figure is then the median [min-max] over rounds")
    ap.add_argument("--baseline-src", type=Path,
                    help="a checkout of another revision (e.g. `git worktree add /tmp/base main`): its proxy is "
                         "measured too, served by this script with the same settings, alternating with this "
                         "tree's in every round")
    args = ap.parse_args()
    exit_on_sigterm()
    if args.serve:
        serve(args.serve, args.port, args.model_dir, args.state_dir)
        return

    from clawbridge.devtools.tinymodel import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        print(f"# proxy overhead ({os.cpu_count()} CPUs), model time excluded (instant scripted sampler)\n")
        res = {} if args.skip_in_process else in_process(model_dir, args.calls)
        for label, r in res.items():
            print(f"[in-process] {label}: last request {r['bytes_last']} bytes, {r['prompt_tokens_last']} prompt tokens")
            print(f"  total (parse+render+serialize+record) {fmt(r['total'])}")
            print(f"  render, segment cache            {fmt(r['render'])}")
            print(f"  render, full re-tokenize (base)  {fmt(r['render_full_retokenize'])}"
                  f"   -> cache speed-up x{statistics.median(r['render_full_retokenize']) / statistics.median(r['render']):.1f}")
            print(f"  record (SQLite commit)           {fmt(r['record'])}")
            print(f"  serialize response               {fmt(r['serialize'])}")
        if args.skip_http:
            return
        print()
        report_http(over_http(model_dir, args.calls, args.rounds, args.baseline_src))

if __name__ == "__main__":
    main()
