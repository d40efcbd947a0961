"""Dependency direction: the core package never imports Ray, the roles or the environment layer.

Only ``t1async/service/launch.py`` (and the CLI through it) wires roles, Ray and environments together
(``t1async/commands/mismatch.py``, a measuring tool, and ``t1async/commands/sft.py``, the warm start, wire a
sampler or the rollout loop and environments in one process, without Ray),
so every core module stays usable in one process (tests) and on a cluster alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "t1async"
ALLOWED = {"service/launch.py", "cli.py", "commands/mismatch.py", "commands/sft.py",  # tools that wire the rollout loop and envs in one process
           "service/service.py",  # the launch process's supervision of the Ray roles (status, restarts, live changes)
           "service/sampler_pool.py",  # the launch process's embedded samplers (live scaling, restarts)
           "service/reaper.py",  # the launch's clean-up process: detaches sandbox mounts (envs.limits) after a kill -9
           "learner/megatron/ranks.py"}  # expert_parallel > 1 only: the megatron backend's other ranks are Ray actors
FORBIDDEN = ("ray", "t1async.actors", "t1async.envs")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_core_modules_do_not_import_ray_roles_or_envs():
    offenders = {}
    for path in sorted(CORE.rglob("*.py")):
        if str(path.relative_to(CORE)) in ALLOWED:
            continue
        bad = [m for m in imported_modules(path) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
        if bad:
            offenders[str(path.relative_to(CORE))] = bad
    assert offenders == {}


def test_the_check_sees_imports():
    assert "ray" in imported_modules(CORE / "service" / "launch.py")
