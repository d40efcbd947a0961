"""Task formats and verifier semantics of published corpora, on the minimal synthetic tasks of
tests/fixtures/corpus/ (issue 41 items 2-5): what the harness would score, the episode scores."""

from __future__ import annotations

import shutil

import pytest

from t1async.commands.evaluate import run_task
from t1async.envs.taskio.adapt import survivable_commands
from t1async.envs.taskio.loading import load_task
from t1async.envs.taskio.task import TaskError, TaskRefused
from t1async.envs.terminal import TerminalEnv
from tests.support import FIXTURES
from tests.support.container_support import base_image

CORPUS = FIXTURES / "corpus"


@pytest.mark.slow
def test_a_verifier_timeout_is_the_agents_failure_trained_as_reward_0(tmp_path):
    """Item 5: the tests wait for what the agent never made; the harness stops them at
    ``[verifier] timeout_sec`` and scores a failure. The episode gets reward 0 and no
    ``verifier_error`` (so the learner trains it); the oracle, which makes it, resolves."""
    task = load_task(CORPUS / "verifier-hangs")
    with TerminalEnv(task, root=tmp_path) as env:
        env.reset()
        hung = env.verify()
        assert hung.timed_out and hung.error is None
        assert (hung.passed, hung.total, hung.reward, hung.resolved) == (0, 1, 0.0, False)
        assert 7.5 < hung.seconds < 30
        env.reset()
        env.run_solution()
        done = env.verify()
    assert done.resolved and not done.timed_out and done.reward == 1.0
    row = run_task(CORPUS / "verifier-hangs", "noop", tmp_path)
    assert (row.passed, row.total, row.error) == (0, 1, None)
    assert row.note == "the verifier timed out after 8 s: scored as a failure (reward 0), as the harnesses score it"


def test_an_apt_line_the_script_survives_is_collected_as_optional(tmp_path):
    """Item 3: without ``set -e`` the test script runs past a failing ``apt-get install`` (a pin
    the archive lacks), so its packages are installed with the failure tolerated; under
    ``set -e`` an unguarded line stops the script, and stays a hard requirement."""
    task = load_task(CORPUS / "apt-pin")
    assert task.verifier_needs.optional_debs == [("jq=1.6-2.1",)] and task.verifier_needs.debs == []
    strict = tmp_path / "apt-pin"
    shutil.copytree(CORPUS / "apt-pin", strict)
    script = (strict / "tests" / "test.sh").read_text()
    (strict / "tests" / "test.sh").write_text(script.replace("apt-get update\n", "set -euo pipefail\napt-get update\n"))
    needs = load_task(strict).verifier_needs
    assert needs.debs == ["jq=1.6-2.1"] and needs.optional_debs == []


@pytest.mark.parametrize("script, expected", [
    ("a\nb\n", [True, True]),
    # set -e; a; b ||; true; c &&; d; if e; then f; fi
    ("set -e\na\nb || true\nc && d\nif e; then f; fi\n", [True, False, True, False, True, False, True, False, False]),
    ("set -eu\nset +e\na\n", [True, False, True]),
    ("set -o errexit\na\n", [True, False]),
])
def test_which_commands_a_script_survives_follows_bash_errexit(script, expected):
    assert survivable_commands(script) == expected


@pytest.mark.container
def test_a_failing_pinned_apt_line_does_not_fail_the_verifier_layer(tmp_path):
    """Item 3 end to end: the verifier layer builds, the tests use the image's jq, the oracle
    resolves and the no-op agent does not (it was "the verifier layer could not be built")."""
    base_image()
    task = load_task(CORPUS / "apt-pin")
    with TerminalEnv(task, root=tmp_path, sandbox="container", network="harness", log_dir=tmp_path / "logs") as env:
        env.reset()
        noop = env.verify()
        env.reset()
        env.run_solution()
        oracle = env.verify()
        layers = env.sandbox.engine.run("history", "--no-trunc", "--format", "{{.CreatedBy}}", env.sandbox.image)
    assert (noop.resolved, noop.error, oracle.resolved) == (False, None, True), oracle.output[-2000:]
    # the pinned line was installed on its own, its failure tolerated (the layer may come from the cache)
    assert "--no-install-recommends jq=1.6-2.1 >/dev/null 2>&1 || echo" in layers.stdout.decode()


