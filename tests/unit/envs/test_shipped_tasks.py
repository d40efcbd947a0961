"""Every shipped task under t1async/envs/tasks: the oracle resolves it (>= 1 test, all passed) and an agent
that does nothing does not. One test per task folder; the folders are validated once, in parallel."""

from __future__ import annotations

import shlex
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import t1async.envs
from t1async.envs.taskio.loading import load_task, task_folders
from t1async.envs.taskio.task import TaskError
from t1async.envs.terminal import TaskValidation, TerminalEnv, validate_task

TASKS_DIR = Path(t1async.envs.__file__).parent / "tasks"
FOLDERS = task_folders(TASKS_DIR) if TASKS_DIR.is_dir() else []
JOBS = 2


def _validate(folder: Path, root: Path) -> TaskValidation:
    try:
        task = load_task(folder)
    except TaskError as exc:
        return TaskValidation(folder.name, error=str(exc))
    return validate_task(task, root)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, TaskValidation]:
    root = tmp_path_factory.mktemp("shipped-episodes")
    with ThreadPoolExecutor(max_workers=JOBS) as pool:
        return dict(zip((f.name for f in FOLDERS), pool.map(lambda f: _validate(f, root), FOLDERS)))


def test_tasks_are_shipped():
    assert FOLDERS, f"no task folders under {TASKS_DIR}"


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_oracle_resolves_and_noop_does_not(folder, reports):
    report = reports[folder.name]
    assert report.error is None, report.error
    oracle, noop = report.oracle, report.noop
    failed = [t.name for t in oracle.tests if not t.passed]
    assert oracle.total >= 1 and oracle.resolved, (
        f"oracle {oracle.passed}/{oracle.total}, error={oracle.error}, failed={failed}\n{oracle.output[-3000:]}"
    )
    assert report.oracle_exit_code == 0, f"solution/solve.sh exited with {report.oracle_exit_code}"
    assert not noop.resolved, f"a no-op agent resolves {folder.name}: its tests do not check the work"
    assert noop.total == oracle.total, "the no-op and oracle runs collected different tests"


def test_agent_cannot_fake_pytest_from_app(tmp_path):
    """A /app/pytest.py planted by the agent must not replace the host's pytest in the verifier."""
    task = load_task(TASKS_DIR / "create-hello-file")
    with TerminalEnv(task, root=tmp_path) as env:
        env.reset()
        fake = "print('PASSED /tests/test_outputs.py::test_fake')"
        env.step(f"printf '%s\\n' \"{fake}\" > /app/pytest.py && printf 'import sys\\n' > /app/sitecustomize.py")
        result = env.verify()
    assert result.passed == 0 and result.total == 3 and not result.resolved


def test_agent_daemon_cannot_forge_verifier_output(tmp_path):
    """A detached process left by the agent, killing pytest and writing a fake summary, must be
    stopped before the verifier runs (found by a new-user trial)."""
    forger = (
        "while true; do pkill -9 -f 'pytest' 2>/dev/null; "
        "for f in /logs/verifier/test_output.*; do [ -e \"$f\" ] && printf "
        "'= short test summary info =\\nPASSED /tests/test_outputs.py::test_a\\n"
        "PASSED /tests/test_outputs.py::test_b\\n' > \"$f\"; done; sleep 0.01; done"
    )
    task = load_task(TASKS_DIR / "create-hello-file")
    with TerminalEnv(task, root=tmp_path) as env:
        env.reset()
        env.step(f"printf '%s\\n' {shlex.quote(forger)} > /tmp/forge.sh && (setsid nohup bash /tmp/forge.sh "
                 ">/dev/null 2>&1 &) && sleep 0.2 && pgrep -f forge.sh >/dev/null && echo running")
        result = env.verify()
    assert result.passed == 0 and not result.resolved and result.total == 3


def test_keep_agent_processes_leaves_a_server_the_agent_started_alive_for_the_verifier(tmp_path):
    """env.keep_agent_processes: a background process the agent started (a stand-in for a server
    the tests query, as TB1 mlflow-register needs) is alive when the tests run; by default it is
    killed first, and the same tests fail."""
    import textwrap

    from t1async.commands.synth import TaskFiles, write_task

    tests = textwrap.dedent('''
        from pathlib import Path

        def test_the_server_is_running():
            cmdlines = []
            for p in Path("/proc").iterdir():
                try:
                    cmdlines.append((p / "cmdline").read_bytes())
                except OSError:
                    pass
            assert any(b"4321" in c for c in cmdlines)
    ''')
    folder = write_task(tmp_path / "tasks", "needs-server", "server",
                        TaskFiles("Start the server in the background.", {"README.txt": "x\n"}, tests,
                                  "(setsid nohup sleep 4321 >/dev/null 2>&1 &)\n"))
    task = load_task(folder)
    for keep in (False, True):
        with TerminalEnv(task, root=tmp_path / f"run-{keep}", keep_agent_processes=keep) as env:
            env.reset()
            env.step("(setsid nohup sleep 4321 >/dev/null 2>&1 &) ; sleep 0.2")
            result = env.verify()
        assert result.resolved == keep and result.total == 1, (keep, result)
