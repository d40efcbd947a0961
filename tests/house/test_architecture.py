"""Dependency direction: a layer table, no import circles, function-level imports only to defer a library.

The product's modules (everything under ``t1async/``) are read with ``ast``
(tools/import_graph.py: every import, at module level and inside functions) and each import must
go to the same layer or one below it in :data:`LAYERS`. No allow-list: a module belongs to the
layer of the longest prefix that names it, and an upward import fails whatever module makes it.
Only the service and command wings (and the CLI above them) may import the Ray roles
(``t1async.actors``); the roles and those wings may import the environments (``t1async.envs``);
nothing below them may, so every library wing stays usable in one process (tests) and on a
cluster alike.

``t1async/envs/`` has its own wings in the table: the sandbox protocol at its bottom, then task I/O,
images, the sandbox backends and the episode's environment; its commands (eval, synth, decontam)
sit with the other commands, which may import the Ray roles.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.support import REPO

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
    ("t1async.service", "t1async.commands", "t1async.envs.commands"),  # launch, supervision; the other commands
    ("t1async.cli",),  # the console script
]
"""Layers, lowest first: a module may import its own layer and those below it, never one above."""

CHECKED = ("t1async", "t1async.actors", "t1async.envs")
"""Module prefixes whose imports are checked (every product module)."""

DEFERRABLE = ("torch", "megatron", "transformers", "ray", "omegaconf", "yaml", "matplotlib", "uvicorn", "fastapi",
              "modal", "rich", "loguru")
"""Libraries a function-level import may defer: heavy to import (torch, megatron, transformers, ray;
rich and loguru on the path of ``t1async status`` and ``stop``, which must stay light: issue 42)
or absent where the importing module must still import (optional extras; omegaconf and yaml on a
GPU box that only runs the Megatron check). Each such import says so in a comment naming the library."""


def _graph():
    spec = importlib.util.spec_from_file_location("import_graph", REPO / "tools" / "import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = mod
    spec.loader.exec_module(mod)
    return mod, mod.build()


def layer_of(module: str, layers: list[tuple[str, ...]] = LAYERS) -> int | None:
    """Index in ``layers`` of the longest prefix naming ``module`` (None: not in the table)."""
    best: tuple[int, int] | None = None
    for i, names in enumerate(layers):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[1]):
                best = (i, len(name))
    return None if best is None else best[0]


def checked(module: str) -> bool:
    return layer_of(module, [CHECKED]) is not None


def upward_imports(graph, layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    """``source -> target`` for every import of a checked module into a higher layer."""
    out = []
    for e in graph.edges:
        if not checked(e.source):
            continue
        src, dst = layer_of(e.source, layers), layer_of(e.target, layers)
        if dst is not None and src is not None and dst > src:
            out.append(f"{e.source} -> {e.target} (line {e.line}{', in a function' if e.in_function else ''})")
    return out


def test_every_product_module_has_a_layer():
    _, graph = _graph()
    missing = sorted(m for m in graph.modules if checked(m) and m != "t1async" and layer_of(m) is None)
    assert missing == []


def test_no_module_imports_a_higher_layer():
    _, graph = _graph()
    assert upward_imports(graph) == []


def test_the_layer_check_fails_on_an_upward_import():
    """The check sees an import the table forbids (here: the rollout wing importing a Ray role)."""
    ig, graph = _graph()
    graph.edges.append(ig.Import("t1async.rollout.episode", "t1async.actors.rollout", 1, True, "import"))
    graph.edges.append(ig.Import("t1async.models.model", "t1async.learner.rl", 1, False, "import"))
    graph.edges.append(ig.Import("t1async.envs.taskio.task", "t1async.envs.sandboxes.local", 1, False, "import"))
    assert len(upward_imports(graph)) == 3


def test_no_import_circles_among_checked_modules():
    ig, graph = _graph()
    adj = {m: {t for t in ts if checked(t)} for m, ts in graph.adjacency().items() if checked(m)}
    assert [ig.shortest_cycle(adj, c) for c in ig.components(adj)] == []


def test_function_level_imports_only_defer_a_named_library():
    """An import inside a function is allowed only for a library of :data:`DEFERRABLE` (or a
    module of ours that imports one), with a comment on its line or the one above naming it."""
    _, graph = _graph()
    bad = []
    for e in [*graph.edges, *graph.external]:
        if not (e.in_function and checked(e.source)):
            continue
        lines = graph.modules[e.source].read_text().splitlines()
        here = lines[e.line - 1] + " " + (lines[e.line - 2] if e.line > 1 else "")
        comment = here[here.find("#"):] if "#" in here else ""
        if not any(lib in comment for lib in DEFERRABLE) and not (e.target in DEFERRABLE and comment):
            bad.append(f"{graph.modules[e.source].relative_to(REPO)}:{e.line}: {e.text}")
    assert bad == []


@pytest.mark.parametrize("module", ["t1async.learner.update", "t1async.rollout.episode", "t1async.models.model"])
def test_library_wings_do_not_import_ray_roles_or_envs(module):
    _, graph = _graph()
    assert not [e.target for e in graph.edges if e.source == module
                and e.target.startswith(("t1async.actors", "t1async.envs"))]
    assert "ray" not in {e.target for e in graph.external if e.source == module}


ROLE_MAX_LINES = 250
"""A Ray role wires library objects to Ray; one longer than this has grown an algorithm (issue 45)."""


def test_every_ray_role_stays_thin():
    roles = sorted((REPO / "t1async" / "actors").glob("*.py"))
    assert len(roles) >= 5  # __init__, controller, learner, rollout, sampler: the folder was found
    long = {p.name: n for p in roles if (n := len(p.read_text().splitlines())) > ROLE_MAX_LINES}
    assert long == {}, f"Ray roles over {ROLE_MAX_LINES} lines (move what is not wiring into its wing): {long}"
