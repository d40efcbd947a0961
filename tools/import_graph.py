"""The import graph of t1async's own modules, read with ``ast``: circles and function-level imports.

    python tools/import_graph.py            # circles, then counts
    python tools/import_graph.py --list     # also every function-level import, one a line
    python tools/import_graph.py --check    # exit status 1 when there is a circle

Every ``import`` / ``from ... import`` counts, at module level and inside functions alike (a
function-level import still makes a circle, it only hides it until the call). Nodes are the
modules under ``t1async/`` (task folders excluded); ``from a.b import c`` is an edge to ``a.b.c`` when that is a module,
else to ``a.b``. Relative imports are resolved. A circle is a strongly connected component of
two or more modules (or a module importing itself); each is printed with one shortest cycle.
``tests/house/test_architecture.py`` loads this file for its layer check.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"t1async": REPO / "t1async"}
SKIP_PARTS = {"tasks", "assets", "__pycache__"}


@dataclass
class Import:
    """One import statement's edge: ``source`` imports ``target``; ``line`` in the source file."""

    source: str
    target: str
    line: int
    in_function: bool
    text: str


@dataclass
class Graph:
    """t1async's modules (dotted name -> file) and every import among them (``edges``) or to
    outside libraries (``external``, target is the library's top-level name)."""

    modules: dict[str, Path] = field(default_factory=dict)
    edges: list[Import] = field(default_factory=list)
    external: list[Import] = field(default_factory=list)

    def adjacency(self) -> dict[str, set[str]]:
        adj: dict[str, set[str]] = {m: set() for m in self.modules}
        for e in self.edges:
            adj[e.source].add(e.target)
        return adj


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every product module (packages as their ``__init__``)."""
    out: dict[str, Path] = {}
    for prefix, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if SKIP_PARTS & set(rel.parts[:-1]):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([prefix, *parts])
            out[name] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The product module ``name`` is, or the closest product package above it (None: outside)."""
    while name:
        if name in modules:
            return name
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return None


def _walk(node: ast.AST, in_function: bool = False):
    for child in ast.iter_child_nodes(node):
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        yield from _walk(child, inner)


def build() -> Graph:
    """Parse every product module; resolve its imports to product modules or library names."""
    g = Graph(modules=module_files())
    for name, path in g.modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rsplit(".", 1)[0]
        for node, in_function in _walk(ast.parse(path.read_text(), str(path))):
            text = ast.unparse(node)
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in g.modules else base for a in node.names]
            for t in dict.fromkeys(targets):
                hit = _resolve(t, g.modules)
                if hit is not None:
                    if hit != name or t == name:
                        g.edges.append(Import(name, hit, node.lineno, in_function, text))
                elif t.split(".")[0] != "t1async":
                    g.external.append(Import(name, t.split(".")[0], node.lineno, in_function, text))
    return g


def components(adj: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules, or of one that imports itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(adj[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in adj[v]:
                out.append(sorted(comp))

    for v in sorted(adj):
        if v not in index:
            visit(v)
    return sorted(out)


def shortest_cycle(adj: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One shortest cycle through the component's first module (breadth-first, inside it)."""
    start, inside = comp[0], set(comp)
    prev: dict[str, str | None] = {start: None}
    q = deque([start])
    while q:
        v = q.popleft()
        for w in sorted(adj[v] & inside):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            if w not in prev:
                prev[w] = v
                q.append(w)
    return [start]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print every function-level import")
    ap.add_argument("--check", action="store_true", help="exit 1 when there is a circle")
    a = ap.parse_args(argv)
    g = build()
    adj = g.adjacency()
    circles = components(adj)
    for comp in circles:
        print("circle:", " -> ".join(shortest_cycle(adj, comp)), f"({len(comp)} modules)")
    fn_internal = [e for e in g.edges if e.in_function]
    fn_external = [e for e in g.external if e.in_function]
    by_lib: dict[str, int] = {}
    for e in fn_external:
        by_lib[e.target] = by_lib.get(e.target, 0) + 1
    stmts = {(e.source, e.line) for e in fn_internal + fn_external}
    if a.list:
        for e in sorted(fn_internal + fn_external, key=lambda e: (e.source, e.line)):
            print(f"  {g.modules[e.source].relative_to(REPO)}:{e.line}: {e.text}")
    per_folder: dict[str, int] = {}
    for name, path in g.modules.items():
        folder = str(path.parent.relative_to(REPO))
        per_folder[folder] = per_folder.get(folder, 0) + 1
    largest = max(g.modules.values(), key=lambda p: len(p.read_text().splitlines()))
    print(f"modules: {len(g.modules)} ({', '.join(f'{k}: {v}' for k, v in sorted(per_folder.items()))})")
    print(f"largest: {largest.relative_to(REPO)} ({len(largest.read_text().splitlines())} lines)")
    print(f"circles: {len(circles)}")
    print(f"function-level import statements: {len(stmts)} "
          f"(edges to t1async modules: {len(fn_internal)}, to libraries: {len(fn_external)}"
          + (f"; {', '.join(f'{k} {v}' for k, v in sorted(by_lib.items(), key=lambda kv: -kv[1]))}" if by_lib else "")
          + ")")
    return 1 if a.check and circles else 0


if __name__ == "__main__":
    raise SystemExit(main())
