"""How t1async reads the shell scripts of published tasks: shell words as a shell splits them,
a task's own copy (or variant) of the TB1 uv helper pair adapted by what its commands do,
install lines with redirections, the local sandbox's up-front refusals, and a verifier layer
that cannot be built failing the episode instead of passing silently. The fixture task
tests/fixtures/container/tb1-own-helpers was written for t1async."""

from __future__ import annotations

import pytest

from t1async.envs.taskio.adapt import adapt_script, invoked_test_files
from t1async.envs.taskio.loading import load_task
from t1async.envs.taskio.packages import Refusal, VerifierNeeds
from t1async.envs.taskio.pytest_runner import CONTAINER_PYTHON, pytest_command
from t1async.envs.taskio.shell_words import parse_command, split_commands
from t1async.envs.terminal import validate_task
from tests.support import FIXTURES
from tests.support.container_support import base_image

OWN_HELPERS = FIXTURES / "container" / "tb1-own-helpers"


@pytest.mark.parametrize(("text", "assignments", "words", "redirections"), [
    ("python3 -m pip install -q pytest==9.0.3 2>/dev/null", (), ("python3", "-m", "pip", "install", "-q", "pytest==9.0.3"),
     ("2>/dev/null",)),
    ("PIP_NO_INPUT=1 sudo -E -u root pip install 'a b' \"c>=1\" >>log 2>&1", ("PIP_NO_INPUT=1",),
     ("pip", "install", "a b", "c>=1"), (">>log", "2>&1")),
    ("env -i HOME=/root FOO=bar uv add x &>/dev/null", ("HOME=/root", "FOO=bar"), ("uv", "add", "x"), ("&>/dev/null",)),
    ("echo a\\ b 2 > out", (), ("echo", "a b", "2"), (">out",)),  # "2 >" is a word, then a redirection
    ("cat <in >| out", (), ("cat",), ("<in", ">|out")),
    ("timeout 5 nohup pytest -rA # trailing comment", (), ("pytest", "-rA"), ()),
])
def test_simple_commands_are_split_as_a_shell_splits_them(text, assignments, words, redirections):
    stage = parse_command(text).first
    assert (stage.assignments, stage.words, stage.redirections) == (assignments, words, redirections)


def test_expansions_stay_text_and_are_flagged():
    stage = parse_command('pip install "$PKG" $(cat reqs) `echo x`').first
    assert stage.words == ("pip", "install", "$PKG", "$(cat reqs)", "`echo x`") and stage.has_expansion
    assert not parse_command("pip install '$PKG'").first.has_expansion  # single quotes keep $ literal
    piped = parse_command("curl -LsSf https://example.invalid/x.sh | env A=1 sh")
    assert [s.program for s in piped.stages] == ["curl", "sh"] and piped.stages[1].assignments == ("A=1",)


def test_commands_split_on_lists_and_background_but_not_on_redirections():
    text = "a 2>&1 && b &>log || c & d; e | f # g && h\n{ i; }"
    assert [text[s:e].strip() for s, e in split_commands(text)] == ["a 2>&1", "b &>log", "c", "d", "e | f", "{ i", "}"]


def test_redirections_are_never_requirements():
    needs = VerifierNeeds()
    script = "python3 -m pip install -q pytest==9.0.3 2>/dev/null || true\npip3 install \\\n  'six>=1' >/dev/null 2>&1\n"
    adapted = adapt_script(script, test_script=True, allow_internet=False, collect=needs)
    assert needs.requirements == ["pytest==9.0.3", "six>=1"]
    assert adapted.splitlines() == ["true || true", "true"]


def test_a_pip_install_of_a_variable_or_a_path_is_left_to_the_shell():
    needs = VerifierNeeds()
    script = 'pip install "$EXTRA"\npip install ./vendor/pkg\n'
    assert adapt_script(script, test_script=True, allow_internet=False, collect=needs) == script
    assert needs.requirements == []


def test_the_scripts_a_test_script_runs_are_found_through_its_words():
    files = frozenset({"setup-uv-pytest.sh", "run-uv-pytest.sh", "lib/extra.sh", "test_outputs.py"})
    text = ('source $TEST_DIR/setup-uv-pytest.sh\nif true; then bash "${TEST_DIR}/run-uv-pytest.sh"; fi\n'
            '. /tests/lib/extra.sh 2>/dev/null\nbash other.sh\n')
    assert invoked_test_files(text, files) == ["setup-uv-pytest.sh", "run-uv-pytest.sh", "lib/extra.sh"]


