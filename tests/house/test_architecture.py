"""Dependency direction: a layer table, no import circles, no folders importing each other, function-level
imports only to defer a library, modules of a readable size.

The product's modules (everything under ``t1async/``) are read with ``ast``
(tests/support/import_graph.py: every import, at module level and inside functions) and each import must
go to the same layer or one below it in its :data:`LAYERS`. No allow-list: a module belongs to the
layer of the longest prefix that names it, and an upward import fails whatever module makes it.
Only the service and command wings (and the CLI above them) may import the Ray roles
(``t1async.actors``); the roles and those wings may import the environments (``t1async.envs``);
nothing below them may, so every library wing stays usable in one process (tests) and on a
cluster alike.

``t1async/envs/`` has its own wings in the table: the sandbox contract at its bottom, then task I/O,
images, the sandbox backends and the episode's environment; the commands that drive them (eval, synth,
decontam) sit with the other commands in ``t1async/commands/``, which may import the Ray roles.
``python tools/import_graph.py`` prints the same counts.
"""

from __future__ import annotations

import functools

import pytest

from tests.support import REPO
from tests.support import import_graph as ig
from tests.support.import_graph import folder_pairs, layer_of, upward_imports

DEFERRABLE = ("torch", "megatron", "transformers", "ray", "omegaconf", "yaml", "matplotlib", "uvicorn", "fastapi",
              "modal", "rich", "loguru")
"""Libraries a function-level import may defer: heavy to import (torch, megatron, transformers, ray;
rich and loguru on the path of ``t1async status`` and ``stop``, which must stay light: issue 42)
or absent where the importing module must still import (optional extras; omegaconf and yaml on a
GPU box that only runs the Megatron check). Each such import says so in a comment naming the library."""


@functools.cache
def _built() -> ig.Graph:
    return ig.build()


def _graph():
    """The import graph, read once per session; a copy, so a test may add edges to it."""
    g = _built()
    return ig, ig.Graph(modules=dict(g.modules), edges=list(g.edges), external=list(g.external))


def checked(module: str) -> bool:
    """A product module (every module of the graph is one: ``t1async`` and below)."""
    return module == "t1async" or module.startswith("t1async.")


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


def test_no_two_folders_import_each_other():
    """No two folders of ``t1async/`` (wings, or sub-wings side by side) import each other (issue 45). A
    package and its own sub-folder are left to the layer table and the circle check, module by module
    (``python tools/import_graph.py`` lists those pairs too)."""
    _, graph = _graph()
    assert folder_pairs(graph) == []


def test_the_megatron_learner_and_its_families_folder_import_one_way():
    """t1async/learner/megatron/families/ (every family's weight layouts, convert.py's qwen3_moe tables among them)
    imports nothing of the learner package above it; the learner imports the families (issue 40: convert.py and
    families/ imported each other)."""
    _, graph = _graph()
    nested = folder_pairs(graph, nested=True)
    assert ("t1async.learner.megatron", "t1async.learner.megatron.families") not in nested, nested


def test_the_folder_check_fails_on_a_back_arrow():
    """The check sees two folders importing each other: a learner module importing the service that
    imports the learner, and a task-I/O module importing the container images built on task I/O."""
    _, graph = _graph()
    graph.edges.append(ig.Import("t1async.learner.loop", "t1async.service.launch", 1, True, "import"))
    graph.edges.append(ig.Import("t1async.envs.taskio.task", "t1async.envs.images.engine", 1, False, "import"))
    assert folder_pairs(graph) == [("t1async.envs.images", "t1async.envs.taskio"), ("t1async.learner", "t1async.service")]


def test_import_graph_cli_prints_zero_circles_upward_imports_and_folder_pairs():
    """``python tools/import_graph.py --check``: the counts the house is judged by, from the thin CLI."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(REPO / "tools" / "import_graph.py"), "--check"], capture_output=True,
                         text=True, cwd="/", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "circles: 0" in lines and any(line.startswith("folder pairs importing each other: 0 ") for line in lines)
    assert any(line.startswith("upward imports: 0 ") for line in lines)


MODULE_MAX_LINES = 700
"""A product module longer than this mixes concerns; split it along them (issue 45)."""


def test_no_product_module_exceeds_700_lines():
    _, graph = _graph()
    assert len(graph.modules) > 100  # the product's modules were found
    long = {str(p.relative_to(REPO)): n for p in graph.modules.values()
            if (n := len(p.read_text().splitlines())) > MODULE_MAX_LINES}
    assert long == {}, f"product modules over {MODULE_MAX_LINES} lines (split along their concerns): {long}"


def test_tests_do_not_import_tools_scripts():
    """What a test needs from a ``tools/`` script lives in the package or in ``tests/support/``; a test of a
    script runs it (``python tools/NAME.py``) or, for its own functions, loads it by path through
    ``tests/support/tools.py`` (issue 45). Neither ``tools`` as a package nor ``tools/`` on ``sys.path``."""
    import re

    pattern = re.compile(r"^\s*(?:from tools\b|import tools\b)|sys\.path\.insert\([^)]*[\"']tools[\"']"
                         r"|spec_from_file_location\([^)]*[\"']tools[\"']", re.M)
    tests = sorted((REPO / "tests").rglob("*.py"))
    assert len(tests) > 50  # the rooms were found
    bad = [str(p.relative_to(REPO)) for p in tests if p.name != "tools.py" and pattern.search(p.read_text())]
    assert bad == []
