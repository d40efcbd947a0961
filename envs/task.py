"""Terminal tasks: loading a task folder in either Terminal-Bench layout.

Terminal-Bench 2 / Harbor layout::

    task.toml               [task] name; [metadata] difficulty, category, tags; [verifier] timeout_sec;
                            [agent] timeout_sec; [environment] docker_image, cpus, memory_mb,
                            storage_mb, allow_internet
    instruction.md          what the agent is asked to do
    environment/Dockerfile  optional (missing means an empty /app); files that COPY/ADD refer to
    tests/test.sh           the verifier, run as ``bash /tests/test.sh``; it may also write the task's
                            own reward to /logs/verifier/reward.txt or reward.json
    tests/...               e.g. test_outputs.py
    solution/solve.sh       optional oracle solution

Terminal-Bench 1 layout (:func:`load_tb1_task`)::

    task.yaml               instruction, difficulty, max_agent_timeout_sec (360),
                            max_test_timeout_sec (60), parser_name (pytest), run_tests_in_same_shell
    Dockerfile, docker-compose.yaml   the image (build context: the task folder); the ``client``
                            service is the agent's, others run beside it (container backend)
    run-tests.sh            the verifier, staged as /tests/run-tests.sh with tests/ (TEST_DIR=/tests)
    tests/...               e.g. test_outputs.py
    solution.sh             optional oracle; solution.yaml steps are replayed as commands (keystrokes
                            and steps typed into a still-running interactive program are refused)

Loading never depends on the backend: what only the ``local`` backend cannot do (a Dockerfile
instruction outside the supported subset, packages the host lacks, network at build or test time,
several containers) is recorded in :attr:`Task.local_refusal` (see :mod:`t1async.envs.adapt`), and
the local backend refuses such a task with that reason instead of running it wrong. A folder that
is invalid in itself (missing files, bad TOML/YAML, a Dockerfile that names missing files) raises
:class:`TaskError`. The shipped tasks live in ``envs/tasks/*``.
"""

from __future__ import annotations

import glob
import json
import posixpath
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib
from loguru import logger

from .protocol import ServiceSpec
from .shell_words import parse_command, split_commands

LAYOUT_HINT = "see envs/tasks/* for the layout"
DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_VERIFIER_TIMEOUT_S = 60.0
DEFAULT_TB1_AGENT_TIMEOUT_S = 360.0
DEFAULT_TB1_TEST_TIMEOUT_S = 60.0
SUPPORTED_INSTRUCTIONS = ("FROM", "WORKDIR", "ENV", "ARG", "COPY", "ADD", "RUN")
IGNORED_INSTRUCTIONS = ("CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK",
                        "VOLUME", "ONBUILD")
