"""Both Terminal-Bench layouts on the local backend: TB1 loading, adaptation of package installs
and test-runner downloads to the host, refusals with reasons, and a TB2 task's own reward file.
The fixture tasks under tests/fixtures/layouts were written for t1async."""

from __future__ import annotations

import pytest

from t1async.envs.taskio.adapt import adapt_script, classify
from t1async.envs.taskio.loading import load_task
from t1async.envs.taskio.packages import Refusal
from t1async.envs.taskio.pytest_runner import pytest_command
from t1async.envs.taskio.shell_words import split_commands
from t1async.envs.taskio.task import TaskError
from t1async.envs.terminal import TerminalEnv, validate_task
from tests.support import FIXTURES

LAYOUTS = FIXTURES / "layouts"


def test_tb1_task_is_loaded():
    task = load_task(LAYOUTS / "tb1-reverse-lines")
    assert task.layout == "tb1" and task.name == "tb1-reverse-lines"
    assert task.instruction.startswith("The file /app/poem.txt")
    assert (task.agent_timeout_s, task.verifier_timeout_s) == (60.0, 60.0)
    assert task.metadata["difficulty"] == "easy" and task.metadata["tags"] == ["text"]
    assert task.dockerfile == task.path / "Dockerfile" and task.context_dir == task.path
    assert task.test_script == task.path / "run-tests.sh" and task.solution_path == task.path / "solution.sh"
    # ${T_BENCH_TEST_DIR} has the TB1 harness's value; run-specific names (image, logs) are left out
    assert task.compose_env == {"POEM_TITLE": "Ode", "TEST_DIR": "/tests"}
    assert task.local_refusal is None
    assert [s.instruction for s in task.steps] == ["FROM", "WORKDIR", "COPY"]  # the host-provided install is gone
    script = task.local_test_script
    assert "curl" not in script and "uv " not in script and f"{pytest_command('python3')} $TEST_DIR/test_outputs.py -rA" in script
    assert 'if [ "$PWD" = "/" ]; then' in script  # the rest of the script is kept


def test_tb1_oracle_resolves_and_noop_does_not(tmp_path):
    report = validate_task(load_task(LAYOUTS / "tb1-reverse-lines"), tmp_path)
    assert report.ok, report
    assert (report.oracle.passed, report.oracle.total, report.noop.passed) == (4, 4, 2)


def test_tb1_solution_yaml_of_plain_commands_is_replayed_as_the_oracle(tmp_path):
    task = load_task(LAYOUTS / "tb1-keystrokes")
    assert task.solution_path is None and task.solution_refusal is None
    assert task.solution_commands == [("touch /app/marker", 60.0)]
    report = validate_task(task, tmp_path)
    assert report.error is None and report.oracle.resolved and not report.noop.resolved


@pytest.mark.parametrize(("name", "reason"), [
    ("tb1-two-services", "defines 2 services (cache, client)"),
    ("tb2-needs-toolchain", "needs Debian packages the host lacks: t1async-fixture-rust-toolchain"),
])
def test_tasks_the_host_cannot_run_are_refused_with_the_reason(tmp_path, name, reason):
    task = load_task(LAYOUTS / name)
    assert reason in task.local_refusal
    with pytest.raises(TaskError, match="refused by the local sandbox"):
        TerminalEnv(task, root=tmp_path)


def test_tb2_runner_download_uses_host_pytest_and_reward_file_is_read(tmp_path):
    task = load_task(LAYOUTS / "tb2-reward-file")
    assert f"{pytest_command('python3')} -rA /tests/test_state.py" in task.local_test_script
    assert "--ctrf" not in task.local_test_script
    with TerminalEnv(task, root=tmp_path) as env:
        env.reset()
        noop = env.verify()
        assert (noop.passed, noop.total, noop.resolved, noop.task_reward) == (0, 2, False, 0.0)
        env.run_solution()
        done = env.verify()
        assert (done.passed, done.total, done.resolved, done.task_reward) == (2, 2, True, 1.0)


def test_split_commands_respects_quotes_and_substitutions():
    text = "a && b 'x && y' ; c \"$(d; e)\" | f\n# note; not code\ng || h"
    assert [text[s:e].strip() for s, e in split_commands(text)] == [
        "a", "b 'x && y'", "c \"$(d; e)\" | f", "g", "h"]


@pytest.mark.parametrize(("command", "expected"), [
    ("apt-get update", "true"),
    ("apt-get install -y --no-install-recommends bash coreutils", "true"),
    ("rm -rf /var/lib/apt/lists/*", "true"),
    ("pip install pytest", "true"),
    ("python3 -m pip install -q 'packaging>=20'", "true"),
    ("curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh", "true"),
    ("source $HOME/.local/bin/env", "true"),
    ("uv run pytest /tests/test_x.py", f"{pytest_command('python3')} -rA /tests/test_x.py"),
    ("echo hello", None),
    # as written it would import an agent's /app/pytest.py: always the guarded runner
    ("python3 -m pytest -rA /tests", f"{pytest_command('python3')} -rA /tests"),
])
def test_classify_test_script_commands(command, expected):
    assert classify(command, test_script=True, allow_internet=False) == expected


@pytest.mark.parametrize(("command", "reason"), [
    ("apt-get install -y t1async-nonexistent-pkg", "Debian packages the host lacks"),
    ("pip install 'pytest<1'", None),  # a test runner pin is ignored: host pytest
    ("pip install 'numpy==0.0.1'", "Python packages the host lacks"),
    ("wget https://example.com/data.csv", "network access at test time"),
    ("git clone https://example.com/repo.git", "network access"),
    ("apk add curl", "package manager"),
])
def test_classify_refusals(command, reason):
    if reason is None:
        assert classify(command, test_script=True, allow_internet=False) == "true"
        return
    with pytest.raises(Refusal, match=reason):
        classify(command, test_script=True, allow_internet=False)


def test_network_allowed_when_the_task_allows_it():
    assert classify("curl -fsS https://example.com", test_script=False, allow_internet=True) is None
    script = "set -e\nif true; then apt-get update; fi\necho done\n"
    assert adapt_script(script, test_script=False, allow_internet=False) == "set -e\nif true; then true; fi\necho done\n"
