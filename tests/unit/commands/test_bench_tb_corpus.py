"""tools/bench_tb_corpus.py's classes for tasks the oracle did not resolve (the table in
docs/terminal-bench.md is made of them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.support import REPO

_SPEC = importlib.util.spec_from_file_location("bench_tb_corpus", REPO / "tools" / "bench_tb_corpus.py")
corpus = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(corpus)


def _tb1(root: Path, name: str, tags: list[str], solution: str) -> Path:
    folder = root / name
    (folder / "tests").mkdir(parents=True)
    (folder / "task.yaml").write_text(f"instruction: x\ntags: {tags}\n")
    (folder / "Dockerfile").write_text("FROM python:3.13-slim\nWORKDIR /app\n")
    (folder / "run-tests.sh").write_text("#!/bin/bash\npython3 -m pytest $TEST_DIR/test_outputs.py -rA\n")
    (folder / "tests" / "test_outputs.py").write_text("def test_x():\n    assert False\n")
    (folder / "solution.sh").write_text(solution)
    return folder


def _row(folder: Path, error: str | None = None) -> dict:
    return {"task": folder.name, "folder": str(folder.parent), "resolved": False, "passed": 0, "total": 1, "error": error}


def test_a_task_without_a_real_oracle_is_the_tasks_own_class(tmp_path):
    unverified = _tb1(tmp_path, "unverified", ["coding", "no-verified-solution"], "#!/bin/bash\necho hi\n")
    empty = _tb1(tmp_path, "empty", ["coding"], "#!/bin/bash\n# UNKNOWN\n\n")
    real = _tb1(tmp_path, "real", ["coding"], "#!/bin/bash\n# a comment\necho fix > /app/x\n")
    logs = tmp_path / "logs"
    assert corpus.classify(_row(unverified), logs, {}) == ("task", "its oracle is unverified (tag no-verified-solution)")
    assert corpus.classify(_row(empty), logs, {}) == ("task", "its oracle solution.sh holds no command")
    assert corpus.classify(_row(real), logs, {}) == ("t1async", "0/1 tests")
    assert corpus.classify(_row(real, "pip: Could not resolve host: example.com"), logs, {})[0] == "unreachable"
    assert corpus.classify(_row(real), logs, {"real": ["t1async", "read: X"]}) == ("t1async", "read: X")