"""Instructions that do not change the image's files or the shell's environment: accepted, ignored."""
APP = "/app"

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ARCHIVE = re.compile(r"\.(tar|tgz|tbz2?|txz|tar\.(gz|bz2|xz|zst))$")


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
            ``container`` backend starts beside the agent's container (see :func:`_read_compose`).
        local_refusal: why the ``local`` backend cannot run this task faithfully, else None.
        local_test_script: the test script as the local backend runs it (test-runner downloads
            replaced by the host's pytest; see :mod:`t1async.envs.adapt`), or None if unchanged.
        notes: what the local adaptation changed (for reports).
        container_test_script: the test script as the container backend runs it (installs moved
            to the verifier layer, the runner mapped; see :func:`t1async.envs.adapt.plan_container`),
            or None if unchanged.
        local_helpers, container_helpers: the shell scripts of tests/ that the test script runs
            (``source $TEST_DIR/setup-uv-pytest.sh``, ...), adapted for each backend as the test
            script is: ``{path relative to tests/: text}``, only those that changed (see
            :func:`t1async.envs.adapt.adapt_tests`).
        verifier_needs: what the test script installs (a :class:`~t1async.envs.adapt.VerifierNeeds`),
            or None without a test script.
        solution_commands: TB1 ``solution.yaml`` steps that are plain commands, replayed one by one
            as the oracle (empty otherwise).
        writable: top-level folders the task writes outside the system ones (e.g. ``/db``), given
            a private tmpfs by the local backend (see :func:`t1async.envs.adapt.writable_folders`).
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
    def solution_path(self) -> Path | None:
        """The oracle script, or None (see :attr:`solution_refusal`)."""
        return self.solution


def _error(path: Path, what: str, todo: str) -> TaskError:
    return TaskError(f"task {path}: {what}; {todo} ({LAYOUT_HINT})")


_HEREDOC_START = re.compile(r"(?<!<)<<(-?)\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2")


def heredoc_terminators(line: str) -> list[tuple[str, bool]]:
    """The heredocs a ``RUN``/``COPY``/``ADD`` line opens, in order: (terminator word, strip
    leading tabs (``<<-``)); empty for other instructions or when it opens none."""
    word = line.strip().partition(" ")[0].upper()
    if word not in ("RUN", "COPY", "ADD"):
        return []
    return [(m.group(3), m.group(1) == "-") for m in _HEREDOC_START.finditer(line)]


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join ``\\`` continuations, drop comments and blank lines: [(first line number, text)].
    A line that opens heredocs (:func:`heredoc_terminators`) keeps their bodies and terminator
    lines verbatim after it, joined with newlines (comments inside a body are kept)."""
    out: list[tuple[int, str]] = []
    parts: list[str] = []
    start = 0
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        number, raw = index + 1, lines[index]
        index += 1
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not parts):
            continue  # comments vanish even inside a continuation, as in Docker
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(raw.rstrip()[:-1])
            continue
        parts.append(raw)
        logical = " ".join(p.strip() for p in parts if p.strip())
        parts = []
        for terminator, strip_tabs in heredoc_terminators(logical):
            body = []
            while index < len(lines):
                line = lines[index]
                index += 1
                body.append(line)
                if (line.lstrip("\t") if strip_tabs else line) == terminator:
                    break
            logical += "\n" + "\n".join(body)
        out.append((start, logical))
    if parts:
        out.append((start, " ".join(p.strip() for p in parts if p.strip())))
    return out


def _under_app(path: str) -> bool:
    return path == APP or path.startswith(APP + "/")


def _json_or_shell_words(text: str) -> list[str] | None:
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        return None
    return shlex.split(text)


def parse_dockerfile(text: str, context_dir: Path, *, where: str = "Dockerfile") -> list[DockerStep]:
    """Parse the supported Dockerfile subset and check it against ``context_dir``.

    Supported: ``FROM`` (recorded, ignored locally); ``WORKDIR`` (must be /app or under it;
    relative to the current one); ``ENV K=V ...`` and ``ENV K V``; ``ARG K[=default]`` (seen by
    later RUN steps only); ``COPY``/``ADD <src>... <dst>`` (sources inside ``context_dir``, globs
    allowed; destination under /app, relative to WORKDIR; ``--chown``/``--chmod``/``--link`` flags
    ignored; no URLs or archives for ADD); ``RUN`` in shell or JSON form (no heredocs); ``USER
    root``. :data:`IGNORED_INSTRUCTIONS` are accepted and ignored. Line continuations and comments
    as in Docker.

    Raises:
        TaskRefused: a valid instruction the local sandbox cannot reproduce (another USER or
            SHELL, WORKDIR or COPY outside /app, multi-stage COPY, ADD from a URL or of an
            archive, RUN heredocs); the message names ``where``, the line and the reason.
        TaskError: the Dockerfile is malformed or names missing files.
    """
    steps: list[DockerStep] = []
    workdir = APP
    for line, logical in _logical_lines(text):
        word, _, rest = logical.strip().partition(" ")
        instruction, rest = word.upper(), rest.strip()
        at = f"{where}:{line}"
        if instruction in IGNORED_INSTRUCTIONS:
            continue
        if instruction == "USER":
            if rest.split(":")[0] in ("root", "0"):
                continue
            raise TaskRefused(f"{at}: USER {rest} is not supported by the local sandbox (it has one unprivileged user)")
        if instruction not in SUPPORTED_INSTRUCTIONS:
            raise TaskRefused(
                f"{at}: unsupported Dockerfile instruction {word!r} in {logical!r}; the local sandbox "
                f"supports only {', '.join(SUPPORTED_INSTRUCTIONS + ('USER root',))} (and ignores "
                f"{', '.join(IGNORED_INSTRUCTIONS)}): remove it or express it with RUN ({LAYOUT_HINT})"
            )
        if not rest:
            raise TaskError(f"{at}: {instruction} needs arguments ({LAYOUT_HINT})")
        if instruction in ("COPY", "ADD", "RUN") and heredoc_terminators(logical):
            raise TaskRefused(f"{at}: heredocs in {instruction} are not supported locally; put the file in the build "
                              f"context and COPY it, or use the container sandbox ({LAYOUT_HINT})")
        if instruction == "FROM":
            image = [w for w in rest.split() if not w.startswith("--")]
            steps.append(DockerStep("FROM", (image[0] if image else rest,), line, workdir))
        elif instruction == "WORKDIR":
            target = posixpath.normpath(posixpath.join(workdir, rest.strip("\"'")))
            if not _under_app(target):
                raise TaskRefused(f"{at}: WORKDIR {target} is outside /app; the local sandbox has only /app writable ({LAYOUT_HINT})")
            workdir = target
            steps.append(DockerStep("WORKDIR", (target,), line, workdir))
        elif instruction == "ENV":
            steps.append(DockerStep("ENV", _parse_env(rest, at), line, workdir))
        elif instruction == "ARG":
            key, _, default = rest.partition("=")
            if not _ENV_KEY.match(key.strip()):
                raise TaskError(f"{at}: ARG expects NAME or NAME=default, got {rest!r} ({LAYOUT_HINT})")
            steps.append(DockerStep("ARG", (key.strip(), default.strip().strip("\"'")), line, workdir))
        elif instruction in ("COPY", "ADD"):
            steps.append(DockerStep("COPY", _parse_copy(instruction, rest, at, workdir, context_dir), line, workdir))
        else:  # RUN
            words = _json_or_shell_words(rest) if rest.startswith("[") else None
            if rest.startswith("[") and words is None:
                raise TaskError(f"{at}: RUN in JSON form must be a list of strings ({LAYOUT_HINT})")
            steps.append(DockerStep("RUN", (shlex.join(words) if words else rest,), line, workdir))
    return steps


def _parse_env(rest: str, at: str) -> tuple[str, ...]:
    try:
        words = shlex.split(rest)
    except ValueError as exc:
        raise TaskError(f"{at}: cannot parse ENV {rest!r} ({exc}); quote values properly ({LAYOUT_HINT})") from None
    pairs: list[str] = []
    if "=" in words[0]:
        for word in words:
            key, eq, value = word.partition("=")
            if not eq or not _ENV_KEY.match(key):
                raise TaskError(f"{at}: ENV expects KEY=VALUE pairs, got {word!r} ({LAYOUT_HINT})")
            pairs += [key, value]
    else:
        key, _, value = rest.partition(" ")
        if not _ENV_KEY.match(key) or not value.strip():
            raise TaskError(f"{at}: ENV expects `ENV KEY VALUE` or `ENV KEY=VALUE`, got {rest!r} ({LAYOUT_HINT})")
        pairs += [key, value.strip()]
    return tuple(pairs)


def _parse_copy(instruction: str, rest: str, at: str, workdir: str, context_dir: Path) -> tuple[str, ...]:
    try:
        words = _json_or_shell_words(rest)
    except ValueError as exc:
        raise TaskError(f"{at}: cannot parse {instruction} {rest!r} ({exc}) ({LAYOUT_HINT})") from None
    if words is None:
        raise TaskError(f"{at}: {instruction} in JSON form must be a list of strings ({LAYOUT_HINT})")
    flags = [w for w in words if w.startswith("--")]
    words = [w for w in words if not w.startswith("--")]
    for flag in flags:
        if flag.split("=", 1)[0] not in ("--chown", "--chmod", "--link"):
            raise TaskRefused(f"{at}: {instruction} flag {flag!r} is not supported locally (no multi-stage builds) ({LAYOUT_HINT})")
    if len(words) < 2:
        raise TaskError(f"{at}: {instruction} needs at least one source and a destination ({LAYOUT_HINT})")
    sources, dest = words[:-1], words[-1]
    for source in sources:
        if instruction == "ADD" and (re.match(r"^[a-z]+://", source) or source.startswith("git@")):
            raise TaskRefused(f"{at}: ADD from a URL ({source}) needs network at build time; vendor the file into the build context ({LAYOUT_HINT})")
        if instruction == "ADD" and _ARCHIVE.search(source):
            raise TaskRefused(f"{at}: ADD of an archive ({source}) would unpack it in Docker; not reproduced locally: use COPY and RUN tar ({LAYOUT_HINT})")
        norm = posixpath.normpath(source)
        if posixpath.isabs(norm) or norm == ".." or norm.startswith("../"):
            raise TaskError(f"{at}: {instruction} source {source!r} must be relative to the build context and stay inside it ({LAYOUT_HINT})")
        if not glob.glob(str(context_dir / norm)):
            raise TaskError(f"{at}: {instruction} source {source!r} not found in {context_dir}; add the file or fix the path ({LAYOUT_HINT})")
    target = posixpath.normpath(posixpath.join(workdir, dest))
    if not _under_app(target):
        raise TaskRefused(f"{at}: {instruction} destination {target} is outside /app; the local sandbox has only /app writable ({LAYOUT_HINT})")
    if dest.endswith("/") or dest in (".", "./"):
        target += "/"
    if len(sources) > 1 and not target.endswith("/"):
        raise TaskError(f"{at}: {instruction} with several sources needs a destination folder ending in '/' ({LAYOUT_HINT})")
    return (*sources, target)


def _number(table: dict, key: str, default: float, path: Path, section: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        where = "task.yaml" if section == "task.yaml" else f"task.toml [{section}]"
        raise _error(path, f"{where} {key} = {value!r} is not a positive number", f"fix {where.split()[0]}")
    return float(value)


def load_task(path: str | Path) -> Task:
    """Load and validate one task folder, either layout (``task.toml``: TB2; ``task.yaml``: TB1).

    Raises:
        TaskError: the folder is missing, lacks its required files, has invalid TOML/YAML or
            fields, or a Dockerfile that is malformed or names missing files. (What only the
            local backend cannot run is recorded in :attr:`Task.local_refusal` instead.)
    """
    folder = Path(path).resolve()
    if not folder.is_dir():
        raise _error(folder, "not a folder", "pass the path of a task folder")
    if not (folder / "task.toml").is_file() and (folder / "task.yaml").is_file():
        return load_tb1_task(folder)
    for required in ("task.toml", "instruction.md", "tests/test.sh"):
        if not (folder / required).is_file():
            raise _error(folder, f"missing {required}", "add it")
    try:
        config = tomllib.loads((folder / "task.toml").read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise _error(folder, f"task.toml is not valid TOML ({exc})", "fix its syntax") from None
    sections = {}
    for section in ("task", "metadata", "verifier", "agent", "environment"):
        sections[section] = config.get(section, {})
        if not isinstance(sections[section], dict):
            raise _error(folder, f"task.toml [{section}] must be a table", "fix task.toml")
    instruction = (folder / "instruction.md").read_text()
    if not instruction.strip():
        raise _error(folder, "instruction.md is empty", "write the task's instruction in it")
    name = sections["task"].get("name", folder.name)
    if not isinstance(name, str) or not name.strip():
        raise _error(folder, f"task.toml [task] name = {name!r} is not a non-empty string", "fix task.toml")
    environment = sections["environment"]
    allow_internet = environment.get("allow_internet", False)
    if not isinstance(allow_internet, bool):
        raise _error(folder, f"task.toml [environment] allow_internet = {allow_internet!r} is not a boolean", "use true or false")
    resources = {key: _optional_number(environment, key, folder) for key in ("cpus", "memory_mb", "storage_mb")}
    task = Task(
        name=name.strip(),
        path=folder,
        instruction=instruction,
        agent_timeout_s=_number(sections["agent"], "timeout_sec", DEFAULT_AGENT_TIMEOUT_S, folder, "agent"),
        verifier_timeout_s=_number(sections["verifier"], "timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S, folder, "verifier"),
        allow_internet=allow_internet,
        steps=[],
        docker_image=str(environment.get("docker_image") or ""),
        metadata=dict(sections["metadata"]),
        layout="tb2",
        context_dir=folder / "environment",
        test_script=folder / "tests" / "test.sh",
        cpus=resources["cpus"],
        memory_mb=None if resources["memory_mb"] is None else int(resources["memory_mb"]),
        storage_mb=None if resources["storage_mb"] is None else int(resources["storage_mb"]),
    )
    dockerfile = folder / "environment" / "Dockerfile"
    return _finish(task, dockerfile if dockerfile.is_file() else None, folder / "environment" / "docker-compose.yaml")


TB1_DEFAULT_RUN_TESTS = """#!/bin/bash
# t1async: the Terminal-Bench 1 harness's default for a task without run-tests.sh
source $TEST_DIR/setup-uv-pytest.sh
bash $TEST_DIR/run-uv-pytest.sh
"""
"""What a TB1 task without ``run-tests.sh`` is verified with (its helpers are supplied too, see
:mod:`t1async.envs.adapt`)."""


def test_script_text(task: Task) -> str | None:
    """The text of the task's test script (the TB1 default when the folder has none), or None."""
    assert task.test_script is not None
    if task.test_script.is_file():
        return task.test_script.read_text()
    return TB1_DEFAULT_RUN_TESTS if task.layout == "tb1" else None


def load_tb1_task(folder: Path) -> Task:
    """Load a Terminal-Bench 1 task folder (``task.yaml``; see the module docstring).

    Raises:
        TaskError: missing files, invalid YAML, a missing or empty instruction, bad timeouts.
    """
    import yaml

    if not (folder / "task.yaml").is_file():
        raise _error(folder, "missing task.yaml", "add it (Terminal-Bench 1 layout)")
    if not (folder / "run-tests.sh").is_file() and not (folder / "tests").is_dir():
        raise _error(folder, "missing run-tests.sh and tests/", "add them (Terminal-Bench 1 layout)")
    try:
        config = yaml.safe_load((folder / "task.yaml").read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise _error(folder, f"task.yaml is not valid YAML ({str(exc).splitlines()[0]})", "fix its syntax") from None
    if not isinstance(config, dict):
        raise _error(folder, "task.yaml must be a mapping", "fix task.yaml")
    instruction = config.get("instruction")
    if instruction is None and isinstance(config.get("descriptions"), list):  # early TB1 form
        base = [d for d in config["descriptions"] if isinstance(d, dict) and d.get("key", "base") == "base"]
        instruction = base[0].get("description") if base else None
    if not isinstance(instruction, str) or not instruction.strip():
        raise _error(folder, "task.yaml has no non-empty `instruction`", "write the task's instruction in it")
    parser = config.get("parser_name", "pytest")
    same_shell = config.get("run_tests_in_same_shell", False)
    if not isinstance(same_shell, bool):
        raise _error(folder, f"task.yaml run_tests_in_same_shell = {same_shell!r} is not a boolean", "use true or false")
    metadata = {k: config[k] for k in ("difficulty", "category", "tags", "author_email", "author_name") if k in config}
    solution, solution_refusal, commands = None, None, []
    if (folder / "solution.sh").is_file():
        solution = folder / "solution.sh"
    elif (folder / "solution.yaml").is_file():
        commands, why = _solution_commands(folder / "solution.yaml")
        if why:
            solution_refusal = (
                f"task {folder}: solution.yaml {why}: t1async's shell is not a terminal, so keystrokes cannot be "
                "replayed faithfully; add an equivalent solution.sh"
            )
    task = Task(
        name=folder.name,
        path=folder,
        instruction=instruction,
        agent_timeout_s=_number(config, "max_agent_timeout_sec", DEFAULT_TB1_AGENT_TIMEOUT_S, folder, "task.yaml"),
        verifier_timeout_s=_number(config, "max_test_timeout_sec", DEFAULT_TB1_TEST_TIMEOUT_S, folder, "task.yaml"),
        allow_internet=False,
        steps=[],
        metadata=metadata,
        layout="tb1",
        context_dir=folder,
        test_script=folder / "run-tests.sh",
        solution=solution,
        solution_refusal=solution_refusal,
        run_tests_in_same_shell=same_shell,
        solution_commands=commands,
    )
    if parser != "pytest":
        task.local_refusal = f"task.yaml parser_name {parser!r} is not supported: only pytest results are read"
    dockerfile = folder / "Dockerfile"
    return _finish(task, dockerfile if dockerfile.is_file() else None, folder / "docker-compose.yaml")


TMUX_KEYS = re.compile(r"^(?:[CM]-.|Escape|Enter|Tab|BSpace|Up|Down|Left|Right|Home|End|PPage|NPage|F\d+)$")
"""tmux key names: a solution.yaml step that is one of these is a keystroke, not a command."""

TB1_NONBLOCKING_TIMEOUT_S = 180.0
"""Least timeout of a ``block: false`` solution.yaml step: the TB1 harness waits for it only until
the next blocking step is done, which it bounds by that step's ``max_timeout_sec`` (180 s by default)."""

INTERACTIVE_PROGRAMS = frozenset({
    "python", "python2", "python3", "ipython", "ipython3", "node", "irb", "ghci", "julia", "lua", "R", "tclsh",
    "jimsh", "bc", "dc", "coqtop", "ocaml", "utop", "swipl", "guile", "sbcl", "racket", "erl", "iex", "scala",
    "bash", "sh", "dash", "zsh", "fish", "sqlite3", "psql", "mysql", "mariadb", "mongo", "mongosh", "redis-cli",
    "gdb", "lldb", "ftp", "sftp", "telnet", "ssh", "vim", "vi", "nvim", "nano", "emacs", "less", "more", "top",
    "htop", "watch",
})
"""Programs that read keystrokes from the terminal when started without a script or a command
argument (REPLs, database shells, editors, pagers): see :func:`reads_keystrokes`."""

_SCRIPT_FLAGS = frozenset({"-c", "-m", "-e", "--eval", "--command", "--execute", "-f", "--file", "-batch", "--batch",
                           "--version", "-V", "--help", "-h"})
"""Flags after which one of :data:`INTERACTIVE_PROGRAMS` runs a given command or script and ends."""

def reads_keystrokes(command: str) -> str | None:
    """The interactive program (one of :data:`INTERACTIVE_PROGRAMS`) that ``command`` leaves
    reading the terminal, else None.

    Only the last simple command of the line counts, and only when its input is the terminal
    (not the far end of a pipe, not redirected with ``<``, not put in the background with ``&``);
    it counts when it names no script or command to run (``python3``, ``python3 -i x.py``,
    ``sqlite3 db``, ``vim notes.txt``; not ``python3 x.py``, ``python3 -c ...``, ``psql -c ...``).
    A heuristic: TB1's tmux types the next step into such a program, which a shell that is not a
    terminal cannot reproduce.
    """
    text = command.strip()
    spans = split_commands(text)
    if not spans:
        return None
    start, end = spans[-1]
    if text[end:].strip().startswith("&") and not text[end:].strip().startswith("&&"):
        return None  # `prog &`: a background job does not read the terminal
    stages = parse_command(text[start:end]).stages
    if not stages:
        return None
    last = stages[-1]
    if len(stages) > 1 or any(r.startswith(("<", "0<")) for r in last.redirections):
        return None  # the far end of a pipe reads the pipe; `prog < file` reads the file
    words = list(last.words)
    if not words:
        return None
    program = words[0].rsplit("/", 1)[-1]
    base = re.sub(r"\d+(\.\d+)*$", "", program) if program.startswith("python") else program
    if program not in INTERACTIVE_PROGRAMS and base not in INTERACTIVE_PROGRAMS:
        return None
    args = words[1:]
    if program in ("vim", "vi", "nvim", "nano", "emacs", "less", "more", "top", "htop", "watch"):
        return program if "--version" not in args and "--help" not in args else None
    if any(a in _SCRIPT_FLAGS or a.startswith(("--command=", "--eval=", "--execute=")) for a in args):
        return None
    positional = [a for a in args if not a.startswith("-")]
    if "-i" in args or not positional:
        return program
    if program in ("sqlite3", "psql", "mysql", "mariadb", "mongo", "mongosh", "redis-cli", "gdb", "lldb", "ftp",
                   "sftp", "telnet", "ssh"):
        # a database or host argument still leaves the client reading (sqlite3 DB "SQL" does not)
        return program if len(positional) <= (1 if program != "redis-cli" else 0) else None
    return None  # a script argument: it runs and ends


def _solution_commands(path: Path) -> tuple[list[tuple[str, float]], str | None]:
    """TB1 ``solution.yaml`` steps as (command, timeout seconds), or why they are not plain commands.

    A step is a mapping with a ``command`` string; it is a plain command unless it is sent without
    Enter (``append_enter: false``) or is a tmux key name (``C-c``, ``Escape``). TB1's
    ``block: false`` means the harness does not wait for the step to finish before typing the next
    one, which the terminal holds until the step's program ends (type-ahead): such steps are
    replayed in order like the others, with a timeout of at least
    :data:`TB1_NONBLOCKING_TIMEOUT_S`. The one case a shell that is not a terminal cannot replay is
    a ``block: false`` step that leaves an interactive program reading keystrokes
    (:func:`reads_keystrokes`, e.g. ``python`` then ``import x`` typed into it): refused. A step's
    timeout is ``max_timeout_sec`` (else ``min_timeout_sec``), at least 60 s.
    """
    import yaml

    try:
        steps = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        return [], f"is not valid YAML ({str(exc).splitlines()[0]})"
    if not isinstance(steps, list) or not steps:
        return [], "is not a list of steps"
    commands: list[tuple[str, float]] = []
    for number, step in enumerate(steps, start=1):
        if not isinstance(step, dict) or not isinstance(step.get("command"), str):
            return [], f"step {number} has no `command` string"
        command = step["command"]
        if step.get("append_enter") is False or TMUX_KEYS.match(command.strip()):
            return [], f"step {number} ({command.strip()[:40]!r}) is a keystroke, not a command"
        previous = steps[number - 2] if number > 1 else None
        if previous is not None and previous.get("block") is False:
            program = reads_keystrokes(previous["command"])
            if program is not None:
                return [], (f"step {number} is typed into the interactive program {program!r} that step {number - 1} "
                            "starts without waiting for it (block: false)")
        timeout = step.get("max_timeout_sec") or step.get("min_timeout_sec") or 0
        seconds = max(60.0, float(timeout) if isinstance(timeout, (int, float)) else 0.0)
        if step.get("block") is False:
            seconds = max(seconds, TB1_NONBLOCKING_TIMEOUT_S)
        commands.append((command, seconds))
    return commands, None


def _optional_number(table: dict, key: str, path: Path) -> float | None:
    if key not in table:
        return None
    return _number(table, key, 1.0, path, "environment")


def _finish(task: Task, dockerfile: Path | None, compose: Path) -> Task:
    """Parse the Dockerfile and compose file, then plan the local adaptation (refusals)."""
    from .adapt import plan_container, plan_local

    task.dockerfile = dockerfile
    if compose.is_file():
        _read_compose(task, compose)  # the agent's service may build from another folder
    dockerfile = task.dockerfile
    if dockerfile is not None:
        try:
            task.steps = parse_dockerfile(dockerfile.read_text(), task.environment_dir, where=str(dockerfile))
        except TaskRefused as exc:
            task.local_refusal = task.local_refusal or str(exc)
            task.steps = []
        except TaskError as exc:
            raise TaskError(f"task {task.path}: {exc}") from None
    if not task.docker_image:
        task.docker_image = next((s.args[0] for s in task.steps if s.instruction == "FROM"), "")
    plan_local(task)
    plan_container(task)
    return task


MAIN_SERVICES = ("main", "client")
"""Names of the agent's own service in a docker-compose.yaml: Harbor's ``main`` (TB2), the TB1
harness's ``client``. Every other service is a sidecar (:attr:`Task.services`)."""


def _read_compose(task: Task, compose: Path) -> None:
    """docker-compose.yaml: the agent's service (the only one, or :data:`MAIN_SERVICES`) gives
    :attr:`Task.compose_env` (its ``environment`` entries except the harness's ``${T_BENCH_...}``
    ones); every other service becomes a :class:`~t1async.envs.protocol.ServiceSpec` in
    :attr:`Task.services` (run by the ``container`` backend; a local refusal)."""
    import yaml

    try:
        data = yaml.safe_load(compose.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise _error(task.path, f"{compose.name} is not valid YAML ({str(exc).splitlines()[0]})", "fix its syntax") from None
    services = data.get("services") if isinstance(data, dict) else None
    if not isinstance(services, dict) or not services:
        return
    main_name = next((n for n in MAIN_SERVICES if n in services), None)
    if len(services) > 1:
        task.local_refusal = task.local_refusal or (
            f"{compose.name} defines {len(services)} services ({', '.join(sorted(services))}): a multi-container "
            "task needs Docker Compose, which the local sandbox does not reproduce"
        )
        if main_name is None:
            raise _error(task.path, f"{compose.name} defines services {sorted(services)} but none is the agent's",
                         "name the agent's service 'main' (Harbor) or 'client' (Terminal-Bench 1)")
        main = services[main_name] if isinstance(services[main_name], dict) else {}
        task.services = [_compose_service(task, compose, str(name), body, main)
                         for name, body in services.items() if name != main_name]
    service = services[main_name] if main_name else next(iter(services.values()))
    build = service.get("build") if isinstance(service, dict) else None
    spec = build if isinstance(build, dict) else {"context": build}
    if build and (str(spec.get("context", ".")), str(spec.get("dockerfile", "Dockerfile"))) not in (
            (".", "Dockerfile"), ("./", "Dockerfile")):  # e.g. TB1 `client: {build: {context: client}}`
        task.context_dir, task.dockerfile = _compose_build(task, compose, "the agent's service", build)
    if isinstance(service, dict):
        if service.get("image") and not service.get("build") and not task.docker_image:
            task.docker_image = str(service["image"])
        env = service.get("environment") or {}
        pairs = env.items() if isinstance(env, dict) else (str(e).partition("=")[::2] for e in env)
        for key, value in pairs:
            value = "" if value is None else str(value)
            if "${" not in value and _ENV_KEY.match(str(key)):
                task.compose_env[str(key)] = value


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")


def _duration_s(value: Any, default: float) -> float:
    """A compose duration (``2s``, ``1m30s``, ``500ms``, or a number of seconds) in seconds."""
    if value is None:
        return default
    if isinstance(value, (int, float)):
        return float(value)
    parts = _DURATION.findall(str(value))
    if not parts or "".join(a + b for a, b in parts) != str(value).strip():
        return default
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(number) * scale[unit] for number, unit in parts)


def _compose_build(task: Task, compose: Path, who: str, build: Any) -> tuple[Path, Path]:
    """A compose ``build`` (a context path, or ``{context, dockerfile}``, relative to the compose
    file) as (context folder, Dockerfile), both resolved.

    Raises:
        TaskError: the Dockerfile does not exist (``who`` names the service in the message).
    """
    spec = build if isinstance(build, dict) else {"context": build}
    context = (compose.parent / str(spec.get("context", "."))).resolve()
    dockerfile = context / str(spec.get("dockerfile", "Dockerfile"))
    if not dockerfile.is_file():
        raise _error(task.path, f"{compose.name}: {who} builds from {dockerfile}, which does not exist",
                     "add it or fix build.context/dockerfile")
    return context, dockerfile


def _compose_service(task: Task, compose: Path, name: str, body: Any, main: dict) -> ServiceSpec:
    """One sidecar of a docker-compose.yaml as a :class:`ServiceSpec` (paths relative to the compose file).

    Raises:
        TaskError: it has neither ``build`` nor ``image``, or its Dockerfile is missing.
    """
    body = body if isinstance(body, dict) else {}
    build = body.get("build")
    context, dockerfile = _compose_build(task, compose, f"service {name!r}", build) if build else (None, None)
    image = str(body.get("image") or "")
    if "${" in image:  # a harness-chosen name (TB1's ${T_BENCH_...}), not an image to use
        image = ""
    if not build and not image:
        raise _error(task.path, f"{compose.name}: service {name!r} has neither build nor image", "give it one")
    command = body.get("command")
    if isinstance(command, str):
        command = ("sh", "-c", command)
    elif isinstance(command, list):
        command = tuple(str(c) for c in command)
    else:
        command = None
    env = body.get("environment") or {}
    pairs = env.items() if isinstance(env, dict) else (str(e).partition("=")[::2] for e in env)
    environment = tuple((str(k), "" if v is None else str(v)) for k, v in pairs if "${" not in str(v or ""))
    check = body.get("healthcheck") if isinstance(body.get("healthcheck"), dict) else {}
    test = check.get("test")
    if isinstance(test, str):
        healthcheck: tuple[str, ...] | None = ("sh", "-c", test)
    elif isinstance(test, list) and test and test[0] == "CMD":
        healthcheck = tuple(str(t) for t in test[1:])
    elif isinstance(test, list) and len(test) == 2 and test[0] == "CMD-SHELL":
        healthcheck = ("sh", "-c", str(test[1]))
    else:  # absent, or ["NONE"]
        healthcheck = None
    depends = main.get("depends_on") or {}
    condition = depends.get(name) if isinstance(depends, dict) else None
    wait = isinstance(condition, dict) and condition.get("condition") == "service_healthy"
    return ServiceSpec(
        name=name, dockerfile=dockerfile, context_dir=context, image=image, command=command, environment=environment,
        healthcheck=healthcheck, wait_healthy=wait and healthcheck is not None,
        health_interval_s=_duration_s(check.get("interval"), 2.0), health_retries=int(check.get("retries", 15)),
        health_start_period_s=_duration_s(check.get("start_period"), 0.0))


def task_folders(root: str | Path) -> list[Path]:
    """Candidate task folders under ``root``: sub-folders not starting with ``.`` or ``_``, sorted."""
    base = Path(root)
    if not base.is_dir():
        raise TaskError(f"tasks folder {base} does not exist or is not a folder; pass a folder of task folders ({LAYOUT_HINT})")
    return sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def discover_tasks(root: str | Path, names: Sequence[str] = (), *, skip_invalid: bool = False,
                   sandbox: str = "local") -> list[Task]:
    """Load the tasks under ``root`` (all, or those in ``names``), sorted by name.

    An invalid folder, or with ``sandbox="local"`` a task that backend refuses, raises unless
    ``skip_invalid`` is set (then it is skipped with a warning, except when named in ``names``).
    A name matches a folder name or a ``[task] name``.

    Raises:
        TaskError: ``root`` is missing or holds no valid task, a folder is invalid (and not
            skipped), a named task is missing or invalid, or two tasks share a name.
        TaskRefused: a task the local backend cannot run (and not skipped).
    """
    wanted = set(names)
    tasks: list[Task] = []
    available: list[str] = []
    for folder in task_folders(root):
        try:
            task = load_task(folder)
            if sandbox == "local" and task.local_refusal:
                raise TaskRefused(f"task {folder}: refused by the local sandbox: {task.local_refusal}")
        except TaskError as exc:
            if folder.name in wanted or not (skip_invalid or wanted):  # named tasks: a broken sibling is not used
                raise
            logger.warning("skipping invalid task folder: {}", exc)
            continue
        available.append(task.name)
        if wanted and folder.name not in wanted and task.name not in wanted:
            continue
        tasks.append(task)
    seen: dict[str, Path] = {}
    for task in tasks:
        if task.name in seen:
            raise TaskError(f"tasks {seen[task.name]} and {task.path} share the name {task.name!r}; rename one in its task.toml")
        seen[task.name] = task.path
    missing = sorted(wanted - {t.name for t in tasks} - {t.path.name for t in tasks})
    if missing:
        raise TaskError(f"task(s) {missing} not found under {root}; available: {sorted(available)} ({LAYOUT_HINT})")
    if not tasks:
        raise TaskError(f"no valid task under {root} ({LAYOUT_HINT})")
    return sorted(tasks, key=lambda t: t.name)
