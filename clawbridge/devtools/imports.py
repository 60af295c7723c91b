"""The import graph of clawbridge and its backends, read from the source with `ast`: circles,
arrows that run back up, and module sizes. `tests/test_layers.py` keeps the tree free of circles;
`python -m clawbridge.devtools.imports` prints the figures (docs/architecture.md quotes them).

Definitions:
- An arrow `a -> b`: module `a` imports module `b` at module level (top-level statements, also
  inside a top-level `try`/`if`/`with`, never inside a function, a class body's methods, or an
  `if TYPE_CHECKING:` block: those run later or never, so they cannot close a circle at import).
  `from p import n` is an arrow to `p.n` when that is a module, else to `p`. Arrows to a package's
  parents (whose `__init__` Python runs first) are not counted: every submodule would close a
  circle with its own package.
- A circle: a strongly connected component of two or more modules (or a module importing itself).
- An arrow that runs back up: an arrow inside a circle (removing all of them removes the circles).
- A module's size: its lines.

Invariant: reading the graph imports nothing it reads (pure `ast`), so it works on a broken tree.
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES: Mapping[str, Path] = {
    "clawbridge": ROOT / "clawbridge",
    "clawbridge_local": ROOT / "backends/local/clawbridge_local",
    "clawbridge_tinker": ROOT / "backends/tinker/clawbridge_tinker",
    "clawbridge_fireworks": ROOT / "backends/fireworks/clawbridge_fireworks",
}
"""Top-level package name -> its folder."""


def modules(packages: Mapping[str, Path] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every `.py` file of `packages`."""
    out: dict[str, Path] = {}
    for top, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported (module docstring's rules)."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _module_level(block)
        elif isinstance(node, ast.With):
            yield from _module_level(node.body)


def imported(name: str, path: Path, known: Mapping[str, Path], *, module_level: bool = True) -> set[str]:
    """The modules of `known` that module `name` (file `path`) imports (relative imports resolved);
    `module_level=False`: every import in the file, function-local ones too."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = list(_module_level(tree.body)) if module_level else [
        n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in known:
                found.add(sub)
            elif base in known:
                found.add(base)
    return found


def graph(*, module_level: bool = True, packages: Mapping[str, Path] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules it imports (`imported`)."""
    known = modules(packages)
    return {name: imported(name, path, known, module_level=module_level) for name, path in known.items()}


def circles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with a circle in them, each sorted, largest first (Tarjan,
    iterative so a deep graph never hits the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in edges:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    out.append(sorted(component))
    return sorted(out, key=lambda c: (-len(c), c))


def back_arrows(edges: Mapping[str, set[str]]) -> list[tuple[str, str]]:
    """The arrows inside a circle (module docstring)."""
    where = {m: i for i, c in enumerate(circles(edges)) for m in c}
    return sorted((a, b) for a, bs in edges.items() for b in bs if a in where and where.get(b) == where[a])


def a_cycle(component: list[str], edges: Mapping[str, set[str]]) -> list[str]:
    """One closed path through `component` (for messages): a -> ... -> a."""
    members = set(component)
    path = [component[0]]
    seen = {component[0]: 0}
    while True:
        nxt = sorted(b for b in edges[path[-1]] if b in members)[0]
        if nxt in seen:
            return [*path[seen[nxt]:], nxt]
        seen[nxt] = len(path)
        path.append(nxt)


@dataclass(frozen=True)
class Figures:
    """What `main` prints."""

    modules: int
    arrows: int
    circles: list[list[str]]
    back_arrows: list[tuple[str, str]]
    largest: list[tuple[str, int]]
    """The five largest modules and their lines."""


def figures(*, module_level: bool = True) -> Figures:
    edges = graph(module_level=module_level)
    sizes = sorted(((name, len(path.read_text(encoding="utf-8").splitlines())) for name, path in modules().items()),
                   key=lambda x: -x[1])
    return Figures(len(edges), sum(len(v) for v in edges.values()), circles(edges), back_arrows(edges), sizes[:5])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Circles, arrows back up and module sizes of clawbridge's "
                                                 "import graph (see the module docstring for the definitions).")
    parser.add_argument("--all-imports", action="store_true",
                        help="Count function-local and TYPE_CHECKING imports too (deferred imports).")
    args = parser.parse_args(argv)
    f = figures(module_level=not args.all_imports)
    edges = graph(module_level=not args.all_imports)
    print(f"modules {f.modules}, arrows {f.arrows}, circles {len(f.circles)}, arrows back up {len(f.back_arrows)}")
    for c in f.circles:
        print(f"  circle of {len(c)} ({', '.join(c)}), e.g. {' -> '.join(a_cycle(c, edges))}")
    print("largest modules: " + ", ".join(f"{n} {lines}" for n, lines in f.largest))


if __name__ == "__main__":
    main()
