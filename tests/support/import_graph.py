"""The import graph of t1async's own modules, read with ``ast``: circles, upward imports, folder pairs.

Every ``import`` / ``from ... import`` counts, at module level and inside functions alike (a
function-level import still makes a circle, it only hides it until the call). Nodes are the
modules under ``t1async/`` (task folders excluded); ``from a.b import c`` is an edge to ``a.b.c`` when that is a module,
else to ``a.b``. Relative imports are resolved. A circle is a strongly connected component of
two or more modules (or a module importing itself); each is printed with one shortest cycle.

:data:`LAYERS` is the house's layer table: a module may import its own layer and those below it
(:func:`upward_imports` lists the others). :func:`folder_pairs` lists the folders (packages) that
import each other. ``tests/house/test_architecture.py`` asserts all three are empty;
``python tools/import_graph.py`` prints them (a thin CLI over :func:`main`).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("t1async",)
"""The top folders of product modules in a checkout."""
SKIP_PARTS = {"tasks", "assets", "__pycache__"}

LAYERS: list[tuple[str, ...]] = [
    ("t1async.config", "t1async.trajectory", "t1async.fileio"),  # the bottom: config, the wire types, file helpers
    ("t1async.models",),  # the policy, tokenizer, log-prob maths
    ("t1async.transport",),  # ZeroMQ, spool, receive log, ledger, the learner's inbox, keys
    ("t1async.weights", "t1async.sampling"),  # weight sync; the sampler engine, clients, SGLang server
    ("t1async.learner", "t1async.rollout"),  # the update step, estimators, losses, backends; the episode loop, admission
    ("t1async.envs.protocol",),  # the sandbox protocol and its specs (what a task and a backend share)
    ("t1async.envs.taskio",),  # task folders, Dockerfile and compose parsing, per-sandbox plans
    ("t1async.envs.images",),  # container engine, task images, stand-ins
    ("t1async.envs.sandboxes",),  # the sandbox backends and their registry
    ("t1async.envs",),  # an episode's environment (terminal), the verifier
    ("t1async.actors",),  # the Ray roles: wire a library object to Ray
    ("t1async.service", "t1async.commands"),  # launch, supervision; the other commands (eval, synth, sft, ...)
    ("t1async.cli", "t1async.__main__"),  # the console script; python -m t1async
]
"""Layers, lowest first: a module may import its own layer and those below it, never one above.
A module belongs to the layer of the longest prefix that names it."""


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


def module_files(checkout: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> file, for every product module of ``checkout`` (packages as their ``__init__``)."""
    out: dict[str, Path] = {}
    for prefix in ROOTS:
        root = checkout / prefix
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


def build(checkout: Path = REPO) -> Graph:
    """Parse every product module of ``checkout`` (default this one); resolve its imports to product modules or
    library names."""
    g = Graph(modules=module_files(checkout))
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


def layer_of(module: str, layers: list[tuple[str, ...]] = LAYERS) -> int | None:
    """Index in ``layers`` of the longest prefix naming ``module`` (None: not in the table)."""
    best: tuple[int, int] | None = None
    for i, names in enumerate(layers):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[1]):
                best = (i, len(name))
    return None if best is None else best[0]


def upward_imports(graph: Graph, layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    """``source -> target (line N)`` for every import of a product module into a higher layer."""
    out = []
    for e in graph.edges:
        src, dst = layer_of(e.source, layers), layer_of(e.target, layers)
        if dst is not None and src is not None and dst > src:
            out.append(f"{e.source} -> {e.target} (line {e.line}{', in a function' if e.in_function else ''})")
    return out


def folder_of(graph: Graph, module: str) -> str:
    """The folder (dotted package) a module's file lies in: ``t1async.learner`` for ``t1async.learner.loop``,
    ``t1async.envs`` for ``t1async.envs`` itself (its ``__init__``)."""
    return module if graph.modules[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _nested(a: str, b: str) -> bool:
    """Whether one folder is inside the other (a package and one of its own sub-folders)."""
    return a.startswith(b + ".") or b.startswith(a + ".")


def folder_pairs(graph: Graph, nested: bool = False) -> list[tuple[str, str]]:
    """Pairs of folders that import each other (an edge each way between their modules), sorted.

    By default only folders neither of which lies inside the other (two wings, two sub-wings); with
    ``nested`` only a package and its own sub-folder importing each other (a package whose top modules sit
    both below and above its sub-folder: the layer table and the circle check govern those module by
    module). The top folder ``t1async`` is left out: its modules sit at both ends of the layer table (the
    wire types at the bottom, the console script at the top), which :func:`upward_imports` checks one by one."""
    pairs: set[tuple[str, str]] = set()
    for e in graph.edges:
        a, b = folder_of(graph, e.source), folder_of(graph, e.target)
        if a != b and "t1async" not in (a, b):
            pairs.add((a, b))
    return sorted((a, b) for a, b in pairs if a < b and (b, a) in pairs and _nested(a, b) == nested)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print every function-level import")
    ap.add_argument("--root", type=Path, default=REPO, help="the checkout whose t1async/ to read (default this one)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when there is a circle, an upward import or a pair of folders importing each other")
    a = ap.parse_args(argv)
    g = build(a.root)
    root = a.root.resolve()
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
            print(f"  {g.modules[e.source].relative_to(root)}:{e.line}: {e.text}")
    per_folder: dict[str, int] = {}
    for name, path in g.modules.items():
        folder = str(path.parent.relative_to(root))
        per_folder[folder] = per_folder.get(folder, 0) + 1
    largest = max(g.modules.values(), key=lambda p: len(p.read_text().splitlines()))
    print(f"modules: {len(g.modules)} ({', '.join(f'{k}: {v}' for k, v in sorted(per_folder.items()))})")
    print(f"largest: {largest.relative_to(root)} ({len(largest.read_text().splitlines())} lines)")
    upward, pairs, nested = upward_imports(g), folder_pairs(g), folder_pairs(g, nested=True)
    for line in upward:
        print("upward import:", line)
    for low, high in pairs:
        print("folders importing each other:", low, "<->", high)
    for low, high in nested:
        print("a package and its sub-folder importing each other:", low, "<->", high)
    print(f"circles: {len(circles)}")
    print(f"upward imports: {len(upward)} (layer table: LAYERS in tests/support/import_graph.py)")
    print(f"folder pairs importing each other: {len(pairs)} (and a package with its own sub-folder: {len(nested)})")
    print(f"function-level import statements: {len(stmts)} "
          f"(edges to t1async modules: {len(fn_internal)}, to libraries: {len(fn_external)}"
          + (f"; {', '.join(f'{k} {v}' for k, v in sorted(by_lib.items(), key=lambda kv: -kv[1]))}" if by_lib else "")
          + ")")
    return 1 if a.check and (circles or upward or pairs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
