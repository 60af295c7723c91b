"""The package's layering, read from the import graph (static: every `import` in every module,
function-level ones included, so a lazy import cannot hide a dependency).

- The core (everything under `clawbridge/` but `devtools/`, the CLI and the demos, and the three
  backend packages) never imports `clawbridge.devtools`, directly or through another module.
- Nothing in the request path (`clawbridge.proxy`, `clawbridge.server`) imports a fake
  (`Fake*` / `Scripted*` names): fakes live beside their protocols for tests only.
- No import circles (`clawbridge.devtools.imports`): settings at the bottom, the backend registry
  (`clawbridge.plugins`) above them and the backend seam's types, the store's files below the
  store and its health checks.
"""

from __future__ import annotations

import ast
from pathlib import Path

from clawbridge.devtools import imports

PACKAGES = imports.PACKAGES
NOT_CORE = ("clawbridge.devtools", "clawbridge.cli", "clawbridge.__main__")
REQUEST_PATH = ("clawbridge.proxy", "clawbridge.server")


def _modules() -> dict[str, Path]:
    return imports.modules()


def _imports(name: str, path: Path) -> list[tuple[str, str]]:
    """(module, imported name or '') for every import in the file; relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(base, a.name) for a in node.names]
            found += [(f"{base}.{a.name}", "") for a in node.names]  # `from pkg import module`
    return found


def _graph() -> tuple[dict[str, set[str]], dict[str, list[tuple[str, str]]]]:
    modules = _modules()
    raw = {name: _imports(name, path) for name, path in modules.items()}
    edges = {name: {m for m, _ in imps if m in modules} for name, imps in raw.items()}
    return edges, raw


def _is(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_no_import_circles() -> None:
    """No circle among the modules, counting every import (function-local and TYPE_CHECKING ones
    too: a deferred import is still a dependency that runs back up). `python -m
    clawbridge.devtools.imports --all-imports` prints the graph's figures."""
    edges = imports.graph(module_level=False)
    assert len(edges) > 100 and edges["clawbridge.proxy.app"], "the walk saw the tree"
    found = {" -> ".join(imports.a_cycle(c, edges)): c for c in imports.circles(edges)}
    assert found == {}, f"import circles (one loop of each, then its members): {found}"


def test_the_circle_finder_finds_circles() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert imports.circles(edges) == [["a", "b", "c"], ["e"]]
    assert imports.a_cycle(["a", "b", "c"], edges) == ["a", "b", "c", "a"]
    assert imports.back_arrows(edges) == [("a", "b"), ("b", "c"), ("c", "a"), ("e", "e")]


def test_the_core_never_imports_devtools() -> None:
    edges, _ = _graph()
    core = [m for m in edges if not _is(m, NOT_CORE)]
    assert "clawbridge.proxy.app" in core and "clawbridge_local.backend" in core  # the walk saw the tree
    offenders: dict[str, list[str]] = {}
    for start in core:
        seen, todo, parent = {start}, [start], {start: ""}
        while todo:
            cur = todo.pop()
            for nxt in edges[cur]:
                if nxt not in seen:
                    seen.add(nxt)
                    parent[nxt] = cur
                    todo.append(nxt)
        bad = sorted(m for m in seen if _is(m, ("clawbridge.devtools",)))
        if bad:
            chain, cur = [], bad[0]
            while cur:
                chain.append(cur)
                cur = parent[cur]
            offenders[start] = chain[::-1]
    assert offenders == {}, f"core modules reaching clawbridge.devtools (import chain): {offenders}"


def test_devtools_is_where_the_dev_tooling_lives() -> None:
    modules = _modules()
    for name in ("clawbridge.devtools.tinymodel", "clawbridge.devtools.demo", "clawbridge.devtools.judge_server"):
        assert name in modules
    for gone in ("clawbridge.tinymodel", "clawbridge.demo", "clawbridge.rewards.judge_server"):
        assert gone not in modules
    assert (PACKAGES["clawbridge"] / "devtools" / "chat_template.jinja").is_file()
    assert (PACKAGES["clawbridge"] / "devtools" / "tinymodel_words.json").is_file()


def test_nothing_in_the_request_path_imports_a_fake() -> None:
    _, raw = _graph()
    fakes = {
        name: sorted(n for _, n in imps if n.startswith(("Fake", "Scripted")))
        for name, imps in raw.items()
        if _is(name, REQUEST_PATH)
    }
    assert len(fakes) > 10  # the proxy's modules were read
    assert {k: v for k, v in fakes.items() if v} == {}


def test_no_upward_imports() -> None:
    """Rewards read recorded requests through `clawbridge.shapes`, never the proxy; `shapes` and
    `content` sit below the proxy, store and rewards; the local backend's two SGLang modules share
    no private helpers."""
    edges, raw = _graph()
    below = {
        "clawbridge.rewards": ("clawbridge.proxy", "clawbridge.server"),
        "clawbridge.shapes": ("clawbridge.proxy", "clawbridge.store", "clawbridge.rewards", "clawbridge.trainer"),
        "clawbridge.chat.content": ("clawbridge.proxy", "clawbridge.store", "clawbridge.rewards", "clawbridge.trainer"),
    }
    bad = {
        (m, d)
        for layer, above in below.items()
        for m in edges
        if _is(m, (layer,))
        for d in edges[m]
        if _is(d, above)
    }
    assert bad == set()
    sglang = ("clawbridge_local.sglang_engine", "clawbridge_local.sglang_stream")
    private = {
        (m, mod, n)
        for m in sglang
        for mod, n in raw[m]
        if _is(mod, sglang) and mod != m and n.startswith("_")
    }
    assert private == set()
