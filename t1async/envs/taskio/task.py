"""Terminal tasks as data: :class:`Task` (one task folder, either Terminal-Bench layout, read and
planned), :class:`DockerStep` (one parsed Dockerfile instruction) and the errors of task loading.

Loading a folder is :mod:`t1async.envs.taskio.loading` (the layouts are described there); parsing its
Dockerfile is :mod:`t1async.envs.taskio.dockerfile`, its compose file :mod:`t1async.envs.taskio.compose`, and
what each sandbox backend must adapt :mod:`t1async.envs.taskio.adapt`. The shipped tasks live in
``t1async/envs/tasks/*``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..protocol import ServiceSpec

LAYOUT_HINT = "see t1async/envs/tasks/* for the layout"
DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_VERIFIER_TIMEOUT_S = 60.0
DEFAULT_TB1_AGENT_TIMEOUT_S = 360.0
DEFAULT_TB1_TEST_TIMEOUT_S = 60.0
APP = "/app"



class TaskError(ValueError):
    """A task folder is invalid; the message names the folder, what is wrong and what to do."""


class TaskRefused(TaskError):
    """The task is valid but the chosen backend cannot run it faithfully; the message says why."""


@dataclass
class DockerStep:
    """One instruction of the supported Dockerfile subset, parsed.

    Attributes:
        instruction: ``FROM``, ``WORKDIR``, ``ENV``, ``ARG``, ``COPY`` (``ADD`` is read as
            ``COPY``) or ``RUN``.
        args: per instruction: FROM ``(image,)``; WORKDIR ``(absolute path,)``; ENV and ARG
            ``(key, value, key, value, ...)`` with values unexpanded (``$VAR`` is expanded when
            applied); COPY ``(source, ..., destination)`` with sources relative to
            ``environment/`` (globs allowed) and an absolute destination under /app (a trailing
            ``/`` kept); RUN ``(shell command,)``.
        line: 1-based line in the Dockerfile where the instruction starts.
        workdir: the WORKDIR in effect for this step (absolute, /app or under it).
    """

    instruction: str
    args: tuple[str, ...]
    line: int
    workdir: str = APP


@dataclass
class Task:
    """A loaded, validated task.

    Attributes:
        name: ``[task] name`` from task.toml, else the folder name.
        path: the task folder (absolute).
        instruction: text of instruction.md.
        agent_timeout_s: ``[agent] timeout_sec``, seconds (default 600).
        verifier_timeout_s: ``[verifier] timeout_sec``, seconds (default 60).
        allow_internet: ``[environment] allow_internet`` (default False).
        steps: the parsed Dockerfile subset, in order (empty without a Dockerfile, or when the
            local backend refuses the Dockerfile).
        docker_image: ``[environment] docker_image`` or the Dockerfile's FROM.
        metadata: the ``[metadata]`` table (difficulty, category, tags, ...).
        layout: ``"tb2"`` (task.toml) or ``"tb1"`` (task.yaml).
        dockerfile: the Dockerfile (absolute), or None.
        context_dir: the Dockerfile's build context (COPY sources): ``environment/`` (TB2) or the
            task folder (TB1).
        test_script: the verifier script: ``tests/test.sh`` (TB2) or ``run-tests.sh`` (TB1); it
            is staged as ``/tests/<its name>`` and run with bash. A TB1 folder without
            ``run-tests.sh`` gets the harness's default (:data:`TB1_DEFAULT_RUN_TESTS`), as the TB1
            harness does.
        solution: the oracle script (``solution/solve.sh`` or ``solution.sh``), or None.
        solution_refusal: why there is no runnable oracle although the task ships one
            (``solution.yaml``), else None.
        cpus, memory_mb, storage_mb: ``[environment]`` resources (None when not given).
        run_tests_in_same_shell: TB1: run the tests in the agent's shell (its cwd and exported
            variables) instead of a clean one.
        compose_env: variables from docker-compose.yaml's service ``environment`` (TB1/TB2).
        services: the compose file's other services (sidecars such as an API server), which the
            ``container`` backend starts beside the agent's container (see :func:`~t1async.envs.taskio.compose.read_compose`).
        local_refusal: why the ``local`` backend cannot run this task faithfully, else None.
        local_test_script: the test script as the local backend runs it (test-runner downloads
            replaced by the host's pytest; see :mod:`t1async.envs.taskio.adapt`), or None if unchanged.
        notes: what the local adaptation changed (for reports).
        container_test_script: the test script as the container backend runs it (installs moved
            to the verifier layer, the runner mapped; see :func:`t1async.envs.taskio.adapt.plan_container`),
            or None if unchanged.
        local_helpers, container_helpers: the shell scripts of tests/ that the test script runs
            (``source $TEST_DIR/setup-uv-pytest.sh``, ...), adapted for each backend as the test
            script is: ``{path relative to tests/: text}``, only those that changed (see
            :func:`t1async.envs.taskio.adapt.adapt_tests`).
        verifier_needs: what the test script installs (a :class:`~t1async.envs.taskio.adapt.VerifierNeeds`),
            or None without a test script.
        solution_commands: TB1 ``solution.yaml`` steps that are plain commands, replayed one by one
            as the oracle (empty otherwise).
        writable: top-level folders the task writes outside the system ones (e.g. ``/db``), given
            a private tmpfs by the local backend (see :func:`t1async.envs.taskio.adapt.writable_folders`).
        verifier_mode: Harbor's ``[verifier] environment_mode``: ``"shared"`` (the tests run in
            the agent's container, the default) or ``"separate"`` (they run in an image of their
            own, built from ``tests/Dockerfile`` with tests/ as its context, or
            ``[verifier.environment] docker_image``; only :attr:`artifacts` are handed over).
        verifier_image: ``[verifier.environment] docker_image`` ("" when tests/Dockerfile builds it).
        artifacts: absolute paths in the agent's container copied into the separate verifier's
            container at the same paths before its tests run (task.toml's top-level
            ``artifacts``, strings or ``{source = ...}`` tables), plus Harbor's ``/logs/artifacts``.
    """

    name: str
    path: Path
    instruction: str
    agent_timeout_s: float
    verifier_timeout_s: float
    allow_internet: bool
    steps: list[DockerStep]
    docker_image: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    layout: str = "tb2"
    dockerfile: Path | None = None
    context_dir: Path | None = None
    test_script: Path | None = None
    solution: Path | None = None
    solution_refusal: str | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    run_tests_in_same_shell: bool = False
    compose_env: dict[str, str] = field(default_factory=dict)
    services: list[ServiceSpec] = field(default_factory=list)
    local_refusal: str | None = None
    local_test_script: str | None = None
    notes: list[str] = field(default_factory=list)
    container_test_script: str | None = None
    local_helpers: dict[str, str] = field(default_factory=dict)
    container_helpers: dict[str, str] = field(default_factory=dict)
    verifier_needs: Any = None
    solution_commands: list[tuple[str, float]] = field(default_factory=list)
    writable: tuple[str, ...] = ()
    verifier_mode: str = "shared"
    verifier_image: str = ""
    artifacts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.context_dir is None:
            self.context_dir = self.path / "environment"
        if self.test_script is None:
            self.test_script = self.path / "tests" / "test.sh"
        if self.solution is None and self.solution_refusal is None:
            solve = self.path / "solution" / "solve.sh"
            self.solution = solve if solve.is_file() else None

    @property
    def environment_dir(self) -> Path:
        """Build context of COPY/ADD sources (``environment/`` for TB2, the task folder for TB1)."""
        assert self.context_dir is not None
        return self.context_dir

    @property
    def tests_dir(self) -> Path:
        """The verifier files, copied to /tests at verification: ``<task>/tests``."""
        return self.path / "tests"

    @property
    def verifier_dockerfile(self) -> Path | None:
        """``tests/Dockerfile`` of a separate verifier environment, or None."""
        path = self.tests_dir / "Dockerfile"
        return path if self.verifier_mode == "separate" and path.is_file() else None

    @property
    def solution_path(self) -> Path | None:
        """The oracle script, or None (see :attr:`solution_refusal`)."""
        return self.solution


def task_error(path: Path, what: str, todo: str) -> TaskError:
    """The :class:`TaskError` of folder ``path``: what is wrong, what to do, where the layout is described."""
    return TaskError(f"task {path}: {what}; {todo} ({LAYOUT_HINT})")


TB1_DEFAULT_RUN_TESTS = """#!/bin/bash
# t1async: the Terminal-Bench 1 harness's default for a task without run-tests.sh
source $TEST_DIR/setup-uv-pytest.sh
bash $TEST_DIR/run-uv-pytest.sh
"""
"""What a TB1 task without ``run-tests.sh`` is verified with (its helpers are supplied too, see
:mod:`t1async.envs.taskio.adapt`)."""


def test_script_text(task: Task) -> str | None:
    """The text of the task's test script (the TB1 default when the folder has none), or None."""
    assert task.test_script is not None
    if task.test_script.is_file():
        return task.test_script.read_text()
    return TB1_DEFAULT_RUN_TESTS if task.layout == "tb1" else None