def test_a_multi_step_harbor_task_is_refused_in_one_line_naming_what_is_unsupported(tmp_path):
    """Item 4: ``schema_version = "1.1"`` with ``[[steps]]`` and ``steps/<name>/instruction.md``
    was refused as "missing instruction.md; add it", which is wrong advice. It is refused in one
    line naming the format and what t1async does not do; eval reports it and goes on."""
    with pytest.raises(TaskRefused) as refused:
        load_task(CORPUS / "multi-step")
    line = str(refused.value)
    assert "\n" not in line and "missing instruction.md" not in line
    assert "multi-step Harbor task (schema_version 1.1, 2 [[steps]] (create, append)) is not supported" in line
    assert "one instruction and one verifier per episode" in line
    row = run_task(CORPUS / "multi-step", "oracle", tmp_path)
    assert row.error == line and not row.resolved
    # a steps/ folder alone (task.toml without [[steps]]) is the same format
    only_folder = tmp_path / "only-folder"
    shutil.copytree(CORPUS / "multi-step", only_folder)
    (only_folder / "task.toml").write_text('[task]\nname = "x"\n')
    with pytest.raises(TaskRefused, match="a steps/ folder"):
        load_task(only_folder)


def test_a_separate_verifier_environment_is_read_as_harbor_resolves_it(tmp_path):
    """Item 2, loading: the mode, the image definition (tests/Dockerfile) and the artifacts
    (plus Harbor's /logs/artifacts); the local sandbox, which builds no image, refuses in one line."""
    task = load_task(CORPUS / "separate-verifier")
    assert (task.verifier_mode, task.artifacts) == ("separate", ("/logs/artifacts", "/app/answer.txt"))
    assert task.verifier_dockerfile == CORPUS / "separate-verifier" / "tests" / "Dockerfile"
    assert task.verifier_needs is None  # the verifier's image holds what its tests need
    assert "\n" not in task.local_refusal and 'environment_mode = "separate"' in task.local_refusal
    assert "use env.sandbox=container" in task.local_refusal
    row = run_task(CORPUS / "separate-verifier", "oracle", tmp_path)
    assert "refused by the local sandbox" in row.error and not row.resolved
    broken = tmp_path / "broken"
    shutil.copytree(CORPUS / "separate-verifier", broken)
    (broken / "tests" / "Dockerfile").unlink()
    with pytest.raises(TaskError, match="neither tests/Dockerfile nor"):
        load_task(broken)
    (broken / "task.toml").write_text('artifacts = ["app/x"]\n[verifier]\nenvironment_mode = "shared"\n')
    with pytest.raises(TaskError, match="'app/x' is not an absolute path"):
        load_task(broken)


@pytest.mark.container
def test_a_separate_verifier_runs_in_its_own_image_with_only_the_artifacts(tmp_path):
    """Item 2 end to end: the expected answer exists only in the verifier's image, the answer
    only in the agent's container; Harbor resolves the oracle's episode (it scored 0 with no
    error when the tests ran in the agent's container) and not the no-op agent's."""
    base_image()
    task = load_task(CORPUS / "separate-verifier")
    with TerminalEnv(task, root=tmp_path, sandbox="container", network="harness") as env:
        env.reset()
        noop = env.verify()
        env.reset()
        env.step("echo 'a file that is no artifact' > /app/other.txt")
        env.run_solution()
        oracle = env.verify()
        seen = env.step("cat /opt/expected 2>&1; echo; ls /tests 2>&1").output
    assert (noop.resolved, noop.error, noop.task_reward) == (False, None, 0.0), noop.output
    assert (oracle.resolved, oracle.error, oracle.task_reward) == (True, None, 1.0), oracle.output
    assert "No such file" in seen  # the agent's container never had the verifier's files