def test_a_tasks_own_uv_helpers_are_adapted_by_what_they_do():
    task = load_task(OWN_HELPERS)
    assert task.verifier_needs.optional_debs == [("curl",)]  # no set -e: the helper survives its failure
    assert task.verifier_needs.debs == []
    assert task.verifier_needs.requirements == ["pyzmq>=25", "pytest==8.3.5", "msgpack>=1.0"]
    setup = task.container_helpers["setup-uv-pytest.sh"]
    assert "astral.sh" not in setup and "uv " not in setup and "apt-get" not in setup
    assert 'if [ "$PWD" = "/" ]; then' in setup  # the rest runs as written
    assert task.container_helpers["run-uv-pytest.sh"].splitlines()[-1] == (
        f'{pytest_command(CONTAINER_PYTHON)} "$TEST_DIR/test_outputs.py" -rA')
    assert "true || true" in task.container_test_script  # the pip line, whose packages the layer holds
    # the local flavour: the same scripts, checked against the host's packages instead
    assert task.local_refusal is None
    last = task.local_helpers["run-uv-pytest.sh"].splitlines()[-1]
    assert last == f'{pytest_command("python3")} "$TEST_DIR/test_outputs.py" -rA'
    assert "uv add" not in task.local_helpers["setup-uv-pytest.sh"]


@pytest.mark.parametrize(("command", "what"), [
    ("mkdir -p /opt/tool && cp tool.sh /opt/tool/", "/opt/tool"),
    ("cp run.sh /usr/local/bin/ && chmod +x /usr/local/bin/run.sh", "/usr/local/bin/"),
    ("echo 'x=1' > /etc/tool.conf", "/etc/tool.conf"),
    ("useradd -m worker", "/etc/passwd"),
    ("tar -xzf data.tgz -C /srv", "/srv"),
])
def test_the_local_sandbox_refuses_a_system_write_up_front(command, what):
    with pytest.raises(Refusal, match=f"writes {what}"):
        adapt_script(command, test_script=False, allow_internet=True)


def test_writes_inside_the_workspace_and_reads_from_the_system_are_fine():
    for command in ("mkdir -p /app/data && cp /usr/share/dict/words /app/", "sed 's/a/b/' /etc/hosts > /app/h",
                    "echo x 2>/dev/null", "mkdir -p /var/tmp/cache"):
        assert adapt_script(command, test_script=False, allow_internet=True) == command


def test_the_local_sandbox_refuses_a_test_scripts_virtual_environment():
    with pytest.raises(Refusal, match="creates a Python virtual environment"):
        adapt_script("python3 -m venv /tmp/v && /tmp/v/bin/pip install pytest\n", test_script=True, allow_internet=True)


@pytest.mark.parametrize("sandbox", ["local", pytest.param("container", marks=pytest.mark.container)])
def test_own_helpers_resolve_with_the_oracle_and_not_without(sandbox, tmp_path):
    if sandbox == "container":
        base_image()
    report = validate_task(load_task(OWN_HELPERS), tmp_path, sandbox=sandbox)
    assert report.error is None, report.error
    assert report.oracle.resolved and report.oracle.total == 2, report.oracle.output
    assert not report.noop.resolved and report.noop.total == 2


@pytest.mark.container
def test_a_verifier_layer_that_cannot_be_built_is_the_rows_error(tmp_path):
    base_image()
    folder = tmp_path / "task"
    (folder / "tests").mkdir(parents=True)
    (folder / "task.yaml").write_text("instruction: nothing\n")
    (folder / "Dockerfile").write_text("FROM python:3.13-slim\nWORKDIR /app\n")
    (folder / "solution.sh").write_text("true\n")
    (folder / "run-tests.sh").write_text("set -e\napt-get install -y t1async-no-such-debian-package\n"  # set -e: fatal line
                                         "python3 -m pytest $TEST_DIR/test_outputs.py -rA\n")
    (folder / "tests" / "test_outputs.py").write_text("def test_x():\n    pass\n")
    report = validate_task(load_task(folder), tmp_path / "episodes", sandbox="container")
    assert report.error is not None and "verifier layer" in report.error
    assert "t1async-no-such-debian-package" in report.error
