"""docker-compose.yaml as the Terminal-Bench harnesses read it: Compose interpolation with each
harness's variables, the agent's service found by name or by the harness's image name, builds
outside the compose file's folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from t1async.envs.taskio.compose import ComposeError, harness_variables, interpolate, read_compose
from t1async.envs.taskio.loading import load_task
from t1async.envs.taskio.task import TaskError


@pytest.mark.parametrize("text, expected, unresolved", [
    ("${A}/x", "1/x", set()),
    ("$A-$B", "1-", {"B"}),
    ("${B:-dflt}", "dflt", set()),
    ("${E:-dflt}", "dflt", set()),          # ':-' treats empty as unset
    ("${E-dflt}", "", set()),               # '-' only unset
    ("${A:+alt}|${B:+alt}", "alt|", set()),
    ("$$A ${A}", "$A 1", set()),            # '$$' is a literal '$'
    ("${CONTEXT_DIR}/..", "/ctx/..", set()),
])
def test_interpolate_follows_compose_rules(text, expected, unresolved):
    variables = {"A": "1", "E": "", "CONTEXT_DIR": "/ctx"}
    assert interpolate(text, variables) == (expected, unresolved)


def test_required_variable_that_is_unset_is_an_error():
    with pytest.raises(ComposeError, match=r"\$\{NOPE\} is required \(set me\)"):
        interpolate("${NOPE:?set me}", {})


def _harbor_task(root: Path, compose: str, dockerfile_at: str = "environment/Dockerfile") -> Path:
    task = root / "t"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "app").mkdir()
    (task / "app" / "main.py").write_text("print(1)\n")
    (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 60.0\n')
    (task / "instruction.md").write_text("Do it.\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho ok > /logs/verifier/reward.txt\n")
    (task / dockerfile_at).write_text("FROM debian:bookworm-slim\nWORKDIR /app\nCOPY app/ /app/\n")
    (task / "environment" / "docker-compose.yaml").write_text(compose)
    return task


HARBOR_PARENT_CONTEXT = """\
services:
  main:
    build:
      context: ${CONTEXT_DIR}/..
      dockerfile: ${CONTEXT_DIR}/Dockerfile
    image: ${MAIN_IMAGE_NAME}
    environment:
      - TEST_DIR=${TEST_DIR}
      - LOGS=${HOST_VERIFIER_LOGS_PATH}
    volumes:
      - ${HOST_VERIFIER_LOGS_PATH}:${ENV_VERIFIER_LOGS_PATH}
"""


def test_harbor_build_from_the_task_root_via_context_dir(tmp_path):
    task = load_task(_harbor_task(tmp_path, HARBOR_PARENT_CONTEXT))
    assert task.context_dir == task.path.resolve() and task.dockerfile == (task.path / "environment/Dockerfile").resolve()
    assert [s.instruction for s in task.steps] == ["FROM", "WORKDIR", "COPY"]  # app/ found in the task root
    assert task.docker_image == "debian:bookworm-slim"  # ${MAIN_IMAGE_NAME} is the harness's name: build
    assert task.compose_env == {"TEST_DIR": "/tests"}  # the host log path is run-specific: left out


def test_build_path_with_a_variable_nobody_sets_is_refused_by_name(tmp_path):
    compose = HARBOR_PARENT_CONTEXT.replace("${CONTEXT_DIR}/..", "${MY_ROOT}")
    with pytest.raises(TaskError, match=r"use \$MY_ROOT \(not set by the harness\)"):
        load_task(_harbor_task(tmp_path, compose))


def test_tb1_agent_service_found_by_the_harness_image_name(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (tmp_path / "Dockerfile.mock").write_text("FROM debian:bookworm-slim\n")
    (tmp_path / "docker-compose.yaml").write_text("""\
services:
  mock:
    build: {context: ., dockerfile: Dockerfile.mock}
  webserver:
    build: {dockerfile: Dockerfile}
    image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
    container_name: ${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}
    environment:
      - TEST_DIR=${T_BENCH_TEST_DIR}
""")
    compose = read_compose(tmp_path / "docker-compose.yaml", harness_variables("tb1", tmp_path))
    assert compose.agent_service == "webserver"
    assert [s.name for s in compose.services] == ["mock"]
    assert compose.services[0].dockerfile == (tmp_path / "Dockerfile.mock").resolve()
    assert compose.environment == {"TEST_DIR": "/tests"} and compose.image == ""
    assert compose.dockerfile is None  # the default build: the task's own Dockerfile


def test_several_services_none_the_agents_is_refused(tmp_path):
    (tmp_path / "docker-compose.yaml").write_text("services:\n  a: {image: x}\n  b: {image: y}\n")
    with pytest.raises(ComposeError, match=r"none is the agent's; name the agent's service 'main'"):
        read_compose(tmp_path / "docker-compose.yaml", harness_variables("tb2", tmp_path))
