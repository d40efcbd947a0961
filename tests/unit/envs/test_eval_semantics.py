"""``t1async eval`` with the benchmark harnesses' semantics (GitHub issue 26, items 5, 6, 8, 9).

The fixtures under tests/fixtures/eval were written for t1async:

* ``tb2-solution-dir``: a Harbor oracle that reads a sibling file at ``/solution/data.txt``;
* ``tb1-nonblocking``: a TB1 ``solution.yaml`` whose ``block: false`` steps are ordinary commands
  (the harness types the next step ahead; it runs once they end);
* ``tb1-needs-network``: a TB1 oracle that needs network at run time (the TB1 harness gives it);
* ``tb2-agent-server``: tests that query a server the oracle left running (both harnesses keep it);
* ``tb2-script-imports``: tests that run ``python /app/tool.py`` (which imports its sibling) and
  import the agent's module from the working folder, as ``python -m pytest`` from /app allows;
* ``tb2-sparse-file``: a test that creates a 4 GiB sparse file (no file-size rlimit under the
  harnesses; container only: the local sandbox keeps its cap to protect the host's disk);
* ``tb1-broken-pip``: an image whose pip is broken; its tests run pip, so they must see the pip the
  agent left (container only: the local sandbox runs the host's Python).

Each runs on the ``local`` backend (fast) and, marked ``container``, under podman.
"""

from __future__ import annotations

import json
import socket

import pytest

from t1async.cli import main
from t1async.commands.evaluate import run_task
from t1async.config import Config, ConfigError, check_values
from t1async.envs.taskio.loading import load_task, reads_keystrokes
from t1async.envs.taskio.task import TaskRefused
from t1async.envs.terminal import TerminalEnv, network_allowed
from tests.support import FIXTURES
from tests.support.container_support import base_image

EVAL = FIXTURES / "eval"
BACKENDS = ["local", pytest.param("container", marks=pytest.mark.container)]


def _backend(sandbox: str) -> None:
    if sandbox == "container":
        base_image()


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


# ------------------------------------------------------------------- 5: the oracle's folder at /solution


@pytest.mark.parametrize("sandbox", BACKENDS)
def test_tb2_oracle_runs_from_solution_and_the_agent_never_sees_it(tmp_path, sandbox):
    _backend(sandbox)
    task = load_task(EVAL / "tb2-solution-dir")
    with TerminalEnv(task, root=tmp_path / "episodes", sandbox=sandbox, command_timeout_s=60) as env:
        env.reset()
        assert env.step("ls -A /solution 2>/dev/null | wc -l").output.strip() == "0"  # nothing for the agent
        run = env.run_solution()
        assert run.exit_code == 0, run.output
        assert env.step("cat /solution/data.txt").output.strip() == "answer-41c2"
        assert env.step("ls -A /tests | wc -l").output.strip() == "0"  # not left among the tests
        verdict = env.verify()
    assert verdict.resolved, verdict.output


# ------------------------------------------------------------- 6: TB1 block: false steps are replayed


def test_block_false_steps_are_commands_and_a_program_reading_keystrokes_is_refused(tmp_path):
    task = load_task(EVAL / "tb1-nonblocking")
    assert task.solution_refusal is None
    assert [c for c, _ in task.solution_commands] == [
        "printf 'hello\\n' > /app/greeting.txt", "cd /app", "cat greeting.txt > copy.txt"]
    assert [t for _, t in task.solution_commands] == [180.0, 180.0, 60.0]  # block: false waits for the next step
    repl = tmp_path / "repl"
    repl.mkdir()
    for name in ("task.yaml", "run-tests.sh", "Dockerfile"):
        (repl / name).write_text((EVAL / "tb1-nonblocking" / name).read_text())
    (repl / "solution.yaml").write_text("- command: python3\n  block: false\n  append_enter: true\n"
                                        "- command: import os\n  block: false\n  append_enter: true\n")
    refused = load_task(repl)
    assert not refused.solution_commands
    assert "step 2 is typed into the interactive program 'python3'" in refused.solution_refusal


@pytest.mark.parametrize(("command", "program"), [
    ("python", "python"), ("python3 -i x.py", "python3"), ("sqlite3 app.db", "sqlite3"), ("cd /tmp && bash", "bash"),
    ("vim notes.txt", "vim"), ("python3 x.py", None), ("python3 -c 'print(1)'", None), ("echo 1 | python3", None),
    ("python3 < in.py", None), ("python3 &", None), ("sqlite3 app.db 'select 1'", None), ("cd sqlite", None),
    ("man -P cat rencrypt", None), ("printf 'a\\nb' > f", None),
])
def test_reads_keystrokes(command, program):
    assert reads_keystrokes(command) == program


@pytest.mark.parametrize("sandbox", BACKENDS)
def test_tb1_block_false_oracle_resolves(tmp_path, sandbox):
    _backend(sandbox)
    row = run_task(EVAL / "tb1-nonblocking", "oracle", tmp_path, sandbox=sandbox)
    assert (row.error, row.passed, row.total, row.resolved) == (None, 2, 2, True), row


@pytest.mark.parametrize("sandbox", BACKENDS)
def test_tests_run_scripts_and_import_from_the_working_folder_as_under_the_harness(tmp_path, sandbox):
    _backend(sandbox)
    oracle = run_task(EVAL / "tb2-script-imports", "oracle", tmp_path / "oracle", sandbox=sandbox)
    assert (oracle.error, oracle.passed, oracle.total, oracle.resolved) == (None, 2, 2, True), oracle
    noop = run_task(EVAL / "tb2-script-imports", "noop", tmp_path / "noop", sandbox=sandbox)
    assert (noop.passed, noop.total, noop.resolved) == (0, 2, False), noop


