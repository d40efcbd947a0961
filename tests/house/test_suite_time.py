"""tools/suite_time.py: per-test seconds from a junit file, summed by test and file; bad files are one line."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO
from tests.support.tools import load_tool

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" tests="3">
<testcase classname="tests.unit.learner.test_learner" name="test_a[qwen3_moe]" time="12.5" />
<testcase classname="tests.unit.learner.test_learner.TestGroup" name="test_b" time="0.5" />
<testcase classname="tests.e2e.test_e2e" name="test_launch" time="40.0"><skipped message="no" /></testcase>
</testsuite></testsuites>
"""


def test_node_ids_and_sums_come_from_the_junit_file(tmp_path):
    tool = load_tool("suite_time")
    path = tmp_path / "run.xml"
    path.write_text(JUNIT)
    rows = tool.read_junit(str(path))
    assert rows == [(12.5, "tests/unit/learner/test_learner.py::test_a[qwen3_moe]"),
                    (0.5, "tests/unit/learner/test_learner.py::TestGroup::test_b"),
                    (40.0, "tests/e2e/test_e2e.py::test_launch")]
    out = subprocess.run([sys.executable, "tools/suite_time.py", str(path), "--top", "2"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith("3 tests, 53 s summed")
    assert "over 10 s:    2 tests,     52 s; the rest      0 s" in out[2]
    assert out[out.index("the 2 slowest tests:") + 1].split() == ["40.0", "tests/e2e/test_e2e.py::test_launch"]
    assert out[out.index("the 2 slowest files:") + 1].split() == ["40.0", "tests/e2e/test_e2e.py"]
    assert out[out.index("the 2 slowest files:") + 2].split() == ["13.0", "tests/unit/learner/test_learner.py"]


def test_a_file_that_is_not_junit_is_one_line(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("not xml")
    for path in (bad, tmp_path / "missing.xml"):
        r = subprocess.run([sys.executable, "tools/suite_time.py", str(path)], cwd=REPO, capture_output=True, text=True)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert f"{path} is not a readable junit XML file" in r.stderr.splitlines()[-1]
