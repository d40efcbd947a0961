"""Packaging: what pyproject.toml declares, the one-line error naming a missing extra, and (slow)
the wheel a plain ``pip install .`` would install: every package, the shipped tasks and the
tokenizer, importable from outside the checkout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

from tests.support import REPO

ROOT = REPO
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def names(reqs: list[str]) -> dict[str, str]:
    """requirement name (lower case) -> the requirement string."""
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower(): r for r in reqs}


def test_requirements_install_next_to_any_torch_and_keep_optional_parts_in_extras():
    deps = names(PROJECT["dependencies"])
    assert "==" not in deps["torch"] and ">=" in deps["torch"]  # a lower bound; the CPU pin is in tools/setup.sh
    setup = (ROOT / "tools" / "setup.sh").read_text()
    assert "torch==2.13.0" in setup and setup.index("torch==2.13.0") < setup.index("-e '.[")  # the CPU build first
    assert re.search(r"-e '\.\[[a-z,]*\]'", setup).group(0) == "-e '.[test,megatron,endpoint,plot]'"
    assert "pyyaml" in deps and "packaging" in deps  # imported by the product (config, control, t1async/envs/taskio/adapt.py)
    assert "pytest" in deps  # the local sandbox runs the tasks' tests with the host's interpreter
    assert PROJECT["requires-python"] == ">=3.11"  # t1async/envs/taskio/task.py imports tomllib
    extras = {k: names(v) for k, v in PROJECT["optional-dependencies"].items()}
    for extra, modules in {"endpoint": ["fastapi", "uvicorn"], "plot": ["matplotlib"], "wandb": ["wandb"]}.items():
        for m in modules:
            assert m not in deps and m in extras[extra] and m in extras["test"]
    assert "ruff" in extras["test"]


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_plot_without_matplotlib_is_one_line_naming_the_extra(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 1.0, "trajectories": 4}) + "\n")
    out = run_python("import sys; sys.modules['matplotlib'] = None\n"  # as if it were not installed
                     "from t1async.cli import main; sys.exit(main(['plot', sys.argv[1]]))", str(tmp_path))
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == ("t1async: error: t1async plot needs matplotlib, which is not "
                                                   "installed: pip install 't1async[plot]'")


def test_the_endpoint_without_fastapi_names_the_extra():
    out = run_python("import sys; sys.modules['fastapi'] = None\n"
                     "from t1async import MissingExtra\n"
                     "try:\n    import t1async.rollout.endpoint\nexcept MissingExtra as e:\n    print(e)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("the agent endpoint (rollout.agent other than builtin) needs fastapi, which is "
                                  "not installed: pip install 't1async[endpoint]'")


def package_dirs() -> dict[str, Path]:
    """Every package of the source tree, by the name it installs under."""
    out = {}
    for init in (ROOT / "t1async").rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT / "t1async")
        if "tasks" in rel.parts or "__pycache__" in rel.parts:
            continue
        out[".".join(["t1async", *rel.parts])] = init.parent
    return out


@pytest.mark.slow
def test_the_wheel_holds_every_package_the_tasks_and_the_tokenizer(tmp_path):
    """``pip wheel --no-deps`` of the checkout (what ``pip install .`` installs), then that wheel
    unpacked alone on sys.path, imported from another folder."""
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            str(ROOT), "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("t1async-*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    for name in package_dirs():
        assert name.replace(".", "/") + "/__init__.py" in files, f"package {name} is not in the wheel"
    assert "t1async/assets/tokenizer.json" in files
    shipped = [p for p in (ROOT / "t1async" / "envs" / "tasks").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert len(shipped) > 20
    missing = [p.relative_to(ROOT).as_posix() for p in shipped
               if "t1async/envs/tasks/" + p.relative_to(ROOT / "t1async" / "envs" / "tasks").as_posix() not in files]
    assert not missing, f"shipped task files not in the wheel: {missing[:10]}"
    assert not any(f.startswith(("actors/", "envs/", "tests/", "tools/")) for f in files)  # no stray top-level names

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = ("import t1async, t1async.actors.learner, t1async.envs.taskio.loading\n"
            "from t1async.actors.rollout import tasks_dir\nfrom t1async.config import EnvConfig\n"
            "from t1async.envs.taskio.loading import discover_tasks\nfrom t1async.models.tokenizer import ChatTokenizer\n"
            "print(t1async.__file__); print(len(discover_tasks(tasks_dir(EnvConfig()), []))); ChatTokenizer.load()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    where, count = out.stdout.split()[:2]
    assert Path(where).is_relative_to(site)  # the wheel's copy, not the checkout's
    assert int(count) == len([p for p in (ROOT / "t1async" / "envs" / "tasks").iterdir() if p.is_dir()])
