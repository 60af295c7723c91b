"""Fuzz the proxy from its own OpenAPI document: request bodies generated from each route's JSON
schema (valid-shaped and arbitrary JSON), query parameters from theirs, a few raw byte bodies; every
answer must be below 500 with an error body when it is an error.

By default it starts the real app (uvicorn, SQLite, the tiny model's tokenizer) over a scripted
sampler in this process, so no model time is spent; `--url`/`--key`/`--admin-key` point it at a
running `clawbridge up` instead. Bounded: `--examples` per route and kind. Prints the requests sent,
the status counts and every 5xx; exits 1 if there was any.

Run (about a minute on 2 CPU cores):
    . .venv/bin/activate && python scripts/fuzz_api.py
    python scripts/fuzz_api.py --examples 300    # longer
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

def from_schema(schema: dict[str, Any], root: dict[str, Any] | None = None, depth: int = 0) -> st.SearchStrategy[Any]:
    """Values for the JSON-schema subset pydantic and FastAPI emit ($ref, anyOf, enum/const, objects,
    arrays, scalars with bounds), leaning on the edges (bounds, huge and tiny numbers, empty strings),
    and now and then any JSON in place of a nested value."""
    root = root or schema
    if depth > 4:
        return JSON
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]
        return from_schema(target, root, depth + 1)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, root, depth + 1) for s in schema[key]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        fields = {k: from_schema(v, root, depth + 1) for k, v in props.items()}
        extra = schema.get("additionalProperties")
        base = st.fixed_dictionaries({k: fields[k] for k in props if k in required},
                                     optional={k: fields[k] for k in props if k not in required})
        if isinstance(extra, dict):
            more = st.dictionaries(st.text(max_size=8), from_schema(extra, root, depth + 1), max_size=3)
            return st.tuples(base, more).map(lambda t: {**t[1], **t[0]})
        return base
    if kind == "array":
        items = from_schema(schema.get("items", {}), root, depth + 1)
        lo = schema.get("minItems", 0)
        return st.lists(items, min_size=lo, max_size=max(lo, schema.get("maxItems", lo + 3)))
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=40) | st.sampled_from(["", " ", "default", "\x00"])
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        edges = [v for v in (lo, hi, 0, -1, 2**63, -(2**63) - 1, 10**30) if v is not None]
        return st.integers(min_value=lo, max_value=hi) | st.sampled_from(edges)
    if kind == "number":
        edges = [v for v in (schema.get("minimum"), schema.get("maximum"), schema.get("exclusiveMinimum"),
                             1e-300, 5e-324, 1e308, -0.0) if v is not None]
        return st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(edges)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JSON


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                    max_leaves=20)
RAW = st.sampled_from([b"", b"{", b"[]", b"null", b'{"messages": [}', b"\xff\xfe\x00", b'"x"', b"1e999999"])


class Fuzzer:
    def __init__(self, base: str, key: str, admin_key: str, examples: int) -> None:
        self.http = httpx.Client(base_url=base, timeout=60)
        self.key, self.admin_key, self.examples = key, admin_key, examples
        self.statuses: collections.Counter[int] = collections.Counter()
        self.failures: list[str] = []
        self.sent = 0

    def send(self, method: str, path: str, *, json_body: Any = None, raw: bytes | None = None,
             params: dict[str, Any] | None = None) -> None:
        headers = {"Authorization": f"Bearer {self.admin_key if path.startswith('/rl') else self.key}"}
        if raw is not None or json_body is not None:
            headers["Content-Type"] = "application/json"
        content = raw if raw is not None else None
        r = self.http.request(method, path, json=json_body if raw is None else None, content=content,
                              params=params, headers=headers)
        self.sent += 1
        self.statuses[r.status_code] += 1
        problem = None
        if r.status_code >= 500 and r.status_code not in (502, 503, 504, 507):
            problem = "5xx"
        elif r.status_code >= 500:
            problem = "5xx (model/store side, not expected with the scripted sampler)"
        elif r.status_code >= 400 and "error" not in r.text:
            problem = "error without an error body"
        if problem:
            self.failures.append(f"{problem}: {method} {path} {params or ''} {str(json_body)[:200] if raw is None else raw!r}"
                                 f" -> {r.status_code} {r.text[:200]}")

    def drive(self, strategy: st.SearchStrategy[Any], send: Callable[[Any], None]) -> None:
        """Send `--examples` requests drawn from `strategy` (deterministic: derandomized)."""

        @settings(max_examples=self.examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def run(data: Any) -> None:
            send(data)

        run()

    def run(self, doc: dict[str, Any]) -> None:
        components = doc.get("components", {})
        for path, ops in doc["paths"].items():
            p = path.replace("{session_id}", "fuzz-session").replace("{trajectory_uid}", "traj") \
                    .replace("{prompt_uid}", "prompt")
            for method, op in ops.items():
                m = method.upper()
                body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
                if body is not None:
                    schema = {**body, "components": components}
                    self.drive(from_schema(schema), lambda d, p=p, m=m: self.send(m, p, json_body=d))
                    self.drive(JSON, lambda d, p=p, m=m: self.send(m, p, json_body=d))
                    self.drive(RAW, lambda d, p=p, m=m: self.send(m, p, raw=d))
                params = [q for q in op.get("parameters", []) if q.get("in") == "query"]
                if params and m == "GET":
                    query = st.fixed_dictionaries({}, optional={
                        q["name"]: st.one_of(from_schema(q.get("schema", {})), st.integers(), st.text(max_size=30))
                        for q in params})
                    self.drive(query, lambda d, p=p: self.send("GET", p, params=d))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=60, help="Examples per route and kind (default 60).")
    ap.add_argument("--url", help="A running server's root URL (default: start one in this process).")
    ap.add_argument("--key", default=os.environ.get("CLAWBRIDGE_API_KEY", ""))
    ap.add_argument("--admin-key", default=os.environ.get("CLAWBRIDGE_ADMIN_KEY", ""))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    proxy = None
    if args.url:
        base, key, admin = args.url.rstrip("/"), args.key, args.admin_key
    else:
        from clawbridge.chat.render import Renderer
        from clawbridge.devtools.tinymodel import build_tiny_model
        from tests.fake_proxy import SwitchableSampler, script_for, start_fake_proxy

        tmp = Path(tempfile.mkdtemp(prefix="clawbridge-fuzz-"))
        model = build_tiny_model(tmp / "tiny", seed=0)
        sampler = SwitchableSampler(script=script_for(Renderer.from_pretrained(str(model)), "fuzzed answer"))
        proxy = start_fake_proxy(model, tmp / "state", sampler)
        base, key, admin = proxy.base, str(proxy.state.keys.client), str(proxy.state.keys.admin)
    try:
        doc = httpx.get(f"{base}/openapi.json", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
        fuzzer = Fuzzer(base, key, admin, args.examples)
        fuzzer.run(doc)
    finally:
        if proxy is not None:
            proxy.stop()
    fivexx = sum(n for s, n in fuzzer.statuses.items() if s >= 500)
    print(f"routes: {len(doc['paths'])}; requests sent: {fuzzer.sent}; 5xx: {fivexx}; statuses: "
          + ", ".join(f"{s}: {n}" for s, n in sorted(fuzzer.statuses.items())))
    for line in fuzzer.failures[:30]:
        print("  " + line)
    sys.exit(1 if fuzzer.failures else 0)


if __name__ == "__main__":
    main()