@pytest.mark.container
def test_eval_sets_no_file_size_limit_in_a_container_as_the_harnesses(tmp_path):
    base_image()
    oracle = run_task(EVAL / "tb2-sparse-file", "oracle", tmp_path / "oracle", sandbox="container")
    assert (oracle.error, oracle.passed, oracle.total, oracle.resolved) == (None, 2, 2, True), oracle
    noop = run_task(EVAL / "tb2-sparse-file", "noop", tmp_path / "noop", sandbox="container")
    assert (noop.passed, noop.total) == (1, 2), noop  # the sparse file works for the no-op agent too


@pytest.mark.container
def test_tests_see_the_images_pip_not_the_verifier_layers(tmp_path):
    base_image()
    noop = run_task(EVAL / "tb1-broken-pip", "noop", tmp_path / "noop", sandbox="container")
    assert (noop.error, noop.passed, noop.total, noop.resolved) == (None, 0, 1, False), noop
    oracle = run_task(EVAL / "tb1-broken-pip", "oracle", tmp_path / "oracle", sandbox="container")
    assert (oracle.error, oracle.passed, oracle.total, oracle.resolved) == (None, 1, 1, True), oracle


# --------------------------------------------------------------------------------- 8: network per eval


def test_network_modes_follow_the_harness_of_each_layout():
    tb1, tb2 = load_task(EVAL / "tb1-needs-network"), load_task(EVAL / "tb2-solution-dir")
    assert [network_allowed(tb1, m) for m in ("harness", "task", "on", "off")] == [True, False, True, False]
    assert [network_allowed(tb2, m) for m in ("harness", "task", "on", "off")] == [False, False, True, False]
    tb2.allow_internet = True
    assert network_allowed(tb2, "harness") and network_allowed(tb2, "task")
    assert Config().env.network == "task"  # training: only where the task allows it
    cfg = Config()
    cfg.env.network = "maybe"
    with pytest.raises(ConfigError, match="env.network='maybe' is invalid"):
        check_values(cfg)


def test_a_local_refusal_for_network_use_is_lifted_when_the_sandbox_gets_network(tmp_path):
    folder = tmp_path / "tb1-curl"
    (folder / "tests").mkdir(parents=True)
    (folder / "task.yaml").write_text("instruction: Fetch it.\n")
    (folder / "Dockerfile").write_text("FROM python:3.13-slim\nWORKDIR /app\n")
    (folder / "run-tests.sh").write_text("#!/bin/bash\ncurl -fsS https://pypi.org/simple/ > /dev/null\n"
                                         "python3 -m pytest $TEST_DIR/test_outputs.py -rA\n")
    (folder / "tests" / "test_outputs.py").write_text("def test_ok():\n    pass\n")
    planned = load_task(folder)
    assert "needs network access at test time" in planned.local_refusal
    assert load_task(folder, network=True).local_refusal is None
    with pytest.raises(TaskRefused, match="needs network access"):
        TerminalEnv(planned, root=tmp_path / "a", sandbox="local", network="task")
    env = TerminalEnv(planned, root=tmp_path / "b", sandbox="local", network="on")
    assert env.allow_network and env.task.local_refusal is None and planned.local_refusal  # a new plan; the task kept


@pytest.mark.parametrize("sandbox", BACKENDS)
def test_tb1_oracle_gets_network_by_default_and_the_row_says_when_it_was_off(tmp_path, sandbox):
    _backend(sandbox)
    off = run_task(EVAL / "tb1-needs-network", "oracle", tmp_path, sandbox=sandbox, network="off")
    assert (off.network, off.resolved) == ("off", False), off
    assert off.note and "network was off (--network off)" in off.note and "the oracle failed" in off.note, off
    if not _pypi_reachable():
        pytest.skip("pypi.org is not reachable from this host: the network-on half cannot pass here")
    on = run_task(EVAL / "tb1-needs-network", "oracle", tmp_path, sandbox=sandbox)  # default: the TB1 harness's
    assert (on.network, on.error, on.resolved, on.note) == ("on", None, True, None), on


# ----------------------------------------------------------------- 9: the agent's processes are kept


@pytest.mark.parametrize("sandbox", BACKENDS)
def test_eval_keeps_the_agents_server_by_default_and_says_when_it_was_killed(tmp_path, sandbox):
    _backend(sandbox)
    kept = run_task(EVAL / "tb2-agent-server", "oracle", tmp_path, sandbox=sandbox)
    assert (kept.agent_processes, kept.error, kept.resolved) == ("kept", None, True), kept
    killed = run_task(EVAL / "tb2-agent-server", "oracle", tmp_path, sandbox=sandbox, agent_processes="kill")
    assert (killed.agent_processes, killed.resolved) == ("killed", False), killed
    assert killed.note and "were killed before the tests" in killed.note and "Connection refused" in killed.note


def test_eval_cli_flags_reach_the_rows_and_the_report(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["eval", "--tasks", str(EVAL / "tb2-agent-server"), "--agent", "oracle", "--sandbox", "local",
                 "--agent-processes", "kill", "--network", "off", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "note: " in table and "killed before the tests" in table
    doc = json.loads(out.read_text())
    assert doc["settings"] == {"network": "off", "agent_processes": "kill"}
    row = doc["tasks"][0]
    assert (row["network"], row["agent_processes"], row["resolved"]) == ("off", "killed", False)
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--tasks", str(EVAL / "tb2-agent-server"), "--agent", "oracle", "--network", "maybe"])
    assert exit_.value.code == 2
    assert "--network: invalid choice" in capsys.readouterr().err
