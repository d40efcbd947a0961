"""Bad input to ``t1async launch``: one line naming the problem and the fix, exit status 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCAL = str(REPO / "configs" / "local.yaml")


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "t1async.cli", "launch", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=REPO)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("t1async: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0]


def test_missing_config_file():
    assert_one_line_error(run_cli("configs/nope.yaml"), "configs/nope.yaml", "does not exist")


def test_unknown_key_in_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  max_stepz: 2\n")
    assert_one_line_error(run_cli(str(bad)), "learner.max_stepz", "bad.yaml")


def test_wrong_type_override():
    assert_one_line_error(run_cli(LOCAL, "learner.batch_size=lots"), "learner.batch_size", "command line")


def test_invalid_task_directory(tmp_path):
    (tmp_path / "broken-task").mkdir()
    (tmp_path / "broken-task" / "instruction.md").write_text("do it")
    assert_one_line_error(run_cli(LOCAL, f"env.tasks_dir={tmp_path}"), "broken-task", "task.toml")


def test_unknown_task_name():
    assert_one_line_error(run_cli(LOCAL, "env.tasks=[no-such-task]"), "no-such-task")


def test_missing_bubblewrap(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no bwrap on PATH
    assert_one_line_error(run_cli(LOCAL, env=env), "bwrap", "apt-get install bubblewrap")


def test_unwritable_run_dir():
    assert_one_line_error(run_cli(LOCAL, "run.dir=/proc/t1async-run"), "run.dir", "writable")


def test_model_vocab_smaller_than_tokenizer():
    assert_one_line_error(run_cli(LOCAL, "model.vocab_size=100"), "model.vocab_size", "tokenizer")


def test_usage_errors_are_one_line():
    proc = subprocess.run([sys.executable, "-m", "t1async.cli", "launch"], capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, "config", "--help")
    assert "overrides" not in proc.stderr  # optional, not reported as required
