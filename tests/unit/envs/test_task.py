"""Task folders: loading, validation errors, and the Dockerfile subset applied by TerminalEnv."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from t1async.envs.taskio.dockerfile import parse_dockerfile
from t1async.envs.taskio.loading import discover_tasks, load_task
from t1async.envs.taskio.task import DockerStep, TaskError, TaskRefused
from t1async.envs.terminal import TerminalEnv, expand_vars, validate_task
from tests.support import FIXTURES

FIXTURES = FIXTURES / "tasks"


def copy_task(tmp_path: Path, name: str = "count-words") -> Path:
    target = tmp_path / "tasks" / name
    shutil.copytree(FIXTURES / name, target)
    return target


def test_load_fixture_task():
    task = load_task(FIXTURES / "hello-env")
    assert task.name == "hello-env" and task.path == (FIXTURES / "hello-env").resolve()
    assert task.instruction.startswith("Write the text")
    assert (task.agent_timeout_s, task.verifier_timeout_s, task.allow_internet) == (30.0, 30.0, False)
    assert task.docker_image == "debian:bookworm-slim"
    assert task.metadata["tags"] == ["test"]
    assert task.solution_path == task.path / "solution" / "solve.sh"
    assert [s.instruction for s in task.steps] == [
        "FROM", "WORKDIR", "ENV", "ENV", "ENV", "COPY", "COPY", "RUN", "WORKDIR", "RUN", "RUN", "RUN", "ENV",
    ]
    assert task.steps[2].args == ("GREETING", "hello", "TARGET", "the world")
    assert task.steps[3].args == ("LEGACY", "value with spaces")
    assert task.steps[6] == DockerStep("COPY", ("data/note.txt", "/app/notes/copied.txt"), 10, "/app")
    assert task.steps[8].args == ("/app/src",)
    assert task.steps[10].args == ("sh -c 'echo exec-form > exec.txt'",) and task.steps[10].workdir == "/app/src"


def test_defaults_without_optional_tables(tmp_path):
    folder = copy_task(tmp_path)
    (folder / "task.toml").write_text("")
    (folder / "environment" / "Dockerfile").unlink()
    task = load_task(folder)
    assert task.name == "count-words" and task.steps == [] and task.allow_internet is False
    assert (task.agent_timeout_s, task.verifier_timeout_s) == (600.0, 60.0)


@pytest.mark.parametrize("missing", ["task.toml", "instruction.md", "tests/test.sh"])
def test_missing_required_file(tmp_path, missing):
    folder = copy_task(tmp_path)
    (folder / missing).unlink()
    with pytest.raises(TaskError) as info:
        load_task(folder)
    message = str(info.value)
    assert str(folder) in message and f"missing {missing}" in message and "see t1async/envs/tasks/*" in message


def test_not_a_folder(tmp_path):
    with pytest.raises(TaskError, match="not a folder"):
        load_task(tmp_path / "nope")


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[task\nname = 'x'", "not valid TOML"),
        ("[agent]\ntimeout_sec = -1", r"\[agent\] timeout_sec = -1 is not a positive number"),
        ("[verifier]\ntimeout_sec = 'soon'", r"\[verifier\] timeout_sec"),
        ("[environment]\nallow_internet = 'yes'", "allow_internet = 'yes' is not a boolean"),
        ("task = 3", r"\[task\] must be a table"),
    ],
)
def test_bad_task_toml(tmp_path, toml, expected):
    folder = copy_task(tmp_path)
    (folder / "task.toml").write_text(toml)
    with pytest.raises(TaskError, match=expected) as info:
        load_task(folder)
    assert str(folder) in str(info.value)


def test_empty_instruction(tmp_path):
    folder = copy_task(tmp_path)
    (folder / "instruction.md").write_text("  \n")
    with pytest.raises(TaskError, match="instruction.md is empty"):
        load_task(folder)


@pytest.mark.parametrize(
    ("dockerfile", "expected"),
    [
        ("FROM x\nCOPY missing.txt /app/\n", r"Dockerfile:2: COPY source 'missing.txt' not found"),
        ("FROM x\nCOPY ../task.toml /app/\n", r"must be relative to the build context and stay inside it"),
        ("FROM x\nENV =bad\n", r"ENV expects KEY=VALUE pairs"),
        ("FROM x\nCOPY input.txt input.txt /app/x\n", r"several sources needs a destination folder"),
    ],
)
def test_bad_dockerfile(tmp_path, dockerfile, expected):
    folder = copy_task(tmp_path)
    (folder / "environment" / "Dockerfile").write_text(dockerfile)
    with pytest.raises(TaskError, match=expected) as info:
        load_task(folder)
    assert str(folder / "environment" / "Dockerfile") in str(info.value)


@pytest.mark.parametrize(
    ("dockerfile", "expected"),
    [
        ("FROM x\nWORKDIR /app\nSHELL [\"/bin/zsh\"]\n", r"Dockerfile:3: unsupported Dockerfile instruction 'SHELL'"),
        ("FROM x\nUSER app\n", r"Dockerfile:2: USER app is not supported"),
        ("FROM x\nWORKDIR /opt\n", r"Dockerfile:2: WORKDIR /opt is outside /app"),
        ("FROM x\nCOPY input.txt /etc/\n", r"COPY destination /etc is outside /app"),
        ("FROM x\nCOPY --from=build input.txt /app/\n", r"flag '--from=build' is not supported"),
        ("FROM x\nADD https://example.com/a.txt /app/\n", r"ADD from a URL .* needs network"),
        ("FROM x\nRUN <<EOF\necho hi\nEOF\n", r"heredocs in RUN are not supported"),
        ("FROM x\nRUN apt-get update && apt-get install -y t1async-no-such-package\n",
         r"needs Debian packages the host lacks: t1async-no-such-package"),
        ("FROM x\nRUN pip install 't1async-no-such-dist==1.0'\n", r"needs Python packages the host lacks: t1async-no-such-dist"),
        ("FROM x\nRUN curl -fsSL https://example.com/x.sh | sh\n", r"needs network access at build time"),
        ("FROM x\nRUN apk add curl\n", r"package manager the local sandbox cannot reproduce"),
    ],
)
def test_locally_refused_dockerfile(tmp_path, dockerfile, expected):
    """Valid for Docker, but not reproducible here: loaded, refused by the local backend with the reason."""
    folder = copy_task(tmp_path)
    (folder / "environment" / "Dockerfile").write_text(dockerfile)
    task = load_task(folder)
    assert task.local_refusal and re.search(expected, task.local_refusal), task.local_refusal
    with pytest.raises(TaskRefused, match=expected):
        TerminalEnv(task, root=tmp_path / "episodes")
    with pytest.raises(TaskRefused, match="refused by the local sandbox"):
        discover_tasks(tmp_path / "tasks")
    assert discover_tasks(tmp_path / "tasks", skip_invalid=True, sandbox="modal")[0].name == "count-words"


def test_ignored_instructions_and_host_provided_packages(tmp_path):
    folder = copy_task(tmp_path)
    (folder / "environment" / "Dockerfile").write_text(
        "FROM x\nLABEL a=b\nEXPOSE 80\nUSER root\nARG GREET=hi\n"
        "RUN apt-get update && apt-get install -y --no-install-recommends bash tmux && rm -rf /var/lib/apt/lists/*\n"
        "RUN pip install --no-cache-dir 'pytest>=7' && echo \"$GREET\" > greet.txt\n"
        "CMD [\"bash\"]\n")
    task = load_task(folder)
    assert task.local_refusal is None
    assert [s.instruction for s in task.steps] == ["FROM", "ARG", "RUN"]  # the all-host install step is dropped
    assert task.steps[-1].args == ("true && echo \"$GREET\" > greet.txt",)
    with TerminalEnv(task, root=tmp_path / "episodes") as env:
        env.reset()
        assert (env.workspace / "greet.txt").read_text() == "hi\n"
        assert env.step("echo \"[$GREET]\"").output == "[]\n"  # ARG is build-time only


def test_dockerfile_continuations_and_forms(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    text = (
        "from img AS base\nRUN echo one \\\n  # a comment inside the continuation\n  && echo two\n"
        "copy [\"a.txt\", \"out/\"]\nWORKDIR sub\nENV A=1 B=\"two words\"\n"
    )
    steps = parse_dockerfile(text, tmp_path)
    assert [(s.instruction, s.args, s.line) for s in steps] == [
        ("FROM", ("img",), 1),
        ("RUN", ("echo one && echo two",), 2),
        ("COPY", ("a.txt", "/app/out/"), 5),
        ("WORKDIR", ("/app/sub",), 6),
        ("ENV", ("A", "1", "B", "two words"), 7),
    ]


def test_discover_tasks(tmp_path):
    copy_task(tmp_path, "count-words")
    copy_task(tmp_path, "hello-env")
    (tmp_path / "tasks" / "broken").mkdir()
    (tmp_path / "tasks" / ".hidden").mkdir()
    with pytest.raises(TaskError, match="broken.*missing task.toml"):
        discover_tasks(tmp_path / "tasks")  # strict by default: a broken folder is named, not skipped
    assert [t.name for t in discover_tasks(tmp_path / "tasks", skip_invalid=True)] == ["count-words", "hello-env"]
    assert [t.name for t in discover_tasks(tmp_path / "tasks", ["hello-env"], skip_invalid=True)] == ["hello-env"]
    with pytest.raises(TaskError, match=r"\['nope'\] not found .*available: \['count-words', 'hello-env'\]"):
        discover_tasks(tmp_path / "tasks", ["nope"], skip_invalid=True)
    with pytest.raises(TaskError, match="missing task.toml"):
        discover_tasks(tmp_path / "tasks", ["broken"], skip_invalid=True)
    with pytest.raises(TaskError, match="no valid task"):
        discover_tasks(tmp_path / "tasks" / "broken")
    with pytest.raises(TaskError, match="does not exist"):
        discover_tasks(tmp_path / "missing")


def test_expand_vars():
    assert expand_vars("/x:$PATH:${HOME}/b:$UNSET.", {"PATH": "/bin", "HOME": "/root"}) == "/x:/bin:/root/b:."


def test_dockerfile_subset_is_applied(tmp_path):
    task = load_task(FIXTURES / "hello-env")
    with TerminalEnv(task, root=tmp_path / "episodes") as env:
        assert env.reset() == task.instruction
        app = env.workspace
        assert (app / "data" / "note.txt").read_text() == "a note\n"  # COPY of a folder's contents
        assert (app / "data" / "sub" / "deep.txt").read_text() == "nested\n"
        assert (app / "notes" / "copied.txt").read_text() == "a note\n"  # COPY file to a new name
        assert (app / "src" / "greeting.txt").read_text() == "hello, the world\n"  # ENV seen by RUN
        assert (app / "src" / "where.txt").read_text() == "/app/src\n"  # RUN in the current WORKDIR
        assert (app / "src" / "exec.txt").read_text() == "exec-form\n"
        assert (app / "src" / "late.txt").read_text() == "unset\n"  # a later ENV is not seen earlier
        shell = env.step('pwd; echo "$GREETING|$TARGET|$LEGACY|$LATE"; mytool')
        assert shell.output == "/app/src\nhello|the world|value with spaces|set\ntool-ran\n"
        episode = env.episode_dir
    assert episode is not None and not episode.exists()


def test_failing_run_step_names_the_line(tmp_path):
    folder = copy_task(tmp_path)
    (folder / "environment" / "Dockerfile").write_text("FROM x\nWORKDIR /app\nRUN echo building && false\n")
    env = TerminalEnv(load_task(folder), root=tmp_path / "episodes")
    with pytest.raises(TaskError, match=r"Dockerfile:3 `RUN echo building && false` failed with exit code 1.*building"):
        env.reset()
    assert env.sandbox is None and list((tmp_path / "episodes").iterdir()) == []


def test_verify_gives_dense_reward_and_ignores_agent_env(tmp_path):
    task = load_task(FIXTURES / "count-words")
    with TerminalEnv(task, root=tmp_path) as env:
        env.reset()
        noop = env.verify()
        assert (noop.passed, noop.total, noop.resolved, noop.reward) == (1, 3, False, 1.0)
        assert noop.error is None and "short test summary info" in noop.output
        # A hostile shell state must not change how the verifier runs.
        env.step("cd /tmp && export PYTEST_ADDOPTS='--collect-only' PYTHONPATH=/nonexistent && echo 5 > /app/count.txt")
        fixed = env.verify()
        assert (fixed.passed, fixed.total, fixed.resolved, fixed.reward) == (3, 3, True, 3.0)
        assert [t.name.rsplit("::", 1)[1] for t in fixed.tests] == [
            "test_input_untouched", "test_count_file_exists", "test_count_value[5]",
        ]
        assert list((env.episode_dir / "tests").iterdir())  # the tests were staged
        assert env.step("ls /tests").output.split() == ["outputs_check.py", "test.sh"]


def test_verifier_timeout_is_reported(tmp_path):
    folder = copy_task(tmp_path)
    (folder / "tests" / "test.sh").write_text("sleep 30\n")
    with TerminalEnv(load_task(folder), root=tmp_path / "episodes", verifier_timeout_s=1.0) as env:
        env.reset()
        result = env.verify()
    assert result.timed_out and result.error is None  # a failure, as the harnesses score it (issue 41 item 5)
    assert not result.resolved and result.exit_code is None and result.reward == 0.0


def test_oracle_and_noop_validation(tmp_path):
    report = validate_task(load_task(FIXTURES / "hello-env"), tmp_path)
    assert report.ok, report
    assert (report.oracle.passed, report.noop.passed, report.oracle_exit_code) == (2, 0, 0)


def test_validation_flags_a_noop_that_resolves(tmp_path):
    folder = copy_task(tmp_path)
    (folder / "tests" / "outputs_check.py").write_text("def test_nothing():\n    pass\n")
    report = validate_task(load_task(folder), tmp_path / "episodes")
    assert report.error is None and report.noop.resolved and not report.ok


@pytest.mark.slow
def test_verify_survives_a_shell_the_agent_broke(tmp_path):
    task = load_task(FIXTURES / "count-words")
    with TerminalEnv(task, root=tmp_path, command_timeout_s=1.0, verifier_timeout_s=20) as env:
        env.reset()
        env.step("echo 5 > count.txt; exec >/dev/null 2>&1")
        result = env.verify()
    assert result.resolved and result.seconds < 10, result
