"""tools/bench_tb_corpus.py's classes for tasks the oracle did not resolve (the table in
docs/terminal-bench.md is made of them)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import FIXTURES
from tests.support.tools import load_tool

corpus = load_tool("bench_tb_corpus")


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


CORPUS = FIXTURES / "corpus"


def test_a_base_image_not_bootstrapped_is_this_machines_setup_not_t1async(tmp_path):
    """Issue 41 item 6: the error of a FROM image that has a stand-in nobody bootstrapped names
    the machine's preparation (class ``setup``, with the command that fixes it), not t1async."""
    real = _tb1(tmp_path, "real", ["coding"], "#!/bin/bash\necho fix > /app/x\n")
    error = ("base image 'python:3.13-slim' is not in local storage: run `t1async images bootstrap` (builds a "
             "Debian trixie stand-in offline) or `podman pull python:3.13-slim`")
    kind, reason = corpus.classify(_row(real, error), tmp_path / "logs", {})
    assert kind == "setup"
    assert "python:3.13-slim" in reason and "t1async images bootstrap --tasks" in reason
    # an image with no stand-in at all stays unreachable
    none = "base image 'node:20' is not in local storage and t1async has no stand-in for it: `podman pull node:20`"
    assert corpus.classify(_row(real, none), tmp_path / "logs", {})[0] == "unreachable"


def test_a_failed_builds_row_claims_no_agent_processes_setting(tmp_path, capsys):
    """Issue 41 item 6: a task whose build failed never ran its tests, so its row says null, not ""
    (which read as a setting)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "build-fails").symlink_to(CORPUS / "build-fails")
    assert corpus.main(["--tasks", str(folder), "--sandbox", "local", "--logs", str(tmp_path / "logs")]) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["rows"]
    assert "Dockerfile:3" in row["error"] and row["class"] == "t1async"
    assert row["agent_processes"] is None and row["network"] == "off"
    assert json.loads((tmp_path / "logs" / "corpus" / "oracle" / "build-fails" / "row.json").read_text())[
        "agent_processes"] is None
